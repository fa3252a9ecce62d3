"""Turn-level credit: a per-chunk advantage from anchor-state groups (GiGPO-style, arXiv 2505.10978).

Outcome-only advantages give every chunk of a trajectory the same sign: a trajectory that copied three
keys right and the fourth wrong pushes all four down.  Here each chunk also gets a *step* advantage:

  r_{i,k}  = process_reward * [turn k reached a new state] (+ the outcome reward R_i on the last chunk)
  G_{i,k}  = r_{i,k} + gamma * G_{i,k+1}                       (the chunk's discounted return)
  anchor   = (group, every token before chunk k)               (the exact context the policy acted in)
  A^S_{i,k} = estimator(G_{i,k} over the chunks sharing its anchor)  (algo.advantage's group estimator;
             0 for an anchor seen once or whose returns all agree)
  A_{i,k}  = gamma^(K_i-1-k) * A_i + weight * A^S_{i,k}        (A_i: the step's per-trajectory advantage)

Samples of one task share the prompt, so every group's first chunks form one anchor group; samples that
made the same choices share the later anchors, and there the chunk that found the next state is
compared with the one that did not.  The anchor is the token prefix itself, so any env works: equal
contexts are the only thing compared.  ``new_state`` comes from ``metadata["turn_info"]`` (the env's
verdict, recorded by the episode).

The loss sees the per-chunk advantages by scoring each chunk as its own segment (``chunk_segments``):
with ``ratio_level`` token or chunk, ``mismatch_level`` none/token/chunk and ``loss_agg: token-mean``
a chunk's loss depends only on its own tokens and advantage, so splitting the sequences at chunk starts
changes nothing else (the normalizer is the step's trained-token count either way), and every kernel
backend runs unchanged.  Other levels would change meaning: the config rejects them (``arl.config.stabilizers.check_turn_credit_loss``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np
import torch

from .advantages import group_advantages
from ..data.trajectory import Trajectory, TrajectoryStatus
from ..ops.policy_loss.config import LossConfig


def chunk_starts(t: Trajectory) -> np.ndarray:
    """[K] first token index of each local chunk 0..K-1 (-1 for a chunk with no token)."""
    cid = t.chunk_ids
    K = int(cid.max()) + 1 if cid.size and int(cid.max()) >= 0 else 0
    starts = np.full(K, -1, dtype=np.int64)
    tidx = np.flatnonzero(cid >= 0)
    if tidx.size:
        c = cid[tidx]
        first = np.ones(tidx.size, dtype=bool)
        first[1:] = c[1:] != c[:-1]
        starts[c[first]] = tidx[first]
    return starts


def chunk_process_rewards(t: Trajectory, K: int, process_reward: float) -> np.ndarray:
    """[K] process_reward on each chunk whose turn reached a new state (env's ``new_state``)."""
    r = np.zeros(K, dtype=np.float64)
    info = t.metadata.get("turn_info") or []
    for k, turn in enumerate(info[:K]):
        if not isinstance(turn, dict):
            raise ValueError(f"metadata['turn_info'][{k}]: expected a dict, got {type(turn).__name__}")
        if turn.get("new_state") and not turn.get("tool_error"):
            r[k] = process_reward
    return r


def _anchor_advantages(anchors: dict, returns: dict, estimator: str, eps: float) -> list:
    """Each anchor group's chunk returns through the group estimator, in ``anchors``' order."""
    members = list(anchors.values())
    if not members:
        return []
    g = np.concatenate([np.array([returns[i][k] for i, k in m], dtype=np.float64) for m in members])
    gid = np.repeat(np.arange(len(members)), [len(m) for m in members])
    a, _, _ = group_advantages(g, gid, estimator, eps)
    if estimator == "none":
        a = np.zeros_like(a)  # step advantages need a baseline; there is none
    return np.split(a, np.cumsum([len(m) for m in members])[:-1])


def turn_advantages(trajs: Sequence[Trajectory], traj_adv: np.ndarray, loss_cfg: LossConfig, *,
                    weight: float, process_reward: float, estimator: str = "grpo", eps: float = 1e-6):
    """``(chunk_adv, metrics)``: ``chunk_adv[i]`` is the [K_i] float64 advantage of trajectory i's chunks
    (empty for MASKED / FILTERED ones, which train nothing)."""
    traj_adv = np.asarray(traj_adv, dtype=np.float64)
    if traj_adv.shape != (len(trajs),):
        raise ValueError(f"traj_adv: shape {traj_adv.shape} does not match {len(trajs)} trajectories")
    gamma = float(loss_cfg.gamma)
    chunk_adv = [np.zeros(0, dtype=np.float64) for _ in trajs]
    returns, anchors = {}, defaultdict(list)  # anchors: key -> [(i, k)]
    n_proc, n_chunks = 0.0, 0
    for i, t in enumerate(trajs):
        if t.status is not TrajectoryStatus.OK:
            continue
        starts = chunk_starts(t)
        K = starts.size
        if K == 0:
            continue
        r = chunk_process_rewards(t, K, process_reward)
        n_proc += float(r.sum())
        n_chunks += K
        r[K - 1] += float(t.reward)
        G = np.zeros(K, dtype=np.float64)
        acc = 0.0
        for k in range(K - 1, -1, -1):
            acc = r[k] + gamma * acc
            G[k] = acc
        returns[i] = G
        for k in range(K):
            if starts[k] >= 0:
                anchors[(int(t.group_id), t.tokens[: starts[k]].tobytes())].append((i, k))
        chunk_adv[i] = traj_adv[i] * gamma ** np.arange(K - 1, -1, -1, dtype=np.float64)
    sizes, nonzero = [], 0
    for members, a in zip(anchors.values(), _anchor_advantages(anchors, returns, estimator, eps)):
        sizes.append(len(members))
        nonzero += int((a != 0).sum())
        for (i, k), v in zip(members, a):
            chunk_adv[i][k] += weight * v
    metrics = {
        "stab/turn_anchor_size_mean": float(np.mean(sizes)) if sizes else 0.0,
        "stab/turn_step_adv_nonzero_frac": nonzero / max(1, sum(sizes)),
        "stab/turn_process_reward_per_chunk": n_proc / max(1, n_chunks),
    }
    return chunk_adv, metrics


def packed_chunks(mb, j: int, t: Trajectory):
    """``(starts, present)``: trajectory ``t``'s chunk starts (``chunk_starts``) and its chunks that are
    trained in micro-batch ``mb`` as its sequence ``j`` (in order; the packer may have cut the tail)."""
    a, b = int(mb.cu_seqlens[j]), int(mb.cu_seqlens[j + 1])
    starts = chunk_starts(t)
    return starts, [k for k in range(starts.size) if 0 <= starts[k] < b - a and (mb.chunk_ids[a + starts[k]] >= 0)]


def chunk_segments(mb, trajs: Sequence[Trajectory], chunk_adv: Sequence[np.ndarray]) -> dict:
    """The micro-batch's sequences cut at every chunk start after the first, as ``policy_loss`` kwargs
    overrides: ``cu_seqlens`` [S+1] and ``advantages`` [S] (the chunk's own advantage)."""
    cu = mb.cu_seqlens.tolist()
    bounds, adv = [0], []
    for j, i in enumerate(mb.traj_indices.tolist()):
        a, b = cu[j], cu[j + 1]
        t, ca = trajs[i], chunk_adv[i]
        starts, present = packed_chunks(mb, j, t)
        if not present or ca.size == 0:  # nothing trained (MASKED, or every chunk cut off)
            bounds.append(b)
            adv.append(0.0)
            continue
        for n, k in enumerate(present):
            if n > 0:
                bounds.append(a + int(starts[k]))
            adv.append(float(ca[k]))
        bounds.append(b)
        # the first segment holds the prompt and chunk present[0]; later ones start at their chunk
    return {"cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
            "advantages": torch.tensor(adv, dtype=torch.float64)}
