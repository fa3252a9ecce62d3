"""Per-step statistics of rollout trajectories, and per-turn / per-outcome token statistics.

``trajectory_metrics`` turns one step's trajectories into a flat ``{key: float}`` dict (keys below).
Which trajectories each figure is computed over -- chosen to match what the loss sees:

* behaviour (reward, success, lengths, tools, repeats): status OK only -- MASKED placeholders and
  FILTERED trajectories do not say what the policy did;
* status counts: all trajectories.

The step's advantage figures (``adv/*``) come with the advantages themselves
(arl/algo/step.py), staleness with the batch (``rollout/staleness_*``, the manager).

A figure over an empty set is 0.0 (its ``*_count`` key says the set was empty); nothing is NaN.

Keys: ``reward/{mean,std,min,max,q10,q25,q50,q75,q90,pos_frac}``, ``reward/<component>`` (a reward
function's named parts), ``env/<name>`` (the env's event counts, ``info["counts"]``, step totals),
``success/train``,
``len/{tokens,gen_tokens,turns}_{mean,max}``, ``len/{failed,success}_{count,tokens_mean,tokens_max}``,
``tools/{calls,calls_per_traj,valid_rate,repeat_rate,repeat_trajs_frac}``,
``tools/count/<name>``, ``tools/per_traj/<name>``, ``status/{ok,masked,filtered,truncated,faults}``,
``rollout/{tokens_per_s,gen_tokens_per_s}``
(with ``rollout_s``), ``time/{gen_s,tool_s}_mean`` (when the episodes recorded them).

Tool calls.  The preferred source is ``metadata["calls"]``: one record per tool-call attempt,
``{"tool": name or None, "args": dict or None, "error": bool}``.  Without it, validity comes from
the counters the episode keeps (``tool_calls`` = attempts naming a tool, ``tool_errors`` = every
malformed turn): valid = tool_calls - tool_errors, attempts = valid + tool_errors -- exact when every
malformed call names a tool, an under-estimate of validity otherwise.  Repeated calls (same tool and
same arguments a second time in one trajectory) need the arguments: from ``calls``, else by decoding
each model turn with ``tokenizer`` and reading its ``<tool_call>`` JSON; with neither, the repeat
keys are left out.  ``repeat_rate`` = repeated calls / all attempts; ``repeat_trajs_frac`` = share of
OK trajectories holding at least one repeat.  Success = reward >= ``success_threshold``; "failed" =
the other OK trajectories.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from ..data.trajectory import Trajectory, TrajectoryStatus
from ..env.toolcall import TOOL_CLOSE, TOOL_OPEN  # the turn format the environments parse

QUANTILES = (10, 25, 50, 75, 90)
_TAG_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _stats(x: Sequence[float], prefix: str, with_std: bool = False) -> dict:
    """``{prefix}mean`` and ``{prefix}max`` (and ``{prefix}std``, population) of x; 0.0 when empty."""
    a = np.asarray(x, dtype=np.float64)
    out = {f"{prefix}mean": float(a.mean()) if a.size else 0.0, f"{prefix}max": float(a.max()) if a.size else 0.0}
    if with_std:
        out[f"{prefix}std"] = float(a.std()) if a.size else 0.0
    return out


def _tag(name: Any) -> str:
    """A tool name as a metric-key segment (TensorBoard tags and file-safe)."""
    return _TAG_SAFE.sub("_", str(name)) or "_"


def _calls_from_text(t: Trajectory, tokenizer) -> list:
    """Tool-call records read back from the model's own turns (fallback when ``calls`` is absent)."""
    pattern = re.compile(re.escape(TOOL_OPEN) + "(.*?)" + re.escape(TOOL_CLOSE), re.S)
    calls = []
    for a, b in t.turns:
        text = tokenizer.decode([int(x) for x in t.tokens[a:b]], skip_special_tokens=True)
        for body in pattern.findall(text):
            try:
                obj = json.loads(body)
                calls.append({"tool": obj["name"], "args": obj["arguments"], "error": False})
            except (ValueError, KeyError, TypeError):
                calls.append({"tool": None, "args": None, "error": True})
    return calls


