"""Input checks for policy_loss: every bad input is a ValueError naming the argument and index.

The checks are vectorized (a few passes over T) and can be switched off with
``LossConfig(validate_inputs=False)`` once a pipeline is trusted.
"""
from __future__ import annotations

import math

import torch

from .config import LossConfig
from .types import LossInputs

_TOKEN_FLOATS = ("old_logp", "rollout_logp", "ref_logp", "entropy")
MAX_UNCLAMPED_LOG_RATIO = 80.0  # exp(80) ~ 5.5e34 < fp32 max; times an advantage it stays finite


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0].item())


def _need_1d(name: str, x, floating: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")
    if not floating and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise ValueError(f"{name}: expected an integer dtype, got {x.dtype}")


def _finite(name: str, x: torch.Tensor, where: torch.Tensor | None = None) -> None:
    bad = ~torch.isfinite(x)
    if where is not None:
        bad &= where
    if bool(bad.any()):
        i = _first(bad)
        raise ValueError(f"{name}: non-finite value {x[i].item()} at index {i}")


def validate_inputs(inp: LossInputs, cfg: LossConfig, normalizer=None) -> None:
    T, N = _check_shapes(inp, cfg)
    cu = _check_cu_seqlens(inp.cu_seqlens.long(), N, T)
    cid = inp.chunk_ids.long()
    low = cid < -1
    if bool(low.any()):
        i = _first(low)
        raise ValueError(f"chunk_ids: value {int(cid[i])} at token index {i} (use -1 for untrained tokens)")
    trained = cid >= 0
    if inp.group is None:  # in-pass inputs were checked by policy_loss (group_adv.validate_group)
        _finite("advantages", inp.advantages)
    for name in ("logp", "old_logp") + _TOKEN_FLOATS:
        x = getattr(inp, name)
        if x is not None:
            _finite(name, x, trained)  # untrained positions (prompt, observation) may hold anything
    _check_chunk_order(cid, trained, cu, N)
    if cfg.log_ratio_clamp is None:
        _check_unclamped_ratios(inp, cfg, trained)
    if normalizer is not None:
        v = float(normalizer)
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"normalizer: must be a positive finite number, got {v}")


def _check_shapes(inp: LossInputs, cfg: LossConfig) -> tuple[int, int]:
    """Types, shapes, devices, and the optional inputs the config needs; returns (T, N)."""
    _need_1d("logp", inp.logp, True)
    T = inp.logp.numel()
    if T == 0:
        raise ValueError("logp: empty batch (0 tokens)")
    _need_1d("old_logp", inp.old_logp, True)
    if inp.group is None:
        validate_advantages(inp.advantages, None, False)  # present, 1-D floating; its count is checked below
    _need_1d("cu_seqlens", inp.cu_seqlens, False)
    _need_1d("chunk_ids", inp.chunk_ids, False)
    N = inp.advantages.numel() if inp.group is None else inp.group.rewards.numel()
    if N == 0:
        raise ValueError("advantages: empty batch (0 sequences)")

    required = {
        "rollout_logp": (cfg.mismatch_level != "none", f"mismatch_level={cfg.mismatch_level!r}"),
        "ref_logp": (cfg.kl_beta > 0, f"kl_beta={cfg.kl_beta}"),
        "entropy": (cfg.entropy_coef != 0, f"entropy_coef={cfg.entropy_coef}"),
    }
    for name, (needed, why) in required.items():
        if needed and getattr(inp, name) is None:
            raise ValueError(f"{name}: required by {why}")

    dev = inp.logp.device
    for name in ("old_logp", "advantages", "cu_seqlens", "chunk_ids") + _TOKEN_FLOATS:
        x = getattr(inp, name)
        if x is not None and x.device != dev:
            raise ValueError(f"{name}: on device {x.device}, but logp is on {dev}")
    for name in _TOKEN_FLOATS:
        x = getattr(inp, name)
        if x is None:
            continue
        _need_1d(name, x, True)
        if x.shape != inp.logp.shape:
            raise ValueError(f"{name}: shape {tuple(x.shape)} does not match logp {tuple(inp.logp.shape)}")
    if inp.old_logp.shape != inp.logp.shape:
        raise ValueError(f"old_logp: shape {tuple(inp.old_logp.shape)} does not match logp {tuple(inp.logp.shape)}")
    if inp.chunk_ids.numel() != T:
        raise ValueError(f"chunk_ids: {inp.chunk_ids.numel()} entries, but logp has {T} tokens")
    if inp.cu_seqlens.numel() != N + 1:
        raise ValueError(f"cu_seqlens: {inp.cu_seqlens.numel()} entries, expected N+1 = {N + 1} (N = len(advantages))")
    return T, N


