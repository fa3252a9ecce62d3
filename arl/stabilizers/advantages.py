"""The step's advantages, computed once, here: everything downstream takes them as input.

    rewards   = outcome + capped process rewards                 (shaping.py; outcome when off)
    batch     = long failures masked or down-weighted            (extreme.py; unchanged when off)
    A_i       = group normalization of the rewards over the whole step (arl.algo.advantages
                ``group_advantages``; FILTERED trajectories are left out and get 0)
    A_i      *= negative reweighting and extreme weights         (extreme.py; when on)
    A_{i,k}   = gamma^(K-1-k) A_i + w * step advantage of chunk k (turn_credit.py; when on)
    critic:     A_i is not used; the chunk rewards r_{i,k} and the base A_{i,k} = w * step
                advantage (0 without turn credit) go to the trainer, which adds GAE (gae.py)

The packer carries ``A_i`` into every micro-batch (``pack_step(..., advantages=)``), the trainer passes
them to ``policy_loss(..., advantages=)`` (turn credit: one segment per chunk with ``A_{i,k}``), and
the advantage metrics below are computed from the same numbers.  ``gamma`` discounting and
``positive_only`` still act per chunk inside the loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..config.stabilizers import StabilizerConfig
from ..errors import finite_vector
from ..data.trajectory import Trajectory, TrajectoryStatus
from ..ops.policy_loss.config import LossConfig
from ..algo.advantages import group_advantages
from .gae import critic_chunk_inputs
from .extreme import control_extremes, reweight_negatives
from .shaping import shape_rewards
from .turn_credit import turn_advantages


@dataclass
class StepAdvantages:
    trajectories: list  # give these to pack_step (long failures may have become MASKED copies)
    rewards: np.ndarray  # [N] float64 rewards the advantages come from (shaped when shaping is on)
    advantages: np.ndarray  # [N] float64 A_i, aligned with ``trajectories`` (0 for FILTERED)
    metrics: dict = field(default_factory=dict)
    chunk_advantages: Optional[list] = None  # turn credit: [K_i] float64 A_{i,k} per trajectory
    chunk_rewards: Optional[list] = None  # critic: [K_i] float64 r_{i,k} per trajectory (GAE's rewards)


def group_step_advantages(trajs: Sequence[Trajectory], rewards, loss_cfg: LossConfig):
    """``(A [N] float64, zero-variance groups, groups)``: group-normalized advantages over the whole
    step (GRPO's, eps 1e-6, until ``algo.advantage`` chooses the estimator).  FILTERED trajectories
    are not packed: they get 0 and take no part in any group."""
    rewards = finite_vector("rewards", rewards, len(trajs))
    keep = np.array([t.status is not TrajectoryStatus.FILTERED for t in trajs], dtype=bool)
    adv = np.zeros(len(trajs), dtype=np.float64)
    if not keep.any():
        return adv, 0, 0
    gids = np.array([int(t.group_id) for t, k in zip(trajs, keep) if k], dtype=np.int64)
    a, n_zero, n_groups = group_advantages(rewards[keep], gids, "grpo", 1e-6)
    adv[keep] = a
    return adv, int(n_zero), int(n_groups)


def advantage_metrics(trajs: Sequence[Trajectory], adv: np.ndarray, zero_var_groups: int, groups: int) -> dict:
    """``adv/*`` over every packed (non-FILTERED) trajectory; ``stab/*adv*`` over those that train (OK)."""
    kept = np.array([t.status is not TrajectoryStatus.FILTERED for t in trajs], dtype=bool)
    ok = np.array([t.status is TrajectoryStatus.OK for t in trajs], dtype=bool)
    k, a = adv[kept], adv[ok]
    return {"adv/nonzero_frac": float((k != 0).mean()) if k.size else 0.0,
            "adv/negative_frac": float((k < 0).mean()) if k.size else 0.0,
            "adv/zero_var_group_frac": zero_var_groups / groups if groups else 0.0,
            "stab/neg_adv_share": float((a < 0).mean()) if a.size else 0.0,
            "stab/adv_mean": float(a.mean()) if a.size else 0.0,
            "stab/adv_abs_mean": float(np.abs(a).mean()) if a.size else 0.0}


def step_advantages(trajs: Sequence[Trajectory], loss_cfg: LossConfig,
                    cfg: Optional[StabilizerConfig] = None, critic=None) -> StepAdvantages:
    """The step's advantages (see the module doc) with their metrics.  ``critic``: the critic section
    (``CriticConfig``); when enabled the per-chunk inputs of GAE replace turn credit's advantages."""
    cfg = cfg if cfg is not None else StabilizerConfig()
    rewards, metrics = shape_rewards(trajs, cfg.shaping)
    out, weights, m = control_extremes(trajs, cfg.extreme)
    metrics.update(m)
    adv, n_zero, n_groups = group_step_advantages(out, rewards, loss_cfg)
    if cfg.extreme.enabled:
        adv = reweight_negatives(adv, cfg.extreme.negative_weight) * weights
    metrics.update(advantage_metrics(out, adv, n_zero, n_groups))
    per_chunk = chunk_rew = None
    if critic is not None and critic.enabled:
        per_chunk, chunk_rew, m = critic_chunk_inputs(out, rewards, loss_cfg, cfg.turn_credit)
        metrics.update(m)
    elif cfg.turn_credit.enabled:
        tc = cfg.turn_credit
        per_chunk, m = turn_advantages(out, adv, loss_cfg, weight=tc.weight, process_reward=tc.process_reward)
        metrics.update(m)
    return StepAdvantages(out, rewards, adv, metrics, per_chunk, chunk_rew)
