"""``RolloutBatch``: one step's trajectories as the rollout side hands them to the trainer; the
masked placeholder that stands in for a broken trajectory; the merge of several engines' shares
of one step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .trajectory import Trajectory, TrajectoryStatus


@dataclass
class RolloutBatch:
    step: int
    trajectories: list  # groups_per_step * group_size, group by group; FILTERED ones included
    metrics: dict

    def trainable(self) -> list:
        """Everything but FILTERED (MASKED placeholders stay: they keep the batch size)."""
        return [t for t in self.trajectories if t.status is not TrajectoryStatus.FILTERED]


def placeholder(t: Trajectory) -> Trajectory:
    """Masked stand-in for a broken trajectory: same tokens, nothing trained, reward 0."""
    return Trajectory(tokens=t.tokens, chunk_ids=np.full(len(t), -1, np.int32), rollout_logp=np.zeros(len(t), np.float32),
                      reward=0.0, group_id=t.group_id, policy_version=t.policy_version, turns=[],
                      status=TrajectoryStatus.MASKED, metadata=dict(t.metadata))


# how per-engine rollout metrics combine into the step's: counts add up, maxima take the max,
# means and fractions are weighted by each engine's trajectory count
_MAX_KEYS = ("_max", "_peak", "sampling_rounds")
_MEAN_KEYS = ("_mean", "_frac")


def merge_batches(batches: Sequence):
    """One ``RolloutBatch`` from each engine's batch of the same step.  Group ids are renumbered
    ``gid * E + e`` so groups of different engines never share an id (advantages, dynamic sampling
    and turn credit group by it)."""
    if len(batches) == 1:
        return batches[0]
    steps = {b.step for b in batches}
    if len(steps) != 1:
        raise RuntimeError(f"rollout engines: batches of different steps {sorted(steps)} cannot be merged")
    E = len(batches)
    trajs = []
    for e, b in enumerate(batches):
        for t in b.trajectories:
            t.group_id = int(t.group_id) * E + e
            trajs.append(t)
    weights = [max(int(b.metrics.get("rollout/num_trajectories", len(b.trajectories))), 0) for b in batches]
    total = sum(weights) or 1
    metrics = {}
    for key in dict.fromkeys(k for b in batches for k in b.metrics):
        vals = [(b.metrics[key], w) for b, w in zip(batches, weights) if key in b.metrics]
        if any(s in key for s in _MAX_KEYS):
            metrics[key] = max(v for v, _ in vals)
        elif any(s in key for s in _MEAN_KEYS):
            den = sum(w for _, w in vals) or total
            metrics[key] = sum(float(v) * w for v, w in vals) / den
        else:
            metrics[key] = sum(v for v, _ in vals)
    metrics["rollout/engines"] = E
    return RolloutBatch(batches[0].step, trajs, metrics)
