"""Per-trajectory step advantages with stabilizer weights, and their hand-over to packed micro-batches.

``trajectory_advantages`` reproduces the packer's step-wide advantages exactly (same rewards, same
group ids, FILTERED trajectories left out, float64) from the given (possibly shaped) rewards;
``apply_advantages`` writes the weighted ones into every micro-batch, which the trainer then passes
as ``policy_loss(..., advantages=mb.advantages)`` for every micro-batch (exact for complete groups
too).  gamma discounting and ``positive_only`` still act per chunk inside the loss.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..data.trajectory import Trajectory, TrajectoryStatus
from ..ops.policy_loss.config import LossConfig
from ..ops.policy_loss.spec import group_advantages


def trajectory_advantages(trajs: Sequence[Trajectory], rewards: np.ndarray, loss_cfg: LossConfig) -> np.ndarray:
    """[N] float64 step advantages (0 for FILTERED trajectories, which the packer skips)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.shape != (len(trajs),):
        raise ValueError(f"rewards: shape {rewards.shape} does not match {len(trajs)} trajectories")
    if not np.isfinite(rewards).all():
        i = int(np.flatnonzero(~np.isfinite(rewards))[0])
        raise ValueError(f"rewards: non-finite value {rewards[i]} at index {i}")
    keep = np.array([t.status is not TrajectoryStatus.FILTERED for t in trajs], dtype=bool)
    adv = np.zeros(len(trajs), dtype=np.float64)
    if keep.any():
        gids = torch.tensor([int(t.group_id) for t, k in zip(trajs, keep) if k], dtype=torch.int64)
        a, _, _ = group_advantages(torch.from_numpy(rewards[keep]), gids, loss_cfg)
        adv[keep] = a.numpy()
    return adv


def advantage_metrics(trajs: Sequence[Trajectory], adv: np.ndarray) -> dict:
    """Over trajectories that train (OK): share with a negative advantage, mean advantage."""
    ok = np.array([t.status is TrajectoryStatus.OK for t in trajs], dtype=bool)
    a = adv[ok]
    return {"stab/neg_adv_share": float((a < 0).mean()) if a.size else 0.0,
            "stab/adv_mean": float(a.mean()) if a.size else 0.0,
            "stab/adv_abs_mean": float(np.abs(a).mean()) if a.size else 0.0}


def apply_advantages(packed, adv: np.ndarray) -> None:
    """Overwrite ``advantages`` of every micro-batch of a ``PackedStep`` (indexed by
    ``traj_indices``, i.e. positions in the trajectory list given to ``pack_step``)."""
    adv = np.asarray(adv, dtype=np.float64)
    for mb in packed.all_micro_batches():
        idx = mb.traj_indices.numpy()
        if idx.size and int(idx.max()) >= adv.shape[0]:
            raise ValueError(f"adv: {adv.shape[0]} entries, but a micro-batch holds trajectory index {int(idx.max())}")
        mb.advantages = torch.from_numpy(adv[idx].copy())
