"""THE option table of the policy-loss kernels, and the input preparation every kernel shares.

Every backend (C++, CUDA, Triton) reads its options from ``kernel_options`` and its tensors from
``kernel_tensors``; nothing else maps LossConfig strings to numbers.  The codes are the enums of
csrc/policy_loss/core.h (tests/ops/test_policy_loss_options.py parses the header and compares).

The kernels receive per-trajectory advantages A_i ([N], ``LossInputs.advantages``, computed by an
estimator of arl/algo/advantages.py before packing), or, with ``loss.advantages_in_pass``, per-trajectory
rewards, group rows and the step's group statistics (``LossInputs.group``, group_adv.py), from which
they compute the group estimator's A_i inside the pass.
"""
from __future__ import annotations

from typing import Optional

import torch

from .config import LossConfig
from .group_adv import IN_PASS
from .types import LossInputs

# LossConfig value -> code (enums Level, Surrogate, MismatchMode, LossAgg, KL of core.h)
LEVEL = {"token": 0, "sequence": 1, "chunk": 2, "none": 3}
SURROGATE = {"ppo_clip": 0, "topr": 1}
MISMATCH_MODE = {"mask": 0, "truncate": 1}
LOSS_AGG = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3}
KL = {"off": 0, "k1": 1, "k2": 2, "k3": 3}
ADV_GIVEN = 0  # enum AdvEstimator: advantages given; IN_PASS (group_adv.py) has the in-pass codes

# order of the ops' `int[] iopts` / `float[] fopts` (enums IOpt / FOpt of core.h)
IOPTS = ("ratio_level", "surrogate", "positive_only", "mismatch_level", "mismatch_mode", "loss_agg",
         "kl", "entropy_term", "has_dual", "has_clamp", "has_agg_constant", "has_normalizer", "adv_estimator")
FOPTS = ("clip_low", "clip_high", "dual_clip", "gamma", "mismatch_low", "mismatch_high", "agg_constant",
         "kl_beta", "entropy_coef", "log_ratio_clamp", "normalizer", "adv_eps")

KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

# What a kernel of this table accelerates: LossConfig key -> the values it has a code for.  The C++,
# CUDA and Triton backends declare it (fused.py); a config outside it runs on the torch reference.
# advantages_in_pass: the group estimators the kernel computes in the pass (its value is the run's
# estimator, algo.advantage, when loss.advantages_in_pass is on).
KERNEL_COVERS = dict(
    ratio_level=frozenset(LEVEL) - {"none"}, surrogate=frozenset(SURROGATE), mismatch_level=frozenset(LEVEL),
    mismatch_mode=frozenset(MISMATCH_MODE), loss_agg=frozenset(LOSS_AGG), kl_estimator=frozenset(KL) - {"off"},
    advantages_in_pass=frozenset(IN_PASS),
)


def uncovered(cfg: LossConfig, covers: dict, estimator: Optional[str] = None) -> Optional[str]:
    """The first option of ``cfg`` outside ``covers`` as ``"key 'value'"``, or None when all are in.
    Options a config switches off (the KL estimator at kl_beta 0, the mismatch mode at level none,
    the in-pass estimator when the advantages are given) never exclude a backend.  ``estimator``:
    the group estimator the pass computes (None: the advantages are given)."""
    idle = {"kl_estimator": cfg.kl_beta == 0, "mismatch_mode": cfg.mismatch_level == "none",
            "advantages_in_pass": estimator is None}
    for key, values in covers.items():
        v = estimator if key == "advantages_in_pass" else getattr(cfg, key)
        if not idle.get(key, False) and v not in values:
            return f"{key} {v!r}"
    return None


def kernel_options(cfg: LossConfig, normalizer: Optional[float], group=None) -> tuple[list[int], list[float]]:
    """LossConfig -> (iopts, fopts) in IOPTS / FOPTS order; ``group``: the in-pass inputs, or None."""
    i = dict(
        ratio_level=LEVEL[cfg.ratio_level], surrogate=SURROGATE[cfg.surrogate],
        positive_only=int(cfg.positive_only),
        mismatch_level=LEVEL[cfg.mismatch_level], mismatch_mode=MISMATCH_MODE[cfg.mismatch_mode],
        loss_agg=LOSS_AGG[cfg.loss_agg], kl=KL[cfg.kl_estimator] if cfg.kl_beta > 0 else KL["off"],
        entropy_term=int(cfg.entropy_coef != 0), has_dual=int(cfg.dual_clip is not None),
        has_clamp=int(cfg.log_ratio_clamp is not None), has_agg_constant=int(cfg.agg_constant is not None),
        has_normalizer=int(normalizer is not None),
        adv_estimator=IN_PASS[group.estimator] if group is not None else ADV_GIVEN,
    )
    f = dict(
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or 0.0,
        gamma=cfg.gamma, mismatch_low=cfg.mismatch_low, mismatch_high=cfg.mismatch_high,
        agg_constant=cfg.agg_constant or 0.0, kl_beta=cfg.kl_beta, entropy_coef=cfg.entropy_coef,
        log_ratio_clamp=cfg.log_ratio_clamp or 0.0, normalizer=float(normalizer) if normalizer is not None else 0.0,
        adv_eps=group.eps if group is not None else 0.0,
    )
    return [i[k] for k in IOPTS], [float(f[k]) for k in FOPTS]


def compute_dtype(inp: LossInputs) -> torch.dtype:
    """The reference's compute dtype: float64 for float64 logp, float32 otherwise."""
    return torch.float64 if inp.logp.dtype == torch.float64 else torch.float32


def kernel_tensors(inp: LossInputs, cfg: LossConfig):
    """Token tensors in one dtype the kernels read (fp32, fp64 or bf16; mixed or fp16 inputs are
    converted to the reference's compute dtype), and the per-sequence / index tensors: advantages of
    the compute dtype (in-pass: float64 rewards, int64 group rows, the float64 [G, 4] statistics
    instead), int64 cu_seqlens, int32/int64 chunk ids."""
    cdt = compute_dtype(inp)
    names = ("logp", "old_logp", "rollout_logp", "ref_logp", "entropy")
    need = {"rollout_logp": cfg.mismatch_level != "none", "ref_logp": cfg.kl_beta > 0}
    toks = {n: getattr(inp, n) for n in names if need.get(n, True) and getattr(inp, n) is not None}
    dtypes = {t.dtype for t in toks.values()}
    kdt = inp.logp.dtype if len(dtypes) == 1 and inp.logp.dtype in KERNEL_DTYPES else cdt
    toks = {n: t.to(kdt).contiguous() for n, t in toks.items()}
    cid = inp.chunk_ids if inp.chunk_ids.dtype in (torch.int32, torch.int64) else inp.chunk_ids.to(torch.int64)
    idx = dict(cu_seqlens=inp.cu_seqlens.to(torch.int64).contiguous(), chunk_ids=cid.contiguous())
    g = inp.group
    if g is None:
        idx["advantages"] = inp.advantages.to(cdt).contiguous()
    else:
        idx.update(rewards=g.rewards.to(torch.float64).contiguous(), group_index=g.group_index.to(torch.int64).contiguous(),
                   group_stats=g.stats.to(torch.float64).contiguous())
    return toks, idx
