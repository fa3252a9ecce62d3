"""``loss.advantages_in_pass``: the step's group table, once, on trainer rank 0, and each micro-batch's
rows of it (``MicroBatch.group_adv``); the loss pass computes each sequence's advantage from them
(arl/ops/policy_loss/group_adv.py).  The table covers the whole step, so a group split over
micro-batches or ranks gets the same advantages as before packing; a check here says so."""
from __future__ import annotations

import numpy as np

from ..config.algo import AlgoConfig
from ..data.trajectory import TrajectoryStatus
from ..ops.policy_loss.group_adv import in_pass_advantages, step_groups


def attach_in_pass(packed, prep, algo: AlgoConfig) -> None:
    """Give every micro-batch of ``packed`` its in-pass inputs from the step ``prep`` (the prepared
    batch: its trajectories, the rewards its advantages came from and those advantages)."""
    trajs = prep.trajectories
    keep = np.array([t.status is not TrajectoryStatus.FILTERED for t in trajs], dtype=bool)
    groups = step_groups(prep.rewards, [int(t.group_id) for t in trajs], keep, algo.advantage, algo.adv_eps)
    kept = np.flatnonzero(keep)
    # the same float64 operations as the registry: equal to the step's advantages bit for bit
    if kept.size and not np.array_equal(in_pass_advantages(groups.take(kept)).numpy(), prep.advantages[kept]):
        raise ValueError("loss.advantages_in_pass: the step's advantages are not the group estimator of its rewards "
                         "(an advantage weight or per-chunk term is on); set it false")
    for mb in packed.all_micro_batches():
        mb.group_adv = groups.take(mb.traj_indices.numpy())
