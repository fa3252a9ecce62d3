"""LossConfig: every knob of the policy-loss family, validated at construction.

One config describes PPO/GRPO (token ratio), GSPO (sequence ratio), IPA (chunk ratio), DAPO
clip-higher, dual-clip, TOPR, Dr.GRPO aggregation, mismatch correction, KL and entropy terms.
The semantics are written down once, in ``spec.py``; every kernel matches it.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, model_validator

from ...errors import OneLineErrors

RatioLevel = Literal["token", "sequence", "chunk"]
Surrogate = Literal["ppo_clip", "topr"]
MismatchLevel = Literal["none", "token", "sequence", "chunk"]
MismatchMode = Literal["mask", "truncate"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]


class LossConfig(OneLineErrors):
    """Options of ``arl.policy_loss``; defaults are plain GRPO (token ratio, symmetric clip 0.2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ratio granularity: token (PPO/GRPO), sequence (GSPO), chunk (IPA)
    ratio_level: RatioLevel = "token"
    # ppo_clip: clipped surrogate; topr: positives untruncated, negatives sg(clamp(ratio, 0, 1))
    surrogate: Surrogate = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO clip-higher: 0.28
    dual_clip: Optional[float] = None  # c > 1 bounds the loss of negative advantages at -c*A
    # per-trajectory advantages are given (arl.algo.advantages); the op only discounts and clamps them
    gamma: float = 1.0  # chunk discount: A_c = gamma**(chunks after c) * A_i
    positive_only: bool = False  # zero negative advantages (tokens still count in the normalizer)
    # rollout/trainer mismatch: geometric-mean ratio exp(mean(old_logp - rollout_logp)) per level
    mismatch_level: MismatchLevel = "none"
    mismatch_mode: MismatchMode = "mask"  # mask: drop outside [low, high]; truncate: weight min(m, high)
    mismatch_low: float = 0.8
    mismatch_high: float = 1.2
    # aggregation; the normalizer passed to policy_loss overrides the denominator
    loss_agg: LossAgg = "token-mean"
    agg_constant: Optional[float] = None  # seq-mean-token-sum-norm length constant (None: longest sequence)
    kl_beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    log_ratio_clamp: Optional[float] = 20.0  # log-ratios clamped to +-this before exp (None: off)
    validate_inputs: bool = True

    @model_validator(mode="after")
    def _check_ranges(self) -> "LossConfig":
        def need(ok: bool, key: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{key}: {getattr(self, key)!r} {what}")

        need(0.0 <= self.clip_low < 1.0, "clip_low", "must be in [0, 1)")
        need(self.clip_high >= 0.0, "clip_high", "must be >= 0")
        need(self.dual_clip is None or self.dual_clip > 1.0, "dual_clip", "must be None or > 1")
        need(0.0 < self.gamma <= 1.0, "gamma", "must be in (0, 1]")
        need(0.0 <= self.mismatch_low <= 1.0, "mismatch_low", "must be in [0, 1]")
        need(self.mismatch_high >= 1.0, "mismatch_high", "must be >= 1")
        need(self.agg_constant is None or self.agg_constant > 0, "agg_constant", "must be None or > 0")
        need(self.kl_beta >= 0.0, "kl_beta", "must be >= 0")
        need(self.log_ratio_clamp is None or self.log_ratio_clamp > 0, "log_ratio_clamp", "must be None or > 0")
        return self
