"""A tiny model and tokenizer built locally (no download), in Hugging Face format.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on a deterministic corpus (the
registered environments' system prompts, tasks and expert demonstrations, plus fallback text),
with the chat-template special tokens; the model is a Qwen2, untied unless ``tie_word_embeddings``
(arl/model/tied.py).  The output directory loads in transformers and vLLM.  Builds are cached under a
content hash of (config, corpus), so a repeated call returns at once.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import arl.env  # noqa: F401  (registers the built-in environments, whose texts make the corpus)

from ..config import TinyModelConfig
from ..env.registry import ENVIRONMENTS, make_env
from .files import save_model_dir

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn; also the model's eos
# Control tokens: never shown as text, so vLLM's detokenizer can skip them.
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Tool/answer tags are single tokens but *not* special: they must survive detokenization so that
# stop strings ("</tool_call>") match and tool calls parse from the text.
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<answer>", "</answer>")

# Qwen-like ChatML; the tool role is rendered as its own turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

FALLBACK_TEXT = """\
You are a helpful assistant. Think step by step, call tools when you need information and give the
final answer inside answer tags. To call a tool write
<tool_call>{"name": "lookup", "arguments": {"key": "alpha"}}</tool_call> and wait for the result.
<answer>42</answer>
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . : ; ' " ?
def solve(x):\n    return x * 2 + 1\nprint(solve(3))\nimport math\nfor i in range(10):\n    pass
Error: malformed tool call. Tool error: unknown tool. Observation: value is 17. The key maps to.
"""

_CACHE_VERSION = 1  # bump when the build recipe changes
_BUILD_LOCK = threading.Lock()


def _run_coro(coro):
    """Run a coroutine from sync code, even when the caller's thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(coro)))
    t.start()
    t.join()
    return box["r"]


async def _env_texts(name: str, seeds: int, kwargs: Mapping) -> list[str]:
    env = make_env(name, **kwargs)
    texts = [env.system_prompt or ""]
    try:
        for seed in range(seeds):
            texts.append(await env.reset(seed))
            texts.extend(env.expert_turns() or [])
    finally:
        await env.close()
    return texts


def build_corpus(envs: Sequence[str] | None = None, seeds: int = 16,
                 env_kwargs: Mapping[str, Mapping] | None = None) -> list[str]:
    """Deterministic training text: registered environments' prompts, tasks, demonstrations.
    ``env_kwargs``: constructor arguments by env name, for an env that cannot be made without them
    (a run's configured ``env.kwargs``: MCP's ``command``)."""
    names = sorted(ENVIRONMENTS) if envs is None else list(envs)
    texts = [FALLBACK_TEXT]
    for name in names:
        given = dict((env_kwargs or {}).get(name) or {})
        # the env as registered first, so that the tiny models of configs whose env needs no
        # arguments (and the runs measured on them) keep their tokenizer; the given kwargs where
        # it cannot be made or reset without them
        tries = [{}, given] if given else [{}]
        for n, kwargs in enumerate(tries):
            try:
                texts.extend(_run_coro(_env_texts(name, seeds, kwargs)))
                break
            except Exception as e:  # an env that needs arguments or resources: skip it, loudly in metadata
                if n + 1 < len(tries) or envs is None:
                    continue
                first = str(e).splitlines()[0] if str(e) else ""
                raise ValueError(f"envs: environment {name!r} could not produce the tiny model's corpus text "
                                 f"(model.name_or_path: tiny; {type(e).__name__}: {first})") from None
    return [t for t in texts if t]


def _train_tokenizer(corpus: Iterable[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token=IM_END, pad_token=PAD_TOKEN,
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=1 << 20)


def _build_model(cfg: TinyModelConfig, tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mcfg = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_position,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings, use_sliding_window=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), bos_token_id=None,
        torch_dtype="float32")
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(mcfg)
    return model.float()


def default_cache_dir() -> Path:
    return Path(os.environ.get("ARL_CACHE", Path.home() / ".cache" / "arl")) / "tiny"


def build_tiny_model(out_dir: str | os.PathLike | None = None, config: TinyModelConfig | None = None, *,
                     seed: int = 0, envs: Optional[Sequence[str]] = None, corpus_seeds: int = 16,
                     corpus: Sequence[str] | None = None, env_kwargs: Mapping[str, Mapping] | None = None) -> Path:
    """Build (or reuse) the tiny model + tokenizer of ``config`` (the ``model.tiny`` section); return
    the HF-format directory.

    ``out_dir``: where to put it (default: the cache, keyed by content hash).  ``seed``: the weights'
    init seed.  ``corpus``: the tokenizer's training text (default: ``build_corpus(envs,
    corpus_seeds, env_kwargs)``, every registered environment when ``envs`` is None).
    """
    cfg = config or TinyModelConfig()
    if corpus is None:
        corpus = build_corpus(envs, corpus_seeds, env_kwargs)
    corpus = list(corpus)
    if not corpus or not all(isinstance(t, str) for t in corpus):
        raise ValueError("corpus: must be a non-empty list of strings")
    key = hashlib.sha256(json.dumps(
        {"v": _CACHE_VERSION, "cfg": cfg.model_dump(), "seed": seed, "corpus": corpus}, sort_keys=True, default=list
    ).encode()).hexdigest()[:16]
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / key
    marker = out / "arl_tiny.json"
    with _BUILD_LOCK:
        if marker.exists() and json.loads(marker.read_text()).get("key") == key:
            return out
        tokenizer = _train_tokenizer(corpus, cfg.vocab_size)
        model = _build_model(cfg, tokenizer, seed)
        meta = json.dumps({"key": key, "config": cfg.model_dump(), "seed": seed}, default=list)
        save_model_dir(out, model, tokenizer, extra={marker.name: meta})  # concurrent builders never see half a dir
    return out
