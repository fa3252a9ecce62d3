"""policy_loss: the public entry point, and the registry of loss backends.

A backend is ``fn(inputs: LossInputs, config: LossConfig, normalizer) -> LossOutput`` whose loss is
differentiable w.r.t. ``inputs.logp`` (and ``inputs.entropy``).  Kernels register themselves with
``register_backend`` (fused.py); ``reference`` is the specification they are tested against.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .config import LossConfig
from .spec import reference_policy_loss
from .types import LossInputs, LossOutput
from .validate import validate_advantages, validate_inputs

Backend = Callable[[LossInputs, LossConfig, Optional[float]], LossOutput]
_BACKENDS: Dict[str, Backend] = {}
_AVAILABLE: Dict[str, Callable[[], bool]] = {}


def register_backend(name: str, available: Callable[[], bool] = lambda: True):
    def deco(fn: Backend) -> Backend:
        _BACKENDS[name] = fn
        _AVAILABLE[name] = available
        return fn

    return deco


def available_backends() -> list[str]:
    return [n for n in _BACKENDS if _AVAILABLE[n]()]


register_backend("reference")(reference_policy_loss)


def _auto(inp: LossInputs) -> str:
    """GPU tensors: CUDA op, else Triton; CPU tensors: the C++ op; reference as the last resort."""
    order = ("cuda", "triton") if inp.logp.is_cuda else ("cpu",)
    for name in order:
        if name in _BACKENDS and _AVAILABLE[name]():
            return name
    return "reference"


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_ids: torch.Tensor,
    rollout_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    config: Optional[LossConfig] = None,
    normalizer: Optional[float] = None,
    advantages: Optional[torch.Tensor] = None,
    backend: str = "reference",
) -> LossOutput:
    """Clipped / TOPR policy loss over a packed batch; see ``spec.py`` for the math.

    ``advantages`` ([N], optional) overrides the in-batch group normalization with per-trajectory
    advantages computed over the whole step (the trainer's come from
    ``arl.stabilizers.advantages``; ``spec.group_advantages`` over the step's rewards is the plain
    case) — needed when a group is split across micro-batches or ranks.  gamma discounting and
    positive_only still apply per chunk; ``zero_var_group_frac`` is then a step-level figure,
    reported with the step's advantages, not here.
    """
    cfg = config if config is not None else LossConfig()
    if advantages is not None:
        validate_advantages(advantages, rewards, cfg.validate_inputs)
    inp = LossInputs(
        logp=logp, old_logp=old_logp, rewards=rewards, group_ids=group_ids, cu_seqlens=cu_seqlens,
        chunk_ids=chunk_ids, rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=entropy, advantages=advantages,
    )
    if isinstance(normalizer, torch.Tensor):
        normalizer = float(normalizer.item())
    if cfg.validate_inputs:
        validate_inputs(inp, cfg, normalizer)
    name = _auto(inp) if backend == "auto" else backend
    if name not in _BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; choose from {['auto'] + sorted(_BACKENDS)}")
    if not _AVAILABLE[name]():
        raise ValueError(f"backend: {name!r} is not available here; available: {available_backends()}")
    out = _BACKENDS[name](inp, cfg, normalizer)
    if advantages is not None:  # a step-level figure then, reported with the step's advantages
        out.metrics.pop("zero_var_group_frac", None)
    return out

