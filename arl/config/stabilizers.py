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

    enabled: bool = Field(False, description="Drop groups whose rewards all agree and sample new ones in their place.")
    max_rounds: int = Field(3, ge=0, description="Extra sampling rounds after the first batch, before giving up.")
    atol: float = Field(0.0, ge=0, description="Rewards within atol of each other count as equal (reward units).")
    on_short: Literal["partial", "pad"] = Field(
        "pad", description="Rounds spent and still short of groups: partial trains a smaller batch, pad fills it "
        "with dropped (zero-advantage) groups.")


class ExtremeTrajectoryConfig(_Section):
    """Control of long failed trajectories and of the weight of negative samples."""

    enabled: bool = Field(False, description="Turn on long-failure control and negative reweighting.")
    failure_reward: float = Field(0.0, description="A trajectory whose outcome reward is <= this is a failure.")
    max_failed_tokens: Optional[int] = Field(
        None, ge=1, description="A failure longer than this many tokens is masked or down-weighted; null: no limit.")
    length_of: Literal["tokens", "trained_tokens"] = Field(
        "tokens", description="Length measured for max_failed_tokens: all tokens (prompt and observations included) "
        "or the trained tokens only.")
    action: Literal["mask", "weight"] = Field(
        "mask", description="mask: a long failure is dropped (out of the normalizer); weight: its advantage is "
        "multiplied by long_weight.")
    long_weight: float = Field(0.0, ge=0, description="Advantage multiplier of a long failure under action: weight.")
    negative_weight: float = Field(
        1.0, ge=0, description="Every negative advantage is multiplied by this; < 1 softens the push-down of failures.")


class CurriculumConfig(_Section):
    """Positive-only (negative advantages zeroed inside the surrogate) until a step or success rate."""

    enabled: bool = Field(
        False, description="Train on positive advantages only (negatives zeroed) until until_step or until_success.")
    until_step: Optional[int] = Field(
        None, ge=0, description="Both signs from this RL step on; null: no step limit.")
    until_success: Optional[float] = Field(
        None, ge=0, le=1, description="Both signs once the success rate reaches this fraction; null: no such limit.")

    @model_validator(mode="after")
    def _check(self):
        _need(not self.enabled or self.until_step is not None or self.until_success is not None,
              "until_step", self.until_step, "and until_success are both None: positive-only would never end")
        return self


class IPAResampleConfig(_Section):
    """IPA chunk initialization resampling from expert trajectories."""

    enabled: bool = Field(
        False, description="Start each group from an expert prefix and train the mixed imitation + RL loss; not "
        "with turn credit or the critic.")
    mode: Literal["sequential", "parallel"] = Field(
        "sequential", description="sequential: start at the expert's last chunk and move back over time; parallel: "
        "start at the fixed fractions in anchors.")
    steps_per_chunk: int = Field(
        10, ge=1, description="Sequential mode: move the start one chunk back every this many RL steps.")
    advance_at_success: Optional[float] = Field(
        None, gt=0, le=1, description="Sequential mode: also move back as soon as the success rate reaches this; "
        "null: by steps_per_chunk only.")
    anchors: tuple[float, ...] = Field(
        (0.25, 0.5, 0.75), description="Parallel mode: start chunks at these fractions of the expert's chunks, each "
        "in [0, 1).")
    lambda_il: float = Field(1.0, ge=0, description="Weight of the imitation NLL on the expert prefix.")
    lambda_rl: float = Field(1.0, ge=0, description="Weight of the chunk-level RL loss on the resampled chunks.")
    imitate_once_per_group: bool = Field(
        True, description="The prefix is imitated by one member of each start-state group, not by all of them.")

    @model_validator(mode="after")
    def _check(self):
        _need(len(self.anchors) > 0 and all(0.0 <= a < 1.0 for a in self.anchors), "anchors", self.anchors,
              "must be a non-empty list of fractions in [0, 1)")
        return self