def _call_key(c: Mapping) -> Optional[str]:
    if c.get("tool") is None or c.get("args") is None:
        return None
    return json.dumps([c["tool"], c["args"]], sort_keys=True, default=str)


def _repeats(calls: Sequence[Mapping]) -> int:
    """Calls that repeat an earlier call of the same trajectory (same tool, same arguments)."""
    keys = [k for k in map(_call_key, calls) if k is not None]
    return len(keys) - len(set(keys))


def _tool_stats(ok: Sequence[Trajectory], tokenizer) -> dict:
    per_tool = Counter()
    valid = attempts = repeats = repeat_trajs = 0
    have_args = False
    for t in ok:
        m = t.metadata
        calls = m.get("calls")
        if calls is not None:
            calls = list(calls)
            attempts += len(calls)
            valid += sum(not c.get("error") for c in calls)
        else:
            n_err = int(m.get("tool_errors", 0))
            v = max(int(m.get("tool_calls", 0)) - n_err, 0)
            valid, attempts = valid + v, attempts + v + n_err
            if tokenizer is not None:
                calls = _calls_from_text(t, tokenizer)
        if calls is not None:
            have_args = True
            r = _repeats(calls)
            repeats, repeat_trajs = repeats + r, repeat_trajs + (r > 0)
        if "tools" in m:
            per_tool.update(m["tools"] or {})
        elif calls is not None:  # the episode counts every call that names a tool
            per_tool.update(c["tool"] for c in calls if c.get("tool") is not None)
    n = max(len(ok), 1)
    out = {"tools/calls": float(attempts), "tools/calls_per_traj": attempts / n,
           "tools/valid_rate": valid / attempts if attempts else 0.0}
    if have_args:
        out["tools/repeat_rate"] = repeats / attempts if attempts else 0.0
        out["tools/repeat_trajs_frac"] = repeat_trajs / n
    for name, c in sorted(per_tool.items()):
        out[f"tools/count/{_tag(name)}"] = float(c)
        out[f"tools/per_traj/{_tag(name)}"] = c / n
    return out


def rollout_rates(trajs: Sequence[Trajectory], rollout_s: float) -> dict:
    """``rollout/tokens_per_s`` (all tokens) and ``rollout/gen_tokens_per_s`` (model-turn tokens)
    of ``trajs`` rolled out in ``rollout_s`` seconds."""
    return {"rollout/tokens_per_s": float(sum(len(t) for t in trajs)) / rollout_s,
            "rollout/gen_tokens_per_s": float(sum(t.num_trained_tokens for t in trajs)) / rollout_s}


def success_rate(trajs: Sequence[Trajectory], success_threshold: float = 1.0) -> float:
    """Share of OK trajectories with reward >= threshold (0.0 when none): log held-out evaluation
    episodes with it as ``success/heldout``."""
    r = [t.reward for t in trajs if t.status is TrajectoryStatus.OK]
    return sum(x >= success_threshold for x in r) / len(r) if r else 0.0


def reward_components(ok: Sequence[Trajectory], reserved=()) -> dict:
    """Mean of each named reward component (a reward function's dict, in ``metadata["reward_components"]``)
    over the OK trajectories, a trajectory without it counting 0: ``reward/<name>``, or
    ``reward/fn_<name>`` when the name is one of the reward statistics (``mean``, ``q50``, ...)."""
    names = sorted({k for t in ok for k in (t.metadata.get("reward_components") or {})})
    out = {}
    for name in names:
        key = f"reward/{name}" if f"reward/{name}" not in reserved else f"reward/fn_{name}"
        out[key] = float(np.mean([float((t.metadata.get("reward_components") or {}).get(name, 0.0)) for t in ok]))
    return out


def env_counts(ok: Sequence[Trajectory]) -> dict:
    """``env/<name>``: the step's total of each event count the env reported (``info["counts"]``,
    summed per episode in ``metadata["env_counts"]``) over the OK trajectories."""
    out: dict = {}
    for t in ok:
        for k, v in (t.metadata.get("env_counts") or {}).items():
            out[f"env/{k}"] = out.get(f"env/{k}", 0.0) + float(v)
    return out


