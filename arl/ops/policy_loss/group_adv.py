"""Group-normalized advantages computed inside the loss pass (``loss.advantages_in_pass``).

The group estimators grpo, dr_grpo and rloo (arl/algo/advantages.py, the one definition) are
functions of a trajectory's reward and a few statistics of its group.  A group may be split over
micro-batches (and ranks), so those statistics come from the whole step: ``step_groups`` reduces
the step's rewards once to a [G, 4] float64 table (count, sum, std, zero_var per group; the same
float64 operations as the registry: bincount sums, Bessel-corrected std of the deviations from the
mean, zero variance as max == min).  Each micro-batch carries its sequences' rewards, their rows in
that table and the table itself (``GroupAdvantages``); the fused kernels evaluate the estimator per
sequence in float64 inside the pass, round it once to the compute dtype (as a given advantage is)
and feed the chunk returns and the surrogate with it.  ``in_pass_advantages`` is the same formula
in torch: what the reference backend runs and the kernels are tested against.

Per sequence i of group g (mean_g = sum_g / max(count_g, 1)), 0 when the group has zero variance:
  grpo     (R_i - mean_g) / (std_g + eps)
  dr_grpo  R_i - mean_g
  rloo     R_i - (sum_g - R_i) / max(count_g - 1, 1)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# in-pass estimator -> code (enum AdvEstimator of csrc/policy_loss/core.h; 0: advantages given)
IN_PASS = {"grpo": 1, "dr_grpo": 2, "rloo": 3}
GROUP_STATS = ("count", "sum", "std", "zero_var")  # columns of the step's [G, 4] table


@dataclass
class GroupAdvantages:
    """A micro-batch's in-pass advantage inputs: per sequence its reward and its group's row in the
    step's statistics table, the table, and the estimator that turns them into A_i."""

    rewards: torch.Tensor  # [N] float64 reward of each packed sequence
    group_index: torch.Tensor  # [N] int64 row of its group in ``stats``
    stats: torch.Tensor  # [G, 4] float64 the whole step's group statistics (GROUP_STATS)
    estimator: str  # one of IN_PASS
    eps: float  # added to grpo's std

    def to(self, device) -> "GroupAdvantages":
        return GroupAdvantages(self.rewards.to(device), self.group_index.to(device), self.stats.to(device),
                               self.estimator, self.eps)


@dataclass
class StepGroups:
    """The step's group statistics and each trajectory's row (-1: in no group, e.g. FILTERED)."""

    rewards: np.ndarray  # [n] float64
    row: np.ndarray  # [n] int64
    stats: torch.Tensor  # [G, 4] float64
    estimator: str
    eps: float

    def take(self, traj_indices) -> GroupAdvantages:
        """The in-pass inputs of the sequences ``traj_indices`` (a micro-batch's ``traj_indices``)."""
        idx = np.asarray(traj_indices, dtype=np.int64)
        if idx.size and (self.row[idx] < 0).any():
            raise ValueError(f"advantages_in_pass: trajectory {int(idx[self.row[idx] < 0][0])} is in no group of the step")
        return GroupAdvantages(torch.from_numpy(self.rewards[idx].copy()), torch.from_numpy(self.row[idx].copy()),
                               self.stats, self.estimator, self.eps)


