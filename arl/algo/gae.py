"""Turn-level GAE: advantages from a value baseline at every chunk (model turn), for the critic.

Per trajectory with chunks k = 0..K-1 (in order) and the critic's values V_k of the context each
chunk acts in (arl/algo/critic.py reads them at the token before the chunk's first token):

  r_k   = process_reward * [turn k reached a new state]     (turn credit's, when turn credit is on)
          + R on the last chunk                             (R: the step's reward, shaped when shaping is on)
  delta_k = r_k + gamma * V_{k+1} - V_k                     (V_K = 0: the episode has ended)
  A_k   = sum_l (gamma * lam)^l delta_{k+l}                 (lam 0: delta_k; lam 1: sum_l gamma^l r_{k+l} - V_k)
  G_k   = A_k + V_k                                          (the value target)

Rank 0 computes what does not depend on the values, once per step (``critic_chunk_inputs``: the chunk
rewards and the base per-chunk advantages, which are turn credit's step advantages when it is on and
0 otherwise: the critic's baseline replaces the group's), and each micro-batch carries its chunks'
positions and rewards (``critic_points``).  The values themselves come from the trainer's forward
(the gradient pass's own, detached, with one update per batch; the old pass's otherwise), so ``gae``
runs per micro-batch; a trajectory is never split over micro-batches (the packer keeps it whole or
truncates it; a chunk cut off by truncation adds its reward to the last chunk that was packed).

Advantages are in reward units, centred by the critic; ``critic.whiten`` normalizes them over the
step in the trainer (arl/algo/critic.py), from the no-grad old pass's values.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .advantages import gae  # noqa: F401  GAE itself is the registry's ``gae`` estimator
from ..data.trajectory import Trajectory, TrajectoryStatus
from ..ops.policy_loss.config import LossConfig
from .turn_credit import chunk_process_rewards, chunk_starts, packed_chunks, turn_advantages


def chunk_rewards(t: Trajectory, K: int, reward: float, process_reward: float) -> np.ndarray:
    """[K] r_k of one trajectory: the process reward per new state (0 when ``process_reward`` is 0) and
    ``reward`` on the last chunk."""
    r = chunk_process_rewards(t, K, process_reward) if process_reward else np.zeros(K, dtype=np.float64)
    if K:
        r[K - 1] += float(reward)
    return r


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


def critic_chunk_inputs(trajs: Sequence[Trajectory], rewards: np.ndarray, loss_cfg: LossConfig, turn_credit,
                        estimator: str = "grpo", eps: float = 1e-6):
    """``(base_chunk_adv, chunk_rewards, metrics)`` per trajectory ([K_i] float64 each; empty for those
    that train nothing).  ``turn_credit``: its config section; when on, its process reward enters the
    chunk rewards and its anchor step advantages (without the trajectory part) are the base.  The
    metrics include how much of the outcome a value could explain (``prompt_ev_ceiling``,
    ``state_ev_ceiling``)."""
    on = turn_credit.enabled
    proc = float(turn_credit.process_reward) if on else 0.0
    base, metrics = ([np.zeros(0, dtype=np.float64) for _ in trajs], {})
    if on:
        base, metrics = turn_advantages(trajs, np.zeros(len(trajs)), loss_cfg, weight=turn_credit.weight,
                                        process_reward=proc, estimator=estimator, eps=eps)
    out = []
    for i, t in enumerate(trajs):
        K = chunk_starts(t).size if t.status is TrajectoryStatus.OK else 0
        out.append(chunk_rewards(t, K, float(rewards[i]), proc))
        if not on:
            base[i] = np.zeros(K, dtype=np.float64)
    metrics.update(prompt_ev_ceiling(trajs, rewards))
    metrics.update(state_ev_ceiling(trajs, rewards))
    return base, out, metrics


def critic_points(mb, trajs: Sequence[Trajectory], chunk_rew: Sequence[np.ndarray]) -> dict:
    """The micro-batch's value points, one per trained chunk, in ``chunk_segments``' order:
    ``pos`` [P] the token before the chunk's first token (its hidden state has read exactly the
    context the chunk acts in), ``seg`` [P] the chunk's loss segment, ``seq`` [P] its sequence in the
    micro-batch, ``rewards`` [P] r_k (a cut-off tail's rewards on the last packed chunk); for the
    critic's diagnostics, ``turn`` [P] the chunk's turn index k and ``episode_return`` [P] its
    trajectory's whole return (outcome plus process rewards)."""
    pos, seg, seq, rew, turn, ret = [], [], [], [], [], []
    s = 0
    for j, i in enumerate(mb.traj_indices.tolist()):
        a = int(mb.cu_seqlens[j])
        starts, present = packed_chunks(mb, j, trajs[i])
        r = chunk_rew[i]
        if not present or r.size == 0:
            s += 1  # one segment, nothing trained
            continue
        for n, k in enumerate(present):
            if starts[k] < 1:
                raise ValueError(f"trajectories[{i}]: chunk {k} starts at token 0; a model turn needs a context "
                                 "before it (the prompt)")
            pos.append(a + int(starts[k]) - 1)
            seg.append(s)
            seq.append(j)
            rew.append(float(r[k:].sum()) if n == len(present) - 1 else float(r[k]))
            turn.append(int(k))
            ret.append(float(r.sum()))
            s += 1
    return {"pos": torch.tensor(pos, dtype=torch.int64), "seg": torch.tensor(seg, dtype=torch.int64),
            "seq": torch.tensor(seq, dtype=torch.int64), "rewards": torch.tensor(rew, dtype=torch.float64),
            "turn": torch.tensor(turn, dtype=torch.int64), "episode_return": torch.tensor(ret, dtype=torch.float64),
            "normalizer": 1.0}
