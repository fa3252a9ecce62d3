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
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_ids: torch.Tensor,
    rollout_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    config: Optional[LossConfig] = None,
    normalizer: Optional[float] = None,
    backend: str = "reference",
) -> LossOutput:
    """Clipped / TOPR policy loss over a packed batch; see ``spec.py`` for the math.

    ``advantages`` [N] (required): one advantage per trajectory, computed over the whole step before
    packing by an estimator of ``arl.algo.advantages`` (e.g. ``group_advantages(rewards, group_ids,
    "grpo", eps)``).  The op never normalizes groups; gamma discounting and positive_only apply per
    chunk.  Step-level figures of the advantages (zero-variance groups) are reported with them.
    """
    cfg = config if config is not None else LossConfig()
    if not cfg.validate_inputs:  # the advantages are checked even so (validate_inputs checks them too)
        validate_advantages(advantages, cu_seqlens, False)
    inp = LossInputs(
        logp=logp, old_logp=old_logp, advantages=advantages, cu_seqlens=cu_seqlens, chunk_ids=chunk_ids,
        rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=entropy,
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
    return _BACKENDS[name](inp, cfg, normalizer)

