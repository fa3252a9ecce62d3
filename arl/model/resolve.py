"""Where ``model.name_or_path`` points: a local Hugging Face directory, or a hub id already in the
local Hugging Face cache.  Never the network: a run that would download at start-up fails on a
machine without it, half-way through spawning processes, so a missing model fails here at once.
"""
from __future__ import annotations

import os
from pathlib import Path


def hf_cache_dir() -> str:
    """The hub cache huggingface_hub reads, from the environment *now* (its own constant is fixed
    when it is first imported): HF_HUB_CACHE, the legacy HUGGINGFACE_HUB_CACHE, HF_HOME/hub."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return os.path.expanduser(os.environ[key])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _from_cache(repo_id: str, cache_dir: str) -> str | None:
    """The cached snapshot directory of ``repo_id`` holding a config.json, or None."""
    from huggingface_hub import snapshot_download

    try:
        snap = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except Exception:  # not cached, or not a valid repo id (an absolute path, "a/b/c", ...)
        return None
    return snap if (Path(snap) / "config.json").is_file() else None


def resolve_model(name_or_path: str) -> str:
    """The local directory of ``name_or_path``: itself when it is a directory with config.json,
    else the snapshot of that hub id in the local HF cache.  Anything else: a one-line ValueError
    naming ``model.name_or_path`` and both places tried."""
    local = Path(name_or_path).expanduser()
    if (local / "config.json").is_file():
        return str(local)
    cache = hf_cache_dir()
    snap = _from_cache(name_or_path, cache)
    if snap is not None:
        return snap
    raise ValueError(f"model.name_or_path: {name_or_path} is neither a local model directory nor in the local "
                     f"Hugging Face cache (tried {local.absolute()} and {cache})")


# model.arch field -> the config.json key it describes
_ARCH_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab_size": "vocab_size",
              "tie_word_embeddings": "tie_word_embeddings", "head_dim": "head_dim"}


def arch_mismatches(arch, model_dir: str) -> list[str]:
    """Where ``model.arch`` (the dry run's plan) disagrees with the model's own config.json, as
    ``field=planned (config.json key=actual)``; keys config.json lacks are not compared."""
    import json

    with open(Path(model_dir) / "config.json") as f:
        actual = json.load(f)
    out = []
    for field, key in _ARCH_KEYS.items():
        planned = arch.head_size if field == "head_dim" else getattr(arch, field)  # unset: hidden / heads
        if key in actual and actual[key] is not None and planned != actual[key]:
            out.append(f"{field}={planned} ({key}={actual[key]})")
    return out
