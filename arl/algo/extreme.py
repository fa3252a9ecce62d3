"""Extreme-trajectory control and negative-sample reweighting.

Acts on the batch (before packing) and on the per-trajectory advantages:
  * a FAILED trajectory (OK status, outcome reward <= ``failure_reward``) longer than
    ``max_failed_tokens`` is either masked (a copy with status MASKED: the packer forces its chunk
    ids to -1, so it leaves the normalizer and the gradient but keeps the batch size) or its
    advantage is multiplied by ``long_weight`` (its tokens stay in the normalizer);
  * every negative advantage is multiplied by ``negative_weight`` (global reweighting).
The masked trajectory's reward still enters its group's baseline: it is a genuine sample of the
policy.  Weights act through the ``advantages=`` override of ``policy_loss``, so every kernel
backend supports them unchanged.

Early-warning metrics (always computed): max/mean length of failed and of successful trajectories
(a rising failed max at a constant failure count precedes collapse), the failure share, and
``stab/neg_adv_share`` (from the advantages, see ``advantage_metrics``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..data.trajectory import Trajectory, TrajectoryStatus
from ..config import ExtremeTrajectoryConfig


def trajectory_lengths(trajs: Sequence[Trajectory], length_of: str = "tokens") -> np.ndarray:
    if length_of == "tokens":
        return np.array([len(t) for t in trajs], dtype=np.int64)
    return np.array([t.num_trained_tokens for t in trajs], dtype=np.int64)


def failed_mask(trajs: Sequence[Trajectory], failure_reward: float = 0.0) -> np.ndarray:
    """OK trajectories whose outcome reward is <= ``failure_reward``."""
    return np.array([t.status is TrajectoryStatus.OK and float(t.reward) <= failure_reward for t in trajs], dtype=bool)


def length_metrics(trajs: Sequence[Trajectory], cfg: ExtremeTrajectoryConfig) -> dict:
    L = trajectory_lengths(trajs, cfg.length_of)
    failed = failed_mask(trajs, cfg.failure_reward)
    ok = np.array([t.status is TrajectoryStatus.OK for t in trajs], dtype=bool)
    succ = ok & ~failed

    def stats(sel):
        return (int(L[sel].max()), float(L[sel].mean())) if sel.any() else (0, 0.0)

    fmax, fmean = stats(failed)
    smax, smean = stats(succ)
    return {"stab/failed_len_max": fmax, "stab/failed_len_mean": fmean, "stab/success_len_max": smax,
            "stab/success_len_mean": smean, "stab/failure_share": float(failed.sum() / ok.sum()) if ok.any() else 0.0}


def control_extremes(trajs: Sequence[Trajectory], cfg: ExtremeTrajectoryConfig):
    """``(trajectories, weights [N], metrics)``.  Masked ones are copies with status MASKED and
    ``metadata["stab_masked"] = "long_failure"``; ``weights`` multiply the advantages (0 for masked)."""
    out, w = list(trajs), np.ones(len(trajs), dtype=np.float64)
    n_long = 0
    if cfg.enabled and cfg.max_failed_tokens is not None:
        L = trajectory_lengths(trajs, cfg.length_of)
        long = failed_mask(trajs, cfg.failure_reward) & (L > cfg.max_failed_tokens)
        n_long = int(long.sum())
        for i in np.flatnonzero(long):
            if cfg.action == "mask":
                t = trajs[i]
                out[i] = dataclasses.replace(t, status=TrajectoryStatus.MASKED,
                                             metadata={**t.metadata, "stab_masked": "long_failure"})
                w[i] = 0.0
            else:
                w[i] = cfg.long_weight
    return out, w, {"stab/long_failures": n_long}


def reweight_negatives(adv: np.ndarray, negative_weight: float) -> np.ndarray:
    return np.where(adv < 0, adv * negative_weight, adv)