class ShapingConfig(_Section):
    """Capped process rewards added to the outcome reward."""

    enabled: bool = Field(False, description="Add capped per-turn process rewards to the outcome reward.")
    per_checkpoint: float = Field(0.1, ge=0, description="Reward per checkpoint reached in a turn (reward units).")
    cap: float = Field(
        0.5, ge=0, description="Upper bound on a trajectory's total shaping reward; must be below outcome_reward.")
    outcome_reward: float = Field(
        1.0, gt=0, description="Reward of a success; the cap stays below it so the outcome dominates.")
    checkpoints: tuple[Literal["valid_tool_call", "new_state"], ...] = Field(
        ("valid_tool_call", "new_state"), description="What earns per_checkpoint: valid_tool_call (a distinct "
        "error-free tool call), new_state (a turn reaching a state new to the episode).")

    @model_validator(mode="after")
    def _check(self):
        _need(self.cap < self.outcome_reward, "cap", self.cap,
              f"must be < outcome_reward ({self.outcome_reward}) so the outcome dominates")
        return self


class TurnCreditConfig(_Section):
    """Turn-level credit (turn_credit.py): per-chunk step advantages from anchor-state groups, added to
    the trajectory's advantage, with the env's new-state verdicts as dense process rewards."""

    enabled: bool = Field(
        False, description="Add per-chunk step advantages from anchor groups; needs loss.ratio_level token or chunk "
        "and loss.loss_agg token-mean, not with IPA.")
    weight: float = Field(1.0, ge=0, description="Weight of the step advantage beside the trajectory's advantage.")
    process_reward: float = Field(
        0.1, ge=0, description="Reward of a chunk that reached a new state, in the chunk returns (reward units).")


class AdaptiveKLConfig(_Section):
    """Adaptive KL coefficient (proportional controller on the measured KL to the reference)."""

    enabled: bool = Field(
        False, description="Set loss.kl_beta each step by a controller on the measured KL; needs "
        "trainer.reference_model: true.")
    target: float = Field(0.05, gt=0, description="KL to the reference the controller steers towards (nats per token).")
    horizon: int = Field(
        100, ge=1, description="Controller time constant in steps: beta changes by at most 20%/horizon per step.")
    init_beta: float = Field(0.05, gt=0, description="KL coefficient at the start, in [min_beta, max_beta].")
    min_beta: float = Field(1e-4, gt=0, description="Lower bound of the KL coefficient.")
    max_beta: float = Field(10.0, gt=0, description="Upper bound of the KL coefficient.")
    signal: str = Field(
        "train/kl_mean", description="Metric of the step record that holds the measured KL to the reference.")

    @model_validator(mode="after")
    def _check(self):
        _need(self.min_beta <= self.init_beta <= self.max_beta, "init_beta", self.init_beta,
              f"must be in [min_beta, max_beta] = [{self.min_beta}, {self.max_beta}]")
        return self


class EntropyScheduleConfig(_Section):
    """Entropy bonus decaying linearly from ``start`` to ``end`` over ``steps``, then ``end``."""

    enabled: bool = Field(False, description="Set loss.entropy_coef each step from this schedule.")
    start: float = Field(1e-3, ge=0, description="Entropy coefficient at step 0.")
    end: float = Field(1e-4, ge=0, description="Entropy coefficient from step `steps` on.")
    steps: int = Field(100, ge=1, description="RL steps of the linear decay from start to end.")


class AlarmRule(_Section):
    """Fires when ``signal`` jumps: |x - running mean| > z * running std + min_delta (after
    ``min_history`` values), or when x crosses the absolute ``above`` bound."""

    signal: str = Field(description="Metric name to watch, as in metrics.jsonl (e.g. train/kl_mean).")
    z: float = Field(4.0, gt=0, description="Fire when the value leaves the running mean by more than z running stds.")
    min_delta: float = Field(0.0, ge=0, description="Absolute margin added to z * std (the metric's units).")
    min_history: int = Field(5, ge=2, description="Values seen before the jump rule may fire.")
    direction: Literal["up", "down", "both"] = Field("up", description="Which jumps fire: up, down or both.")
    above: Optional[float] = Field(
        None, description="Also fire when the value exceeds this absolute bound (e.g. destructive calls > 0); null: "
        "off.")
    action: Literal["stop", "rollback"] = Field(
        "rollback", description="stop ends the run; rollback restores the last checkpoint (within "
        "monitors.max_rollbacks).")


