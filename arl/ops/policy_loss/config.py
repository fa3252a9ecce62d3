"""LossConfig: every knob of the policy-loss family, validated at construction.

One config describes PPO/GRPO (token ratio), GSPO (sequence ratio), IPA (chunk ratio), DAPO
clip-higher, dual-clip, TOPR, Dr.GRPO aggregation, mismatch correction, KL and entropy terms.
The semantics are written down once, in ``spec.py``; every kernel matches it.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field, field_validator, model_validator

from ...errors import OneLineErrors
from .registry import KL_ESTIMATORS, SURROGATES

RatioLevel = Literal["token", "sequence", "chunk"]
MismatchLevel = Literal["none", "token", "sequence", "chunk"]
MismatchMode = Literal["mask", "truncate"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class LossConfig(OneLineErrors):
    """Options of ``arl.policy_loss``; defaults are plain GRPO (token ratio, symmetric clip 0.2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ratio_level: RatioLevel = Field(
        "token", description="Granularity of the importance ratio: token (PPO/GRPO), sequence (GSPO) or chunk (IPA, "
        "one model turn); turn credit and the critic need token or chunk.")
    # surrogates and KL estimators are registries (registry.py), checked by name below, not Literals
    surrogate: str = Field(
        "ppo_clip", description="A registered surrogate (spec.py): ppo_clip, the clipped PPO surrogate; topr: "
        "positive advantages untruncated, negative ones weighted by sg(clamp(ratio, 0, 1)); cispo: every token's "
        "log-prob weighted by sg(clip(ratio)) (MiniMax-M1; no kernel: the torch reference).")
    clip_low: float = Field(0.2, description="Lower clip: ratios below 1 - clip_low are clipped; in [0, 1).")
    clip_high: float = Field(
        0.2, description="Upper clip: ratios above 1 + clip_high are clipped; DAPO's clip-higher raises it to 0.28.")
    dual_clip: Optional[float] = Field(
        None, description="Dual clip c > 1: bounds the loss of a negative-advantage token at -c*A; null: off.")
    # per-trajectory advantages are given (arl.algo.advantages); the op only discounts and clamps them
    gamma: float = Field(
        1.0, description="Chunk discount in (0, 1]: chunk c gets gamma**(chunks after c) * A; 1 gives every chunk "
        "the trajectory's advantage.")
    positive_only: bool = Field(
        False, description="Zero negative advantages (their tokens still count in the normalizer).")
    mismatch_level: MismatchLevel = Field(
        "none", description="Rollout/trainer mismatch correction per token, sequence or chunk: the geometric-mean "
        "ratio exp(mean(old_logp - rollout_logp)); none: off.")
    mismatch_mode: MismatchMode = Field(
        "mask", description="mask: drop segments whose mismatch ratio is outside [mismatch_low, mismatch_high]; "
        "truncate: weight them by min(ratio, mismatch_high).")
    mismatch_low: float = Field(0.8, description="Lower mismatch bound, in [0, 1] (mask mode).")
    mismatch_high: float = Field(1.2, description="Upper mismatch bound, >= 1 (mask and truncate modes).")
    loss_agg: LossAgg = Field(
        "token-mean", description="Loss aggregation: token-mean over all trained tokens of the step, or a mean over "
        "sequences of their token mean, token sum, or token sum / agg_constant (Dr.GRPO).")
    agg_constant: Optional[float] = Field(
        None, description="Length constant of seq-mean-token-sum-norm, in tokens; null: the longest sequence's "
        "trained tokens.")
    kl_beta: float = Field(
        0.0, description="Weight of the KL penalty to the frozen reference model; > 0 needs "
        "trainer.reference_model: true.")
    kl_estimator: str = Field(
        "k3", description="A registered KL estimator per token (spec.py): k1 (log-ratio), k2 (half its square) or k3 "
        "(exp(x) - x - 1).")
    entropy_coef: float = Field(0.0, description="Weight of the entropy bonus in the loss; 0: off.")
    log_ratio_clamp: Optional[float] = Field(
        20.0, description="Every log-ratio is clamped to +-this before exp, against overflow; null: no clamp.")
    advantages_in_pass: bool = Field(
        False, description="Compute the group estimator (algo.advantage grpo, dr_grpo or rloo) inside the loss pass "
        "from each trajectory's reward and the step's group statistics, instead of before packing; the same "
        "advantages (docs/design.md 1.2). Needs no turn credit, critic, IPA or extreme-trajectory control.")
    validate_inputs: bool = Field(
        True, description="Check the loss inputs (shapes, ids, finite values) on every call; false skips the checks "
        "once a pipeline is trusted.")

    @field_validator("surrogate", "kl_estimator")
    @classmethod
    def _registered(cls, name: str, info) -> str:
        table = SURROGATES if info.field_name == "surrogate" else KL_ESTIMATORS
        if name not in table:
            raise ValueError(f"unknown {name!r}; registered: {', '.join(sorted(table))}")
        return name

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