def trajectory_metrics(trajs: Sequence[Trajectory], tokenizer=None, *, success_threshold: float = 1.0,
                       rollout_s: Optional[float] = None) -> dict:
    """Statistics of one step's trajectories (see the module docstring for keys and populations).

    success_threshold: reward >= it counts as a success; rollout_s: wall seconds the rollout of
    these trajectories took (for tokens/s).
    """
    if rollout_s is not None and not (rollout_s > 0 and math.isfinite(rollout_s)):
        raise ValueError(f"trajectory_metrics: rollout_s must be a positive finite number, got {rollout_s}")
    for i, t in enumerate(trajs):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectory_metrics: trajs[{i}] is a {type(t).__name__}, not a Trajectory")
    status = Counter(t.status for t in trajs)
    ok = [t for t in trajs if t.status is TrajectoryStatus.OK]
    out: dict = {"status/ok": float(status[TrajectoryStatus.OK]), "status/masked": float(status[TrajectoryStatus.MASKED]),
                 "status/filtered": float(status[TrajectoryStatus.FILTERED]),
                 "status/truncated": float(sum(bool(t.metadata.get("truncated")) for t in ok)),
                 "status/faults": float(sum(t.metadata.get("fault", "none") not in ("none", None) for t in trajs))}

    r = np.array([t.reward for t in ok], dtype=np.float64)
    out.update(_stats(r, "reward/", with_std=True))
    out["reward/min"] = float(r.min()) if r.size else 0.0
    for q in QUANTILES:
        out[f"reward/q{q}"] = float(np.percentile(r, q)) if r.size else 0.0
    out["reward/pos_frac"] = float((r > 0).mean()) if r.size else 0.0
    out.update(reward_components(ok, reserved=out))
    out.update(env_counts(ok))
    succ = r >= success_threshold
    out["success/train"] = float(succ.mean()) if r.size else 0.0

    lens = np.array([len(t) for t in ok], dtype=np.float64)
    out.update(_stats(lens, "len/tokens_"))
    out.update(_stats([t.num_trained_tokens for t in ok], "len/gen_tokens_"))
    out.update(_stats([len(t.turns) for t in ok], "len/turns_"))
    for name, sel in (("failed", ~succ), ("success", succ)):
        out[f"len/{name}_count"] = float(sel.sum())
        out.update(_stats(lens[sel], f"len/{name}_tokens_"))

    out.update(_tool_stats(ok, tokenizer))

    if rollout_s is not None:
        out.update(rollout_rates(trajs, rollout_s))
    for k in ("gen_s", "tool_s"):
        v = [float(t.metadata[k]) for t in ok if k in t.metadata]
        if v:
            out[f"time/{k}_mean"] = float(np.mean(v))
    return out


