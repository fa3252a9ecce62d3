"""Trainer rank 0's half of the step, once per step: the advantages, the packing, each micro-batch's
loss roles (``prepare_step``).  The advantages are computed here once; everything downstream takes
them as input.

    rewards   = outcome + capped process rewards                 (shaping.py; outcome when off)
    batch     = long failures masked or down-weighted            (extreme.py; unchanged when off)
    A_i       = the ``algo.advantage`` estimator over the whole step's groups (advantages.py;
                FILTERED trajectories are left out and get 0)
    A_i      *= negative reweighting and extreme weights         (extreme.py; when on)
    A_{i,k}   = gamma^(K-1-k) A_i + w * step advantage of chunk k (turn_credit.py; when on)
    gae:        A_i is not used; the chunk rewards r_{i,k} and the base A_{i,k} = w * step
                advantage (0 without turn credit) go to the trainer, which adds GAE (gae.py)

The packer carries ``A_i`` into every micro-batch (``pack_step(..., advantages=)``); ``attach_roles``
adds what the objective needs beyond them (turn credit's per-chunk segments, the critic's value
points, IPA's imitation / RL roles); the objective passes them to ``policy_loss(..., advantages=)``
(objectives.py), and the advantage metrics below are computed from the same numbers.  ``gamma`` discounting and
``positive_only`` still act per chunk inside the loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..config.algo import AlgoConfig
from ..config.stabilizers import IPAResampleConfig, StabilizerConfig
from ..data.packer import PackedStep, PackerConfig, pack_step
from ..data.trajectory import Trajectory, TrajectoryStatus
from ..errors import finite_vector
from ..ops.policy_loss.config import LossConfig
from .advantages import get_estimator, group_advantages
from .extreme import control_extremes, reweight_negatives
from .gae import critic_chunk_inputs, critic_points
from .in_pass import attach_in_pass
from .ipa import ipa_normalizers, split_chunk_roles
from .shaping import shape_rewards
from .turn_credit import chunk_segments, turn_advantages


@dataclass
class StepAdvantages:
    trajectories: list  # give these to pack_step (long failures may have become MASKED copies)
    rewards: np.ndarray  # [N] float64 rewards the advantages come from (shaped when shaping is on)
    advantages: np.ndarray  # [N] float64 A_i, aligned with ``trajectories`` (0 for FILTERED)
    metrics: dict = field(default_factory=dict)
    chunk_advantages: Optional[list] = None  # turn credit: [K_i] float64 A_{i,k} per trajectory
    chunk_rewards: Optional[list] = None  # critic: [K_i] float64 r_{i,k} per trajectory (GAE's rewards)


def group_estimator(algo: AlgoConfig) -> str:
    """The group estimator a step's trajectories (and turn credit's anchors) use: ``algo.advantage``, or
    grpo under a critic estimator (whose per-trajectory figures are metrics only)."""
    return algo.advantage if get_estimator(algo.advantage).kind == "group" else "grpo"


def group_step_advantages(trajs: Sequence[Trajectory], rewards, algo: AlgoConfig):
    """``(A [N] float64, zero-variance groups, groups)``: the estimator's advantages over the whole
    step.  FILTERED trajectories are not packed: they get 0 and take no part in any group."""
    rewards = finite_vector("rewards", rewards, len(trajs))
    keep = np.array([t.status is not TrajectoryStatus.FILTERED for t in trajs], dtype=bool)
    adv = np.zeros(len(trajs), dtype=np.float64)
    if not keep.any():
        return adv, 0, 0
    gids = np.array([int(t.group_id) for t, k in zip(trajs, keep) if k], dtype=np.int64)
    a, n_zero, n_groups = group_advantages(rewards[keep], gids, group_estimator(algo), algo.adv_eps)
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
                    cfg: Optional[StabilizerConfig] = None, algo: Optional[AlgoConfig] = None) -> StepAdvantages:
    """The step's advantages (see the module doc) with their metrics.  Under a critic estimator
    (``algo.advantage: gae``) the per-chunk inputs of GAE replace turn credit's advantages."""
    for i, t in enumerate(trajs):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}]: expected a Trajectory, got {type(t).__name__}")
    cfg = cfg if cfg is not None else StabilizerConfig()
    algo = algo if algo is not None else AlgoConfig()
    rewards, metrics = shape_rewards(trajs, cfg.shaping)
    out, weights, m = control_extremes(trajs, cfg.extreme)
    metrics.update(m)
    adv, n_zero, n_groups = group_step_advantages(out, rewards, algo)
    if cfg.extreme.enabled:
        adv = reweight_negatives(adv, cfg.extreme.negative_weight) * weights
    metrics.update(advantage_metrics(out, adv, n_zero, n_groups))
    per_chunk = chunk_rew = None
    est, eps = group_estimator(algo), algo.adv_eps
    if algo.uses_critic():
        per_chunk, chunk_rew, m = critic_chunk_inputs(out, rewards, loss_cfg, cfg.turn_credit, est, eps)
        metrics.update(m)
    elif cfg.turn_credit.enabled:
        tc = cfg.turn_credit
        per_chunk, m = turn_advantages(out, adv, loss_cfg, weight=tc.weight, process_reward=tc.process_reward,
                                       estimator=est, eps=eps)
        metrics.update(m)
    return StepAdvantages(out, rewards, adv, metrics, per_chunk, chunk_rew)


