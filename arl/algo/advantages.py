"""Advantage estimators: one function each, registered by name, chosen by ``algo.advantage``.

Every estimator runs once per step, before packing, in float64; the loss kernels receive the
advantages it returns, or, with ``loss.advantages_in_pass``, the step's group table and compute
grpo, dr_grpo or rloo in the pass with these functions' operations (arl/ops/policy_loss/group_adv.py,
tested against them bit for bit).  Two kinds:

* ``group``: ``fn(rewards [N], groups [N], eps) -> advantages [N]``, rewards of the step's
  trajectories and their dense group index 0..G-1.  The registry wraps it with the one rule every
  baseline shares: a group whose rewards are all equal (a group of one included) gets exactly 0.
  Turn credit (arl/algo/turn_credit.py) runs the same estimator over each anchor group's
  chunk returns.
* ``critic``: GAE over a value baseline (``gae`` below); the values come from the trainer's
  forward, so the step gives chunk rewards and the critic objective calls ``gae`` per micro-batch.

The registry's table (``ESTIMATORS``) lives in arl/config/algo.py, so a config names an estimator
without importing this package; ``register_estimator`` fills it.

Adding one: a function and a ``@register_estimator("name")`` line; the config accepts the name.
"""
from __future__ import annotations

from typing import Callable, Literal

import numpy as np
import torch

from ..config.algo import ESTIMATORS, Estimator, get_estimator  # noqa: F401 (the registry's API)


def register_estimator(name: str, *, kind: Literal["group", "critic"] = "group", baseline: bool = True):
    def deco(fn: Callable) -> Callable:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        ESTIMATORS[name] = Estimator(name, fn, kind, baseline, doc)
        return fn

    return deco


def _group_stats(r: np.ndarray, g: np.ndarray):
    G = int(g.max()) + 1 if g.size else 0
    cnt = np.bincount(g, minlength=G).astype(np.float64)
    mean = np.bincount(g, weights=r, minlength=G) / np.maximum(cnt, 1.0)
    return cnt, mean


@register_estimator("grpo")
def grpo(r: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """(R - group mean) / (group std + eps), std with Bessel's correction (GRPO)."""
    cnt, mean = _group_stats(r, g)
    d = r - mean[g]
    std = np.sqrt(np.bincount(g, weights=d * d, minlength=cnt.size) / np.maximum(cnt - 1.0, 1.0))
    return d / (std[g] + eps)


@register_estimator("dr_grpo")
def dr_grpo(r: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """R - group mean: no std division (Dr. GRPO, arXiv 2503.20783)."""
    _, mean = _group_stats(r, g)
    return r - mean[g]


@register_estimator("rloo")
def rloo(r: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """R - mean of the group's other samples (REINFORCE leave-one-out, arXiv 2402.14740)."""
    cnt, _ = _group_stats(r, g)
    total = np.bincount(g, weights=r, minlength=cnt.size)
    n = cnt[g]
    return r - (total[g] - r) / np.maximum(n - 1.0, 1.0)


@register_estimator("none", baseline=False)
def raw_reward(r: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """R itself: no baseline (REINFORCE)."""
    return r.copy()


def group_advantages(rewards, group_ids, estimator: str = "grpo", eps: float = 1e-6):
    """``(advantages [N] float64, zero-variance groups, groups)`` of a group estimator.  ``rewards`` and
    ``group_ids`` are [N] array-likes or tensors; group ids may be any integers."""
    est = get_estimator(estimator)
    if est.kind != "group":
        raise ValueError(f"algo.advantage: {estimator!r} is a {est.kind} estimator, not a group one")
    r = np.asarray(rewards.detach().cpu() if isinstance(rewards, torch.Tensor) else rewards, dtype=np.float64)
    gid = np.asarray(group_ids.detach().cpu() if isinstance(group_ids, torch.Tensor) else group_ids)
    if r.ndim != 1 or gid.shape != r.shape:
        raise ValueError(f"group_advantages: rewards {r.shape} and group_ids {gid.shape} must be equal 1-D shapes")
    if not np.isfinite(r).all():
        i = int(np.flatnonzero(~np.isfinite(r))[0])
        raise ValueError(f"rewards: non-finite value {r[i]} at index {i}")
    if r.size == 0:
        return r.copy(), 0, 0
    _, g = np.unique(gid, return_inverse=True)
    g = g.reshape(-1).astype(np.int64)
    G = int(g.max()) + 1
    rmax = np.full(G, -np.inf)
    np.maximum.at(rmax, g, r)
    rmin = np.full(G, np.inf)
    np.minimum.at(rmin, g, r)
    zero_var = rmax == rmin
    adv = np.asarray(est.fn(r, g, float(eps)), dtype=np.float64)
    if est.baseline:
        adv = np.where(zero_var[g], 0.0, adv)
    return adv, int(zero_var.sum()), G


@register_estimator("gae", kind="critic")
def gae(values: torch.Tensor, rewards: torch.Tensor, seq: torch.Tensor, gamma: float, lam: float):
    """GAE over chunks with a learned value baseline (the critic; arl/algo/critic.py).

    ``(advantages, returns)`` [P] float64 (CPU) of P chunks laid out sequence after sequence, each
    sequence's chunks in order: ``values`` [P] V_k, ``rewards`` [P] r_k, ``seq`` [P] the sequence of
    each chunk (equal ids contiguous).  delta_k = r_k + gamma V_{k+1} - V_k with V = 0 after a
    sequence's last chunk; A_k = sum_l (gamma lam)^l delta_{k+l}; returns G_k = A_k + V_k."""
    v = values.detach().to("cpu", torch.float64).tolist()
    r = rewards.to("cpu", torch.float64).tolist()
    s = seq.tolist()
    P = len(v)
    if not (len(r) == len(s) == P):
        raise ValueError(f"gae: values ({P}), rewards ({len(r)}) and seq ({len(s)}) must have one entry per chunk")
    adv = [0.0] * P
    acc = nxt = 0.0
    for p in range(P - 1, -1, -1):
        if p == P - 1 or s[p + 1] != s[p]:
            acc = nxt = 0.0  # the sequence's last chunk: the episode ends after it
        delta = r[p] + gamma * nxt - v[p]
        acc = delta + gamma * lam * acc
        adv[p], nxt = acc, v[p]
    a = torch.tensor(adv, dtype=torch.float64)
    return a, a + torch.tensor(v, dtype=torch.float64)
