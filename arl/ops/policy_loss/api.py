"""policy_loss: the public entry point, and the registry of loss backends.

A backend is ``fn(inputs: LossInputs, config: LossConfig, normalizer) -> LossOutput`` whose loss is
differentiable w.r.t. ``inputs.logp`` (and ``inputs.entropy``).  Kernels register themselves with
``register_backend`` (fused.py), each with the options it accelerates (``covers``: LossConfig key ->
values, options.py ``KERNEL_COVERS``); ``reference`` is the specification they are tested against and
covers every registered surrogate and KL estimator.  ``backend="auto"`` takes the fastest available
backend of the tensors' device that covers the config, else the reference (``choose_backend``).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .config import LossConfig
from .group_adv import GroupAdvantages, validate_group
from .options import uncovered
from .spec import reference_policy_loss
from .types import LossInputs, LossOutput
from .validate import validate_advantages, validate_inputs

Backend = Callable[[LossInputs, LossConfig, Optional[float]], LossOutput]
_BACKENDS: Dict[str, Backend] = {}
_AVAILABLE: Dict[str, Callable[[], bool]] = {}
_COVERS: Dict[str, Optional[dict]] = {}  # None: every option (the reference)
# auto's candidates per device type, fastest first (bench/bench_policy_loss.py)
_FASTEST = {"cuda": ("cuda", "triton"), "cpu": ("cpu",)}


def register_backend(name: str, available: Callable[[], bool] = lambda: True, covers: Optional[dict] = None):
    """``covers``: LossConfig key -> the values the backend runs (options.py ``uncovered``); None: all."""
    def deco(fn: Backend) -> Backend:
        _BACKENDS[name] = fn
        _AVAILABLE[name] = available
        _COVERS[name] = covers
        return fn

    return deco


def backend_covers(name: str) -> Optional[dict]:
    """The options backend ``name`` declared it runs (None: every registered option)."""
    return _COVERS[name]


def not_covered(name: str, cfg: LossConfig, estimator: Optional[str] = None) -> Optional[str]:
    """The first option of ``cfg`` backend ``name`` does not run (``"surrogate 'cispo'"``), or None;
    ``estimator``: the group estimator computed in the pass (None: advantages given)."""
    covers = _COVERS[name]
    return None if covers is None else uncovered(cfg, covers, estimator)


def available_backends() -> list[str]:
    return [n for n in _BACKENDS if _AVAILABLE[n]()]


register_backend("reference")(reference_policy_loss)


def choose_backend(cfg: LossConfig, device: str, estimator: Optional[str] = None) -> tuple[str, str]:
    """(backend, why) of ``backend="auto"`` for tensors on ``device`` ("cpu" / "cuda"): the fastest
    available backend that covers ``cfg`` (and the in-pass ``estimator``, when given), else the
    torch reference."""
    missing = []
    for name in _FASTEST.get(device, ()):
        if name not in _BACKENDS or not _AVAILABLE[name]():
            missing.append(f"{name} not available here")
        elif (gap := not_covered(name, cfg, estimator)) is not None:
            missing.append(f"{name} does not cover {gap}")
        else:
            return name, f"the fastest {device} kernel covering the loss options"
    if missing and all("does not cover" in m for m in missing):
        return "reference", f"{cfg.surrogate} has no fused backend ({'; '.join(missing)}): torch reference"
    why = "; ".join(missing) if missing else f"no fused backend for {device}"
    return "reference", f"{why}: torch reference"


def _auto(inp: LossInputs, cfg: Optional[LossConfig] = None) -> str:
    """GPU tensors: CUDA op, else Triton; CPU tensors: the C++ op; each only where it covers the
    config; the reference as the last resort."""
    est = inp.group.estimator if inp.group is not None else None
    return choose_backend(cfg if cfg is not None else LossConfig(), "cuda" if inp.logp.is_cuda else "cpu", est)[0]


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    *,
    advantages: Optional[torch.Tensor] = None,
    cu_seqlens: torch.Tensor,
    chunk_ids: torch.Tensor,
    rollout_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    config: Optional[LossConfig] = None,
    normalizer: Optional[float] = None,
    backend: str = "reference",
    group: Optional[GroupAdvantages] = None,
) -> LossOutput:
    """The policy loss of any registered surrogate over a packed batch; see ``spec.py`` for the math.

    ``advantages`` [N]: one advantage per trajectory, computed over the whole step before
    packing by an estimator of ``arl.algo.advantages`` (e.g. ``group_advantages(rewards, group_ids,
    "grpo", eps)``).  Or, instead (``loss.advantages_in_pass``), ``group``: each sequence's reward and
    group row with the whole step's group statistics (group_adv.py ``StepGroups.take``), from which
    the pass computes the group estimator's A_i.  Gamma discounting and positive_only apply per chunk.
    """
    cfg = config if config is not None else LossConfig()
    if group is not None:  # shapes and dtypes always; rows and values with validate_inputs (off: the
        # C++ op refuses a row outside the table, the GPU kernels read it as NaN)
        if advantages is not None:
            raise ValueError("advantages: give either advantages or group (the in-pass inputs), not both")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
            raise ValueError("cu_seqlens: expected a 1-D tensor [N+1]")
        validate_group(group, cu_seqlens.numel() - 1, logp.device, values=cfg.validate_inputs)
    elif not cfg.validate_inputs:  # the advantages are checked even so (validate_inputs checks them too)
        validate_advantages(advantages, cu_seqlens, False)
    inp = LossInputs(
        logp=logp, old_logp=old_logp, advantages=advantages, cu_seqlens=cu_seqlens, chunk_ids=chunk_ids,
        rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=entropy, group=group,
    )
    if isinstance(normalizer, torch.Tensor):
        normalizer = float(normalizer.item())
    if cfg.validate_inputs:
        validate_inputs(inp, cfg, normalizer)
    name = _auto(inp, cfg) if backend == "auto" else backend
    if name not in _BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; choose from {['auto'] + sorted(_BACKENDS)}")
    if not _AVAILABLE[name]():
        raise ValueError(f"backend: {name!r} is not available here; available: {available_backends()}")
    if (gap := not_covered(name, cfg, inp.group.estimator if inp.group is not None else None)) is not None:
        raise ValueError(f"backend: {name!r} does not run {gap}; use 'auto' (falls back to the torch reference) "
                         "or 'reference'")
    return _BACKENDS[name](inp, cfg, normalizer)