def attach_roles(packed: PackedStep, prep: StepAdvantages, loss_cfg: LossConfig,
                 ipa: Optional[IPAResampleConfig] = None) -> None:
    """What the objective needs beyond the packed advantages, on each micro-batch: turn credit's (or the
    critic's) per-chunk loss segments, the critic's value points, and with IPA resampling on
    (``ipa.enabled``) the loss roles (imitated prefix tokens, resampled chunk ids, step-global
    normalizers)."""
    trajs = prep.trajectories
    if prep.chunk_advantages is not None:
        for mb in packed.all_micro_batches():
            mb.segments = chunk_segments(mb, trajs, prep.chunk_advantages) if not mb.is_empty else None
    if prep.chunk_rewards is not None:  # the critic: each micro-batch's value points, one per trained chunk
        mbs = [mb for mb in packed.all_micro_batches() if not mb.is_empty]
        for mb in mbs:
            mb.critic = critic_points(mb, trajs, prep.chunk_rewards)
        total = sum(int(mb.critic["pos"].numel()) for mb in mbs)
        for mb in mbs:  # the value loss is the mean over the step's chunks (all ranks)
            mb.critic["normalizer"] = float(max(total, 1))
    if ipa is not None and ipa.enabled:
        il_n, rl_n = ipa_normalizers(trajs, loss_cfg)
        for mb in packed.all_micro_batches():
            il_mask, rl_ids = split_chunk_roles(mb, trajs)
            mb.ipa = {"il_mask": il_mask, "rl_chunk_ids": rl_ids, "il_normalizer": il_n, "rl_normalizer": rl_n,
                      "lambda_il": ipa.lambda_il, "lambda_rl": ipa.lambda_rl}


def prepare_step(trajs: Sequence[Trajectory], loss_cfg: LossConfig, packer: PackerConfig,
                 cfg: Optional[StabilizerConfig] = None, algo: Optional[AlgoConfig] = None):
    """``(packed step, StepAdvantages)``: the step's advantages, the packing of its trajectories with
    them, and each micro-batch's loss roles.  Trainer rank 0 calls it once per step; each rank's
    objective turns its micro-batches into the loss (objectives.py)."""
    cfg = cfg if cfg is not None else StabilizerConfig()
    prep = step_advantages(trajs, loss_cfg, cfg, algo)
    packed = pack_step(prep.trajectories, packer, loss_cfg, advantages=prep.advantages)
    attach_roles(packed, prep, loss_cfg, cfg.ipa)
    if loss_cfg.advantages_in_pass:  # the step's group table; each micro-batch its rows (in_pass.py)
        attach_in_pass(packed, prep, algo if algo is not None else AlgoConfig())
    return packed, prep
