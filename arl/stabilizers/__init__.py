"""Agentic-RL stabilizers: switches that control which trajectories, which parts of them and with
what weight enter the gradient, plus monitors of the signals that move before reward collapses.
Every one is off by default (``StabilizerConfig``) but the stall guard, and each exports metrics
that show its effect.

Where each acts, and what it exports (``stab/*``, ``monitor/*``, ``ipa/*``):

=====================  ===================  =====================================================
stabilizer             acts on              metrics
=====================  ===================  =====================================================
dynamic sampling       sampling (groups)    stab/zero_var_frac (before filtering), groups_sampled,
 (dynamic_sampling.py)                      groups_kept, sampling_rounds, groups_short
process-reward         rewards (before      stab/shaping_bonus_mean, shaping_checkpoints_mean,
 shaping (shaping.py)  advantages)          shaping_capped_frac
turn-level credit     advantages (per      stab/turn_anchor_size_mean, turn_step_adv_nonzero_frac,
 (turn_credit.py)      chunk: anchor-state  turn_process_reward_per_chunk
                       step advantages)
extreme-trajectory     batch (long failed   stab/long_failures, failed_len_max/mean,
 control (extreme.py)  -> MASKED copy) and  success_len_max/mean, failure_share (always on),
                       advantages (weights) stab/neg_adv_share, adv_mean (always on)
negative reweighting   advantages           stab/neg_adv_share
 (extreme.py)
positive-only          loss config          stab/positive_only
 curriculum            (positive_only)
 (curriculum.py)
adaptive KL,           loss config          stab/kl_beta, kl_skipped; entropy_coef is in the
 entropy schedule      (kl_beta,            LossConfig of the step
 (schedules.py)        entropy_coef)
IPA chunk-init         rollout start        stab/ipa_offset; ipa/il_nll, il_tokens, rl_loss,
 resampling (ipa.py)   states and the loss  rl_tokens
                       (imitation + RL)
behaviour monitors     after the step       monitor/tool_freq/<tool>, tool_calls_per_traj,
 and alarm             (decision: continue  tool_error_rate, repeat_call_frac, looping_frac,
 (monitors.py)         / rollback / stop)   destructive_calls, destructive_traj_frac; stab/rollbacks
stall guard (on;       after the step       stab/no_signal_streak (steps in a row with
 stall.py)             (same decisions)     train/skipped_no_signal), stab/zero_success_streak
                                            (steps in a row at success 0 after success)
=====================  ===================  =====================================================

Weights reach the loss only through per-trajectory advantages (``policy_loss(...,
advantages=mb.advantages)``), so every kernel backend supports them unchanged; masking goes
through the packer's MASKED status (chunk ids -1).  The critic (not a stabilizer: ``critic:``) has its
GAE math here (gae.py): rank 0 attaches each micro-batch's value points, the trainer adds GAE.  Turn credit's per-chunk advantages go in the same way,
with each chunk scored as its own loss segment (``mb.segments``).  ``Stabilizers`` (pipeline.py) is the facade the
RL loop calls a few times per step.
"""
from .advantages import StepAdvantages, advantage_metrics, group_step_advantages, step_advantages
from ..config import (AdaptiveKLConfig, AlarmRule, CurriculumConfig, DynamicSamplingConfig, EntropyScheduleConfig,
                     ExtremeTrajectoryConfig, IPAResampleConfig, MonitorConfig, ShapingConfig, StabilizerConfig,
                     StallConfig, TurnCreditConfig)
from .curriculum import PositiveOnlyCurriculum
from .dynamic_sampling import DynamicSampler, filter_zero_variance_groups
from .extreme import control_extremes, length_metrics, reweight_negatives
from .gae import critic_chunk_inputs, critic_points
from .ipa import IPAResampler, ipa_mixed_loss, ipa_normalizers, split_chunk_roles
from .monitors import Alarm, Decision, behaviour_metrics
from .pipeline import PreparedBatch, Stabilizers
from .schedules import AdaptiveKLController, entropy_coef
from .shaping import shape_rewards
from .stall import StallGuard
from .turn_credit import chunk_segments, turn_advantages

__all__ = [
    "AdaptiveKLConfig", "AdaptiveKLController", "Alarm", "AlarmRule", "CurriculumConfig", "Decision", "DynamicSampler",
    "DynamicSamplingConfig", "EntropyScheduleConfig", "ExtremeTrajectoryConfig", "IPAResampleConfig", "IPAResampler",
    "MonitorConfig", "PositiveOnlyCurriculum", "PreparedBatch", "ShapingConfig", "StabilizerConfig", "Stabilizers",
    "StallConfig", "StallGuard",
    "StepAdvantages", "advantage_metrics", "group_step_advantages", "step_advantages", "behaviour_metrics", "control_extremes", "entropy_coef",
    "filter_zero_variance_groups", "ipa_mixed_loss", "ipa_normalizers", "length_metrics",
    "reweight_negatives", "shape_rewards", "split_chunk_roles",
    "TurnCreditConfig", "chunk_segments", "turn_advantages", "critic_chunk_inputs", "critic_points",
]
