"""The ``stabilizers`` section: one sub-section per stabilizer (arl/stabilizers/), every one off by
default but the stall guard (``stall``: a run with no learning signal must not step on silently).
Standalone construction (``StabilizerConfig(**yaml_dict)``) raises one-line ValueErrors naming the
dotted key.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import OneLineErrors


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _need(ok: bool, key: str, value, what: str) -> None:
    if not ok:
        raise ValueError(f"{key}: {value!r} {what}")


class DynamicSamplingConfig(_Section):
    """DAPO dynamic sampling: drop groups whose rewards all agree (no advantage signal)."""

    enabled: bool = False
    max_rounds: int = Field(3, ge=0)  # extra sampling rounds after the first batch
    atol: float = Field(0.0, ge=0)  # rewards within atol of each other count as equal
    on_short: Literal["partial", "pad"] = "pad"  # retries spent: train a smaller batch, or pad with dropped groups


class ExtremeTrajectoryConfig(_Section):
    """Control of long failed trajectories and of the weight of negative samples."""

    enabled: bool = False
    failure_reward: float = 0.0  # outcome reward <= this is a failure
    max_failed_tokens: Optional[int] = Field(None, ge=1)  # failed and longer than this: masked/down-weighted
    length_of: Literal["tokens", "trained_tokens"] = "tokens"
    action: Literal["mask", "weight"] = "mask"  # mask: status MASKED (out of the normalizer); weight: advantage * long_weight
    long_weight: float = Field(0.0, ge=0)
    negative_weight: float = Field(1.0, ge=0)  # every negative advantage is scaled by this


class CurriculumConfig(_Section):
    """Positive-only (negative advantages zeroed inside the surrogate) until a step or success rate."""

    enabled: bool = False
    until_step: Optional[int] = Field(None, ge=0)  # both from this step on
    until_success: Optional[float] = Field(None, ge=0, le=1)  # both once the success rate reaches this

    @model_validator(mode="after")
    def _check(self):
        _need(not self.enabled or self.until_step is not None or self.until_success is not None,
              "until_step", self.until_step, "and until_success are both None: positive-only would never end")
        return self


class IPAResampleConfig(_Section):
    """IPA chunk initialization resampling from expert trajectories."""

    enabled: bool = False
    mode: Literal["sequential", "parallel"] = "sequential"
    steps_per_chunk: int = Field(10, ge=1)  # sequential: move the start one chunk back every this many steps
    advance_at_success: Optional[float] = Field(None, gt=0, le=1)  # ... or as soon as the success rate reaches this
    anchors: tuple[float, ...] = (0.25, 0.5, 0.75)  # parallel: start chunks at these fractions of the expert's chunks
    lambda_il: float = Field(1.0, ge=0)  # weight of the imitation NLL on the expert prefix
    lambda_rl: float = Field(1.0, ge=0)  # weight of the chunk-level RL loss on the resampled part
    imitate_once_per_group: bool = True  # the prefix is imitated by one member of each start-state group

    @model_validator(mode="after")
    def _check(self):
        _need(len(self.anchors) > 0 and all(0.0 <= a < 1.0 for a in self.anchors), "anchors", self.anchors,
              "must be a non-empty list of fractions in [0, 1)")
        return self


class ShapingConfig(_Section):
    """Capped process rewards added to the outcome reward."""

    enabled: bool = False
    per_checkpoint: float = Field(0.1, ge=0)
    cap: float = Field(0.5, ge=0)
    outcome_reward: float = Field(1.0, gt=0)  # reward of a success; the cap must stay below it
    checkpoints: tuple[Literal["valid_tool_call", "new_state"], ...] = ("valid_tool_call", "new_state")

    @model_validator(mode="after")
    def _check(self):
        _need(self.cap < self.outcome_reward, "cap", self.cap,
              f"must be < outcome_reward ({self.outcome_reward}) so the outcome dominates")
        return self


class TurnCreditConfig(_Section):
    """Turn-level credit (turn_credit.py): per-chunk step advantages from anchor-state groups, added to
    the trajectory's advantage, with the env's new-state verdicts as dense process rewards."""

    enabled: bool = False
    weight: float = Field(1.0, ge=0)  # the step advantage's weight beside the trajectory's
    process_reward: float = Field(0.1, ge=0)  # per chunk that reached a new state, in the chunk returns


class AdaptiveKLConfig(_Section):
    """Adaptive KL coefficient (proportional controller on the measured KL to the reference)."""

    enabled: bool = False
    target: float = Field(0.05, gt=0)
    horizon: int = Field(100, ge=1)  # steps over which beta may change by ~e^(0.2)
    init_beta: float = Field(0.05, gt=0)
    min_beta: float = Field(1e-4, gt=0)
    max_beta: float = Field(10.0, gt=0)
    # the step record's metric holding the measured KL to the reference (policy_loss's kl_mean, as the
    # loop logs it); the controller is fed the whole record after each step
    signal: str = "train/kl_mean"

    @model_validator(mode="after")
    def _check(self):
        _need(self.min_beta <= self.init_beta <= self.max_beta, "init_beta", self.init_beta,
              f"must be in [min_beta, max_beta] = [{self.min_beta}, {self.max_beta}]")
        return self


class EntropyScheduleConfig(_Section):
    """Entropy bonus decaying linearly from ``start`` to ``end`` over ``steps``, then ``end``."""

    enabled: bool = False
    start: float = Field(1e-3, ge=0)
    end: float = Field(1e-4, ge=0)
    steps: int = Field(100, ge=1)


class AlarmRule(_Section):
    """Fires when ``signal`` jumps: |x - running mean| > z * running std + min_delta (after
    ``min_history`` values), or when x crosses the absolute ``above`` bound."""

    signal: str
    z: float = Field(4.0, gt=0)
    min_delta: float = Field(0.0, ge=0)
    min_history: int = Field(5, ge=2)
    direction: Literal["up", "down", "both"] = "up"
    above: Optional[float] = None  # absolute bound (e.g. destructive calls > 0)
    action: Literal["stop", "rollback"] = "rollback"


class MonitorConfig(_Section):
    """Behaviour monitors (tool frequency, loops, destructive commands) and alarms on any metric."""

    enabled: bool = False
    loop_min_repeats: int = Field(3, ge=2)  # a trajectory repeating one identical call this often loops
    destructive_patterns: tuple[str, ...] = ()  # extra regexes, added to the built-in list
    alarms: tuple[AlarmRule, ...] = ()
    ema: float = Field(0.0, ge=0, lt=1)  # 0: plain running mean/std over all history; else EMA decay
    max_rollbacks: int = Field(3, ge=0)  # past this a rollback alarm stops the run


class StallConfig(_Section):
    """Stall guard: ``patience`` consecutive steps without learning signal (``train/skipped_no_signal``)
    with success/train below 0.5 is a collapse, and ``action`` is taken; with it at or above 0.5
    the tasks are solved: one note, and the run goes on.  So is ``patience`` consecutive steps at
    success/train 0 once the run had reached ``after_success`` (a collapse that a trickle of signal,
    e.g. turn credit's, hides from the first rule).  On by default; ``patience`` null or 0: off."""

    patience: Optional[int] = Field(20, ge=0)
    action: Literal["stop", "rollback", "warn"] = "stop"  # rollback: as an alarm's, within monitors.max_rollbacks
    after_success: Optional[float] = Field(0.5, gt=0, le=1)  # null: the second rule off


class StabilizerConfig(OneLineErrors, _Section):
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    extreme: ExtremeTrajectoryConfig = ExtremeTrajectoryConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    ipa: IPAResampleConfig = IPAResampleConfig()
    shaping: ShapingConfig = ShapingConfig()
    turn_credit: TurnCreditConfig = TurnCreditConfig()
    kl: AdaptiveKLConfig = AdaptiveKLConfig()
    entropy: EntropyScheduleConfig = EntropyScheduleConfig()
    monitors: MonitorConfig = MonitorConfig()
    stall: StallConfig = StallConfig()

    @model_validator(mode="after")
    def _check(self):
        _need(not (self.turn_credit.enabled and self.ipa.enabled), "turn_credit.enabled", True,
              "cannot be combined with ipa.enabled (the IPA loss splits chunks its own way)")
        return self


def check_turn_credit_loss(stab: StabilizerConfig, loss) -> None:
    """Turn credit scores each chunk as its own loss segment: exact only when the loss scores a chunk
    by its own tokens (token or chunk ratios and mismatch, token-mean aggregation)."""
    if not stab.turn_credit.enabled:
        return
    if loss.ratio_level == "sequence" or loss.mismatch_level == "sequence" or loss.loss_agg != "token-mean":
        raise ValueError(
            "stabilizers.turn_credit.enabled needs loss.ratio_level token or chunk, loss.mismatch_level none, token "
            f"or chunk and loss.loss_agg token-mean (got {loss.ratio_level}, {loss.mismatch_level}, {loss.loss_agg})")