def step_groups(rewards, group_ids, keep, estimator: str, eps: float) -> StepGroups:
    """The step's table from its trajectories' ``rewards`` [n], ``group_ids`` [n] (any integers) and
    ``keep`` [n] (those that take part in a group: not FILTERED)."""
    if estimator not in IN_PASS:
        raise ValueError(f"advantages_in_pass: estimator {estimator!r} is not a group statistic the pass computes "
                         f"(in-pass: {', '.join(IN_PASS)})")
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    gid = np.asarray(group_ids).reshape(-1)
    keep = np.asarray(keep, dtype=bool).reshape(-1)
    if not (r.shape == gid.shape == keep.shape):
        raise ValueError(f"step_groups: rewards {r.shape}, group_ids {gid.shape} and keep {keep.shape} must match")
    if not np.isfinite(r[keep]).all():
        i = int(np.flatnonzero(keep & ~np.isfinite(r))[0])
        raise ValueError(f"rewards: non-finite value {r[i]} at index {i}")
    row = np.full(r.shape, -1, dtype=np.int64)
    rk = r[keep]
    if rk.size == 0:
        return StepGroups(r, row, torch.zeros((0, len(GROUP_STATS)), dtype=torch.float64), estimator, float(eps))
    _, g = np.unique(gid[keep], return_inverse=True)
    g = g.reshape(-1).astype(np.int64)
    row[keep] = g
    G = int(g.max()) + 1
    # the registry's float64 operations, in its order (arl/algo/advantages.py _group_stats, grpo)
    cnt = np.bincount(g, minlength=G).astype(np.float64)
    total = np.bincount(g, weights=rk, minlength=G)
    d = rk - (total / np.maximum(cnt, 1.0))[g]
    std = np.sqrt(np.bincount(g, weights=d * d, minlength=G) / np.maximum(cnt - 1.0, 1.0))
    rmax = np.full(G, -np.inf)
    np.maximum.at(rmax, g, rk)
    rmin = np.full(G, np.inf)
    np.minimum.at(rmin, g, rk)
    stats = np.stack([cnt, total, std, (rmax == rmin).astype(np.float64)], axis=1)
    return StepGroups(r, row, torch.from_numpy(stats), estimator, float(eps))


def in_pass_advantages(g: GroupAdvantages) -> torch.Tensor:
    """A_i [N] float64 of ``g``: the formula the kernels evaluate per sequence (module doc)."""
    r = g.rewards.to(torch.float64)
    st = g.stats.to(torch.float64)[g.group_index.long()]
    cnt, total, std, zero = st.unbind(1)
    if g.estimator == "rloo":
        a = r - (total - r) / cnt.sub(1.0).clamp_min(1.0)
    else:
        a = r - total / cnt.clamp_min(1.0)
        if g.estimator == "grpo":
            a = a / (std + g.eps)
    return torch.where(zero != 0, torch.zeros_like(a), a)


def validate_group(g: GroupAdvantages, n_seq: int, device, values: bool = True) -> None:
    """The in-pass inputs of a pack of ``n_seq`` sequences: one line per problem.  ``values`` also
    checks the rows' range and finiteness (a device sync; a kernel reads an out-of-range row as NaN)."""
    if not isinstance(g, GroupAdvantages):
        raise ValueError(f"group: expected a GroupAdvantages, got {type(g).__name__}")
    if g.estimator not in IN_PASS:
        raise ValueError(f"group: estimator {g.estimator!r} is not computed in the pass (in-pass: {', '.join(IN_PASS)})")
    if not (isinstance(g.eps, float) and g.eps > 0 and np.isfinite(g.eps)):
        raise ValueError(f"group: eps must be a positive float, got {g.eps!r}")
    for name, x, dt, dim in (("rewards", g.rewards, torch.float64, 1), ("group_index", g.group_index, torch.int64, 1),
                             ("stats", g.stats, torch.float64, 2)):
        if not isinstance(x, torch.Tensor) or x.dtype != dt or x.dim() != dim:
            what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"group.{name}: expected a {dim}-D {dt} tensor, got {what}")
        if x.device != device:
            raise ValueError(f"group.{name}: on device {x.device}, but logp is on {device}")
    if g.rewards.numel() != n_seq or g.group_index.numel() != n_seq:
        raise ValueError(f"group: {g.rewards.numel()} rewards and {g.group_index.numel()} group indices for "
                         f"{n_seq} sequences (cu_seqlens)")
    G = g.stats.shape[0]
    if g.stats.shape[1] != len(GROUP_STATS):
        raise ValueError(f"group.stats: shape {tuple(g.stats.shape)}, expected [G, {len(GROUP_STATS)}] ({', '.join(GROUP_STATS)})")
    if not values:
        return
    bad = (g.group_index < 0) | (g.group_index >= G)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"group.group_index: {int(g.group_index[i])} at index {i} is outside the {G} groups of stats")
    for name, x in (("rewards", g.rewards), ("stats", g.stats)):
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"group.{name}: non-finite value")
