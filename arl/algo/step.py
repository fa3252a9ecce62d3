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


def prompt_ev_ceiling(trajs: Sequence[Trajectory], rewards: np.ndarray) -> dict:
    """``value/prompt_ev_ceiling``: the share of the step's outcome variance that lies between tasks,
    1 - mean within-group variance / total variance (groups: the samples of one task).  No value of
    the prompt alone (a turn-0 state) can explain more of the outcome than this; when every task is
    as hard as the others it is near 0 and only later turns' states can carry what the value needs.
    Left out when the outcomes all agree (nothing to explain)."""
    kept = np.array([t.status is not TrajectoryStatus.FILTERED for t in trajs], dtype=bool)
    r = np.asarray(rewards, dtype=np.float64)[kept]
    gids = np.array([int(t.group_id) for t, k in zip(trajs, kept) if k], dtype=np.int64)
    total = r.var() if r.size else 0.0
    if total <= 1e-12:
        return {}
    within = sum(r[gids == g].var() * (gids == g).sum() for g in np.unique(gids)) / r.size
    return {"value/prompt_ev_ceiling": float(1.0 - within / total)}


def _ceiling(visits: dict, name: str) -> dict:
    """1 - E[Var(G | key)] / Var(G) over the chunks whose key was visited more than once (unbiased, with
    n - 1), and the share of all chunks they are; nothing when no key repeats or their outcomes agree."""
    n_all = sum(len(v) for v in visits.values())
    seen = [np.asarray(v) for v in visits.values() if len(v) > 1]
    n = sum(v.size for v in seen)
    if n < 2:
        return {}
    total = np.concatenate(seen).var(ddof=1)
    if total <= 1e-12:
        return {}
    within = sum(v.size * v.var(ddof=1) for v in seen) / n
    return {f"value/{name}_ev_ceiling": float(1.0 - within / total), f"value/{name}_ev_coverage": n / n_all}


def state_ev_ceiling(trajs: Sequence[Trajectory], rewards: np.ndarray) -> dict:
    """How much of the outcome a value of the state could explain, on the states the step visited more
    than once: 1 - E[Var(G | state)] / Var(G) over their chunks, each variance with n - 1 (unbiased:
    what a value function could explain on fresh samples from these states); ``*_coverage``: the share
    of the step's chunks in such states.  Two views of a chunk's state:

    * ``value/state_ev_*``: the exact state, everything before the chunk's first token (prompt,
      earlier turns, observations); chunks share it only when their prefixes are the same tokens, so
      the states after a group's samples diverge are singletons and are not measured;
    * ``value/progress_ev_*`` (when the env reports ``new_state`` for every turn): the task, the turn
      index and the number of turns that reached a new state before it.  That is the environment's
      whole state for envs whose state is their progress through the task (``long_lookup``,
      ``toy_lookup``: the position on the chain and the turns used), and it pools the singletons.

    Left out when no state is revisited or their outcomes all agree."""
    exact: dict = {}
    progress: dict = {}
    has_progress = True
    for t, r in zip(trajs, np.asarray(rewards, dtype=np.float64)):
        if t.status is TrajectoryStatus.FILTERED:
            continue
        ids = t.chunk_ids
        starts = np.flatnonzero((ids >= 0) & (np.r_[-1, ids[:-1]] != ids))
        info = t.metadata.get("turn_info") or []
        has_progress = has_progress and len(info) >= len(starts) and all("new_state" in i for i in info[:len(starts)])
        done = 0
        for k, s in enumerate(starts):
            exact.setdefault(t.tokens[:s].tobytes(), []).append(float(r))
            if has_progress:
                progress.setdefault((int(t.group_id), k, done), []).append(float(r))
                done += bool(info[k]["new_state"])
    out = _ceiling(exact, "state")
    if has_progress:
        out.update(_ceiling(progress, "progress"))
    return out


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
        metrics.update(prompt_ev_ceiling(out, rewards))
        metrics.update(state_ev_ceiling(out, rewards))
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
    return packed, prep
