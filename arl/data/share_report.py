"""What ``share_prefix`` shared in one packed step, and where it fell back to ordinary packing
(issue 38): a one-line reason for the step log and two metrics.

A sequence shares when its micro-batch's layout computes its first token once for it and another
sequence (they start in the same laid-out prefix, ``min_shared`` tokens or more).  A *fallback
group* is a group of two or more sequences none of which shares: its members are packed as
ordinary packing would (every prompt token computed once per sequence).  Its reason is the first
that applies: the group was split over micro-batches and no part shares there, or its members
share fewer than ``min_shared`` leading tokens (different system prompts or task prompts, e.g. a
rollout side that varies them).  IPA's resampled starts do not fall back: the resampled members
still share the system block and the task prompt (the radix tree shares any common part).
"""
from __future__ import annotations

import numpy as np

MAX_REASONS = 3  # reasons spelled out in the step log's line; the rest are counted


def sharing_sequences(mb) -> np.ndarray:
    """[N] bool: whether each sequence of the micro-batch starts in a prefix laid out once for it and
    another sequence."""
    n = mb.num_seqs
    if mb.tree is None or n < 2:
        return np.zeros(n, dtype=bool)
    first = mb.tree.src.numpy()[mb.cu_seqlens.numpy()[:-1].astype(np.int64)]
    _, inv, counts = np.unique(first, return_inverse=True, return_counts=True)
    return counts[inv.reshape(-1)] > 1


def _leading_common(seqs: list) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0][:n]
    for s in seqs[1:]:
        diff = np.flatnonzero(s[:n] != first[:n])
        if diff.size:
            n = int(diff[0])
    return n


def share_report(packed, min_shared: int) -> dict:
    """``{"metrics": {...}, "reasons": [one line per fallback group]}`` of a step packed with
    ``share_prefix`` (``PackedStep.share``)."""
    members: dict = {}  # group id -> [(micro-batch key, token array, shares?)]
    for mb in packed.all_micro_batches():
        if mb.is_empty:
            continue
        shares = sharing_sequences(mb)
        cu = mb.cu_seqlens.numpy()
        toks = mb.token_ids.numpy()
        for i, g in enumerate(mb.group_ids.tolist()):
            members.setdefault(g, []).append(((mb.rank, mb.index), toks[cu[i]:cu[i + 1]], bool(shares[i])))
    reasons = []
    for g, ms in sorted(members.items()):
        if len(ms) < 2 or any(s for _, _, s in ms):
            continue
        places = {k for k, _, _ in ms}
        common = _leading_common([t for _, t, _ in ms])
        if len(places) > 1 and common >= min_shared:
            why = f"split over {len(places)} micro-batches, no part shares a prefix there"
        else:
            why = f"its {len(ms)} sequences share {common} leading tokens (< min_shared {min_shared})"
        reasons.append(f"group {g}: {why}")
    groups = sum(len(ms) >= 2 for ms in members.values())
    computed = sum(packed.rank_computed_tokens)
    metrics = {"share_prefix/fallback_groups": float(len(reasons)),
               "share_prefix/groups": float(groups),
               "share_prefix/computed_frac": computed / max(packed.num_tokens, 1)}
    return {"metrics": metrics, "reasons": reasons}


def fallback_line(report: dict) -> str:
    """The step log's one line, or "" when no group fell back."""
    reasons = report["reasons"]
    if not reasons:
        return ""
    more = f"; {len(reasons) - MAX_REASONS} more" if len(reasons) > MAX_REASONS else ""
    n = int(report["metrics"]["share_prefix/groups"])
    return (f"share_prefix: {len(reasons)} of {n} groups packed without sharing: "
            + "; ".join(reasons[:MAX_REASONS]) + more)


def log_share(packed, min_shared: int, version: int) -> dict:
    """Rank 0's per-step call under ``trainer.share_prefix``: prints the fallback line (when a group
    fell back) into the step log and returns the step record's ``share_prefix/*`` metrics."""
    report = share_report(packed, min_shared)
    line = fallback_line(report)
    if line:
        print(f"arl.train: step {version}: {line}", flush=True)
    return report["metrics"]
