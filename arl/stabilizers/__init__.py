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
 shaping               advantages)          shaping_capped_frac
 (algo/shaping.py)
turn-level credit      advantages (per      stab/turn_anchor_size_mean, turn_step_adv_nonzero_frac,
 (algo/turn_credit.py)  chunk: anchor-state  turn_process_reward_per_chunk
                       step advantages)
extreme-trajectory     batch (long failed   stab/long_failures, failed_len_max/mean,
 control               -> MASKED copy) and  success_len_max/mean, failure_share (always on),
 (algo/extreme.py)     advantages (weights) stab/neg_adv_share, adv_mean (always on)
negative reweighting   advantages           stab/neg_adv_share
 (algo/extreme.py)
positive-only          loss config          stab/positive_only
 curriculum            (positive_only)
 (curriculum.py)
adaptive KL,           loss config          stab/kl_beta, kl_skipped; entropy_coef is in the
 entropy schedule      (kl_beta,            LossConfig of the step
 (schedules.py)        entropy_coef)
IPA chunk-init         rollout start        stab/ipa_offset; ipa/il_nll, il_tokens, rl_loss,
 resampling (ipa.py,   states and the loss  rl_tokens
 the loss: algo/ipa.py)
                       (imitation + RL)
behaviour monitors     after the step       monitor/tool_freq/<tool>, tool_calls_per_traj,
 and alarm             (decision: continue  tool_error_rate, repeat_call_frac, looping_frac,
 (monitors.py)         / rollback / stop)   destructive_calls, destructive_traj_frac; stab/rollbacks
stall guard (on;       after the step       stab/no_signal_streak (steps in a row with
 stall.py)             (same decisions)     train/skipped_no_signal), stab/zero_success_streak
                                            (steps in a row at success 0 after success)
=====================  ===================  =====================================================

The switches that shape the step's advantages (shaping, turn credit, extreme-trajectory control,
negative reweighting) and IPA's loss are the algorithm's: their code is in arl/algo (read in the
order its face lists); their settings stay under ``stabilizers:``.  This package holds what is not
the algorithm: the monitors, the alarm and the stall guard, the curriculum and the schedules of the
loss config, dynamic sampling and IPA's start states (the rollout side).  ``Stabilizers``
(pipeline.py) is the facade the RL loop calls a few times per step.
"""
from ..config import (AdaptiveKLConfig, AlarmRule, CurriculumConfig, DynamicSamplingConfig, EntropyScheduleConfig,
                     ExtremeTrajectoryConfig, IPAResampleConfig, MonitorConfig, ShapingConfig, StabilizerConfig,
                     StallConfig, TurnCreditConfig)
from .curriculum import PositiveOnlyCurriculum
from .dynamic_sampling import DynamicSampler, filter_zero_variance_groups
from .ipa import IPAResampler
from .monitors import Alarm, Decision, behaviour_metrics
from .pipeline import PreparedBatch, Stabilizers
from .schedules import AdaptiveKLController, entropy_coef
from .stall import StallGuard

__all__ = [
    "AdaptiveKLConfig", "AdaptiveKLController", "Alarm", "AlarmRule", "CurriculumConfig", "Decision", "DynamicSampler",
    "DynamicSamplingConfig", "EntropyScheduleConfig", "ExtremeTrajectoryConfig", "IPAResampleConfig", "IPAResampler",
    "MonitorConfig", "PositiveOnlyCurriculum", "PreparedBatch", "ShapingConfig", "StabilizerConfig", "Stabilizers",
    "StallConfig", "StallGuard", "TurnCreditConfig", "behaviour_metrics", "entropy_coef", "filter_zero_variance_groups",
]
