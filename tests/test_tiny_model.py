"""The locally built tiny model + tokenizer: deterministic, cached, untied by default (tied on
request, one tensor on disk), HF-loadable, chat template with tool turns, tag tokens that survive
detokenization."""
from __future__ import annotations

import json

import pytest

from arl.config import TinyModelConfig
from arl.model.tiny import build_corpus, build_tiny_model

CORPUS = ["Find the value for k17.", '<tool_call>{"name": "lookup", "arguments": {"key": "k03"}}</tool_call>',
          "<answer>v42</answer>", "error: malformed tool call"] * 3
SMALL = TinyModelConfig(vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_position=256)


def test_build_is_deterministic_and_cached(tmp_path):
    a = build_tiny_model(tmp_path / "a", SMALL, corpus=CORPUS)
    b = build_tiny_model(tmp_path / "b", SMALL, corpus=CORPUS)
    for f in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "a", SMALL, corpus=CORPUS) == a  # cache hit: not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    c = build_tiny_model(tmp_path / "a", SMALL, seed=1, corpus=CORPUS)
    assert (c / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()  # key changed: rebuilt
    assert json.loads((c / "arl_tiny.json").read_text())["seed"] == 1


def test_loads_in_transformers_untied_with_chat_template(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_tiny_model(tmp_path / "m", SMALL, corpus=CORPUS)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.tie_word_embeddings is False and len(tok) == SMALL.vocab_size
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    tied = build_tiny_model(tmp_path / "t", SMALL.model_copy(update={"tie_word_embeddings": True}), corpus=CORPUS)
    from safetensors import safe_open

    with safe_open(str(tied / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    tm = AutoModelForCausalLM.from_pretrained(tied)
    assert tm.config.tie_word_embeddings is True and tm.lm_head.weight is tm.model.embed_tokens.weight
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\na"
                    "<|im_end|>\n<|im_start|>tool\nt<|im_end|>\n<|im_start|>assistant\n")
    for tag in ("<tool_call>", "</tool_call>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(tag, add_special_tokens=False)) == 1
    ids = tok.encode("<|im_start|>x<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>{}</tool_call>"  # tags are text
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    ids = tok.encode("héllo wörld 12 ∑", add_special_tokens=False)  # byte-level: nothing is unknown
    assert tok.decode(ids) == "héllo wörld 12 ∑"
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), SMALL.vocab_size)


def test_corpus_from_registered_env_and_bad_input(tmp_path):
    corpus = build_corpus(("toy_lookup",), seeds=2)
    assert any("k" in t and "<tool_call>" in t for t in corpus) and corpus == build_corpus(("toy_lookup",), seeds=2)
    with pytest.raises(ValueError, match="envs"):
        build_corpus(("no_such_env",))
    with pytest.raises(ValueError, match="hidden"):
        TinyModelConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        TinyModelConfig(vocab_size=100)
    with pytest.raises(ValueError, match="corpus"):
        build_tiny_model(tmp_path / "x", SMALL, corpus=[])