# ------------------------------------------------------------------ token-level helpers
def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _turn_index(chunk_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple:
    """(trained-token positions, their turn index within their sequence, their sequence index) for a
    packed micro-batch; turn k = the k-th non-empty model turn (the packer's dense chunk ids)."""
    cid = chunk_ids.reshape(-1).long()
    cu = cu_seqlens.reshape(-1).long()
    if cu.numel() == 0 or int(cu[-1]) != cid.numel():
        raise ValueError(f"cu_seqlens: ends at {int(cu[-1]) if cu.numel() else None}, chunk_ids has {cid.numel()} tokens")
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    tidx = torch.nonzero(cid >= 0).reshape(-1)
    c, s = cid[tidx], seq[tidx]
    first = torch.full((cu.numel() - 1,), torch.iinfo(torch.int64).max, dtype=torch.int64)
    first = first.scatter_reduce(0, s, c, "amin")
    return tidx, c - first[s], s


def per_turn_sums(values, chunk_ids, cu_seqlens, num_turns: Optional[int] = None) -> tuple:
    """Sum and token count of ``values`` (e.g. per-token entropy) per turn index, over one or more
    packed micro-batches (tensors or lists of tensors, one per micro-batch).  Returns two float64
    tensors ``[K]`` -- all-reduce them across ranks, then divide (or call ``per_turn_mean``)."""
    vals, cids, cus = _as_list(values), _as_list(chunk_ids), _as_list(cu_seqlens)
    if not len(vals) == len(cids) == len(cus):
        raise ValueError(f"per_turn_sums: {len(vals)} values, {len(cids)} chunk_ids, {len(cus)} cu_seqlens (one per micro-batch)")
    parts = []
    for i, (v, c, cu) in enumerate(zip(vals, cids, cus)):
        v = v.detach().reshape(-1).to("cpu", torch.float64)
        if v.numel() != c.numel():
            raise ValueError(f"per_turn_sums: micro-batch {i}: {v.numel()} values but {c.numel()} chunk_ids")
        tidx, turn, _ = _turn_index(c.cpu(), cu.cpu())
        parts.append((v[tidx], turn))
    K = max([int(t.max()) + 1 for _, t in parts if t.numel()] + [num_turns or 0])
    sums, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for v, t in parts:
        keep = t < K
        sums.index_add_(0, t[keep], v[keep])
        counts.index_add_(0, t[keep], torch.ones_like(v[keep]))
    if not torch.isfinite(sums).all():
        raise ValueError("per_turn_sums: values hold a non-finite number on a trained token")
    return sums, counts


def turn_means(sums: torch.Tensor, counts: torch.Tensor, prefix: str = "entropy/turn_") -> dict:
    """``{f"{prefix}{k}": sums[k] / counts[k]}`` for the turns that have tokens."""
    return {f"{prefix}{k}": float(sums[k] / counts[k]) for k in range(sums.numel()) if counts[k] > 0}


def per_turn_mean(values, chunk_ids, cu_seqlens, prefix: str = "entropy/turn_") -> dict:
    """Mean of ``values`` over the trained tokens of each turn index k (single process; across ranks,
    all-reduce ``per_turn_sums`` and call ``turn_means``)."""
    return turn_means(*per_turn_sums(values, chunk_ids, cu_seqlens), prefix=prefix)


def success_logprob_sums(logps, chunk_ids, cu_seqlens, success) -> tuple:
    """(sum, count) of per-token logprobs over the trained tokens of successful sequences; ``success``
    is a bool per sequence of each micro-batch (e.g. ``rewards[mb.traj_indices] >= threshold``)."""
    total, count = 0.0, 0
    vals, cids, cus, succ = _as_list(logps), _as_list(chunk_ids), _as_list(cu_seqlens), _as_list(success)
    if not len(vals) == len(cids) == len(cus) == len(succ):
        raise ValueError(f"success_logprob_sums: {len(vals)} logps, {len(cids)} chunk_ids, {len(cus)} cu_seqlens, "
                         f"{len(succ)} success (one per micro-batch)")
    for i, (v, c, cu, ok) in enumerate(zip(vals, cids, cus, succ)):
        v = v.detach().reshape(-1).to("cpu", torch.float64)
        ok = torch.as_tensor(ok, dtype=torch.bool).reshape(-1).cpu()
        if v.numel() != c.numel() or ok.numel() != cu.numel() - 1:
            raise ValueError(f"success_logprob_sums: micro-batch {i}: {v.numel()} logps, {c.numel()} chunk_ids, "
                             f"{ok.numel()} success flags for {cu.numel() - 1} sequences")
        tidx, _, seq = _turn_index(c.cpu(), cu.cpu())
        sel = v[tidx][ok[seq]]
        if not torch.isfinite(sel).all():
            raise ValueError(f"success_logprob_sums: micro-batch {i}: non-finite logprob on a trained token")
        total, count = total + float(sel.sum()), count + int(sel.numel())
    return total, count


def success_logprob_mean(logps, chunk_ids, cu_seqlens, success, key: str = "logp/success_mean") -> dict:
    """``{key: mean logprob per trained token of successful sequences}``; ``{}`` when there are none."""
    total, count = success_logprob_sums(logps, chunk_ids, cu_seqlens, success)
    return {key: total / count} if count else {}
