"""Dynamic sampling (DAPO): groups whose rewards all agree carry no advantage signal; drop them and
sample more groups until the batch is full, for at most ``max_rounds`` extra rounds.

Judges at sampling time, before shaping and advantages: ``DynamicSampler`` says how many groups
are missing; the rollout side (``arl.rollout.manager.fill_batch``) samples them.  A group's variance is judged on the outcome
reward of its trainable (non-FILTERED, non-MASKED) members; a group with fewer than two of them has
zero variance.  Metric ``stab/zero_var_frac`` is measured BEFORE filtering, over every group sampled
for the step (all rounds); so is ``stab/reward_mean_sampled``, the mean outcome reward of every OK
trajectory sampled for the step: ``success/train`` is measured on the kept (mixed) groups only,
which pins it between 1/G and 1-1/G whatever the policy's own success is.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from ..data.trajectory import Trajectory, TrajectoryStatus
from ..config import DynamicSamplingConfig


def group_by_id(trajs: Iterable[Trajectory]) -> "OrderedDict[int, list]":
    """Trajectories by group id, groups in order of first appearance."""
    out: OrderedDict = OrderedDict()
    for t in trajs:
        out.setdefault(int(t.group_id), []).append(t)
    return out


def is_zero_variance(group: Sequence[Trajectory], atol: float = 0.0) -> bool:
    r = [float(t.reward) for t in group if t.status is TrajectoryStatus.OK]
    return len(r) < 2 or max(r) - min(r) <= atol


def filter_zero_variance_groups(trajs: Sequence[Trajectory], atol: float = 0.0):
    """``(kept, metrics)``: the trajectories of groups with reward variance, in input order."""
    groups = group_by_id(trajs)
    zero = {g for g, members in groups.items() if is_zero_variance(members, atol)}
    kept = [t for t in trajs if int(t.group_id) not in zero]
    n = len(groups)
    return kept, {"stab/zero_var_frac": len(zero) / n if n else 0.0,
                  "stab/groups_sampled": n, "stab/groups_kept": n - len(zero)}


class DynamicSampler:
    """Fills one step's batch of ``target_groups`` groups with informative groups.

    The loop::

        s = DynamicSampler(cfg, target_groups=G)
        s.add(first_batch_trajectories)
        while (n := s.groups_needed()) > 0:
            s.add(await sample_more_groups(n))   # the rollout hook: n more groups, same policy step
        trajs, metrics = s.finish()
    """

    def __init__(self, cfg: DynamicSamplingConfig, target_groups: int):
        if target_groups < 1:
            raise ValueError(f"target_groups: must be >= 1, got {target_groups}")
        self.cfg, self.target = cfg, int(target_groups)
        self.rounds = 0  # calls to add()
        self._kept: list = []  # informative groups (lists of trajectories), in arrival order
        self._dropped: list = []
        self._seen = 0
        self._zero = 0  # zero-variance groups seen (counted whether or not dropping is enabled)
        self._rewards: list = []  # outcome rewards of every OK trajectory seen, kept or dropped

    def add(self, trajs: Sequence[Trajectory]) -> None:
        self.rounds += 1
        for members in group_by_id(trajs).values():
            self._seen += 1
            zero = is_zero_variance(members, self.cfg.atol)
            self._zero += zero
            self._rewards += [float(t.reward) for t in members if t.status is TrajectoryStatus.OK]
            if self.cfg.enabled and zero:
                self._dropped.append(members)
            else:
                self._kept.append(members)

    def groups_needed(self) -> int:
        """How many more groups the loop should sample now (0: call ``finish``)."""
        if self.rounds == 0:
            return self.target
        if not self.cfg.enabled or self.rounds > self.cfg.max_rounds:
            return 0
        return max(0, self.target - len(self._kept))

    def finish(self):
        """``(trajectories, metrics)`` of the step's batch (at most ``target_groups`` groups)."""
        groups = self._kept[: self.target]
        short = self.target - len(groups)
        if short > 0 and self.cfg.on_short == "pad":  # keep the batch size: zero-advantage groups
            groups = groups + self._dropped[:short]
        trajs = [t for g in groups for t in g]
        n = self._seen
        return trajs, {
            "stab/zero_var_frac": self._zero / n if n else 0.0,
            "stab/groups_sampled": n,
            "stab/groups_kept": min(len(self._kept), self.target),
            "stab/sampling_rounds": self.rounds,
            "stab/groups_short": max(0, self.target - len(self._kept)),
            "stab/reward_mean_sampled": sum(self._rewards) / len(self._rewards) if self._rewards else 0.0,
        }