def _check_cu_seqlens(cu: torch.Tensor, N: int, T: int) -> torch.Tensor:
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got {int(cu[0])} at index 0")
    dec = cu[1:] < cu[:-1]
    if bool(dec.any()):
        i = _first(dec) + 1
        raise ValueError(f"cu_seqlens: decreases at index {i} ({int(cu[i])} after {int(cu[i - 1])})")
    if int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens: last entry {int(cu[-1])} at index {N} must equal the token count {T}")
    return cu


def _check_chunk_order(cid: torch.Tensor, trained: torch.Tensor, cu: torch.Tensor, N: int) -> None:
    """Trained chunk ids never go backwards and no chunk spans two sequences."""
    tidx = trained.nonzero().squeeze(1)
    if tidx.numel() <= 1:
        return
    c = cid[tidx]
    seq = torch.repeat_interleave(torch.arange(N, device=cid.device), cu[1:] - cu[:-1])[tidx]
    back = c[1:] < c[:-1]
    if bool(back.any()):
        j = _first(back) + 1
        raise ValueError(
            f"chunk_ids: goes backwards at token index {int(tidx[j])} ({int(c[j])} after {int(c[j - 1])})"
        )
    cross = (seq[1:] != seq[:-1]) & (c[1:] == c[:-1])
    if bool(cross.any()):
        j = _first(cross) + 1
        raise ValueError(
            f"chunk_ids: chunk {int(c[j])} crosses from sequence {int(seq[j - 1])} into sequence "
            f"{int(seq[j])} at token index {int(tidx[j])}"
        )


def _check_unclamped_ratios(inp: LossInputs, cfg: LossConfig, trained: torch.Tensor) -> None:
    """Without log_ratio_clamp, exp() of every log-ratio on a trained token must stay finite in fp32."""
    pairs = [("logp", inp.logp, inp.old_logp, "old_logp")]
    if cfg.mismatch_level != "none":
        pairs.append(("rollout_logp", inp.rollout_logp, inp.old_logp, "old_logp"))
    if cfg.kl_beta > 0 and cfg.kl_estimator == "k3":
        pairs.append(("ref_logp", inp.ref_logp, inp.logp, "logp"))
    for name, a, b, other in pairs:
        d = (a.double() - b.double()).abs()
        bad = (d > MAX_UNCLAMPED_LOG_RATIO) & trained
        if bool(bad.any()):
            i = _first(bad)
            raise ValueError(f"{name}: |{name} - {other}| = {d[i].item():.4g} at index {i} would overflow exp() "
                             f"with log_ratio_clamp=None (limit {MAX_UNCLAMPED_LOG_RATIO}); set a clamp")


def validate_advantages(advantages, cu_seqlens, check_finite: bool) -> None:
    """The per-trajectory advantages policy_loss requires: a 1-D floating tensor [N] (N = len(cu_seqlens)
    - 1 when ``cu_seqlens`` is given), finite when ``check_finite``.  policy_loss runs it alone when
    ``validate_inputs`` is off; ``validate_inputs`` runs it as part of its checks."""
    if advantages is None:
        raise ValueError("advantages: required, [N] per-trajectory advantages (see arl.algo.advantages)")
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1 or not advantages.is_floating_point():
        what = (f"shape {tuple(advantages.shape)} dtype {advantages.dtype}" if isinstance(advantages, torch.Tensor)
                else type(advantages).__name__)
        raise ValueError(f"advantages: expected a 1-D floating tensor [N], got {what}")
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and advantages.numel() != cu_seqlens.numel() - 1:
        raise ValueError(f"advantages: {advantages.numel()} entries, but cu_seqlens has "
                         f"{cu_seqlens.numel() - 1} sequences")
    if check_finite:
        _finite("advantages", advantages)