class MonitorConfig(_Section):
    """Behaviour monitors (tool frequency, loops, destructive commands) and alarms on any metric."""

    enabled: bool = Field(False, description="Log behaviour metrics (monitor/*) and check the alarms every step.")
    loop_min_repeats: int = Field(
        3, ge=2, description="A trajectory repeating one identical tool call this many times counts as looping.")
    destructive_patterns: tuple[str, ...] = Field(
        (), description="Extra regexes for destructive tool calls, added to the built-in list (rm -rf, kill, ...).")
    alarms: tuple[AlarmRule, ...] = Field((), description="Alarm rules on any metric, each a mapping as below.")
    ema: float = Field(
        0.0, ge=0, lt=1, description="Decay of the alarms' running mean/std; 0: plain mean/std over all history.")
    max_rollbacks: int = Field(
        3, ge=0, description="Rollbacks allowed per run (alarms and the stall guard); past this a rollback stops.")


class StallConfig(_Section):
    """Stall guard: ``patience`` consecutive steps without learning signal (``train/skipped_no_signal``)
    with success/train below 0.5 is a collapse, and ``action`` is taken; with it at or above 0.5
    the tasks are solved: one note, and the run goes on.  So is ``patience`` consecutive steps at
    success/train 0 once the run had reached ``after_success`` (a collapse that a trickle of signal,
    e.g. turn credit's, hides from the first rule).  On by default; ``patience`` null or 0: off."""

    patience: Optional[int] = Field(
        20, ge=0, description="Consecutive RL steps without learning signal (or at success 0) before acting; null "
        "or 0: the guard is off.")
    action: Literal["stop", "rollback", "warn"] = Field(
        "stop", description="stop ends the run; rollback restores the last checkpoint (within "
        "monitors.max_rollbacks); warn prints one line.")
    after_success: Optional[float] = Field(
        0.5, gt=0, le=1, description="Train success the run must have reached for the zero-success rule to apply; "
        "null: that rule is off.")


class StabilizerConfig(OneLineErrors, _Section):
    dynamic_sampling: DynamicSamplingConfig = Field(
        DynamicSamplingConfig(), description="DAPO dynamic sampling: replace groups whose rewards all agree.")
    extreme: ExtremeTrajectoryConfig = Field(
        ExtremeTrajectoryConfig(), description="Masking of long failed trajectories and reweighting of negatives.")
    curriculum: CurriculumConfig = Field(
        CurriculumConfig(), description="Positive-only curriculum until a step or a success rate.")
    ipa: IPAResampleConfig = Field(
        IPAResampleConfig(), description="IPA chunk-initialization resampling from expert trajectories.")
    shaping: ShapingConfig = Field(ShapingConfig(), description="Capped process rewards added to the outcome reward.")
    turn_credit: TurnCreditConfig = Field(
        TurnCreditConfig(), description="Turn-level credit: per-chunk step advantages (GiGPO-style).")
    kl: AdaptiveKLConfig = Field(AdaptiveKLConfig(), description="Adaptive KL coefficient controller.")
    entropy: EntropyScheduleConfig = Field(
        EntropyScheduleConfig(), description="Linear schedule of the entropy coefficient.")
    monitors: MonitorConfig = Field(MonitorConfig(), description="Behaviour monitors and stop/rollback alarms.")
    stall: StallConfig = Field(StallConfig(), description="Stall guard against runs without learning signal; on.")

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
