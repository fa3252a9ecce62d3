"""An independent, loop-by-loop Python implementation of the policy loss (plain floats, the math
module, and the definitions at the top of arl/ops/policy_loss/spec.py).  Tests check the vectorized
reference against it, so the spec is written down twice, differently.  ``scalar_group_advantages`` is
the same for the group estimators of arl/algo/advantages.py (grpo, dr_grpo, none)."""
from __future__ import annotations

import math
import sys


def _segments(chunk, cu):
    """[(seq, [token indices])] of chunks, and per-sequence lists of trained tokens."""
    chunks, seq_tokens = [], []
    for s in range(len(cu) - 1):
        toks = [t for t in range(cu[s], cu[s + 1]) if chunk[t] >= 0]
        seq_tokens.append(toks)
        for t in toks:
            if chunks and chunks[-1][0] == s and chunk[chunks[-1][1][-1]] == chunk[t]:
                chunks[-1][1].append(t)
            else:
                chunks.append((s, [t]))
    return chunks, seq_tokens


def scalar_group_advantages(rewards, groups, estimator="grpo", eps=1e-6):
    """Per-trajectory advantages (a list) and {group: [rewards]}, with plain floats: ``grpo``
    (R - mean) / (std + eps) with Bessel's std, ``dr_grpo`` R - mean, ``none`` R; a group whose
    rewards all agree gets 0 under grpo and dr_grpo."""
    gvals = {}
    for i, g in enumerate(groups):
        gvals.setdefault(g, []).append(rewards[i])
    adv = []
    for i, g in enumerate(groups):
        vals = gvals[g]
        if estimator == "none":
            adv.append(rewards[i])
            continue
        if max(vals) == min(vals):
            adv.append(0.0)
            continue
        mean = sum(vals) / len(vals)
        a = rewards[i] - mean
        if estimator == "grpo":
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1))
            a = a / (std + eps)
        adv.append(a)
    return adv, gvals


def scalar_policy_loss(logp, old, adv, cu, chunk, cfg, rollout=None, ref=None, entropy=None,
                       normalizer=None):
    """Returns (loss, dloss/dlogp list, metrics dict) computed with Python floats; ``adv`` the
    per-trajectory advantages."""
    T = len(logp)
    chunks, seq_tokens = _segments(chunk, cu)
    clampc = cfg.log_ratio_clamp
    cl = (lambda x: max(-clampc, min(clampc, x))) if clampc is not None else (lambda x: x)

    flush = lambda x: 0.0 if abs(x) < sys.float_info.min else x  # noqa: E731 - the spec's underflow rule
    A = [0.0] * T
    chunk_of = {}
    for ci, (s, toks) in enumerate(chunks):
        n_after = sum(1 for (s2, _) in chunks[ci + 1:] if s2 == s)
        for t in toks:
            A[t] = adv[s] if cfg.gamma == 1 else flush(adv[s] * flush(cfg.gamma ** n_after))
            if cfg.positive_only:
                A[t] = max(A[t], 0.0)
            chunk_of[t] = ci

    def segment(level, t):
        if level == "token":
            return [t]
        if level == "chunk":
            return chunks[chunk_of[t]][1]
        s = next(s for s in range(len(cu) - 1) if cu[s] <= t < cu[s + 1])
        return seq_tokens[s]

    trained = [t for t in range(T) if chunk[t] >= 0]
    grad = [0.0] * T
    n_s = [len(x) for x in seq_tokens]
    S = sum(1 for n in n_s if n > 0)
    if cfg.loss_agg == "token-mean":
        D = len(trained)
    elif cfg.loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        D = S
    else:
        D = S * (cfg.agg_constant if cfg.agg_constant is not None else max(n_s))
    if normalizer is not None:
        D = normalizer
    seq_of = {t: s for s in range(len(cu) - 1) for t in range(cu[s], cu[s + 1])}

    total = 0.0
    m = dict(clip=0, dual=0, altered=0, kept=0, ratio_sum=0.0, ratio_max=-1.0, adv_nz=0, pg=0.0, kl=0.0, ent=0.0, akl=0.0)
    for t in trained:
        seg = segment(cfg.ratio_level, t)
        raw = sum(logp[u] - old[u] for u in seg) / len(seg)
        lr = cl(raw)
        lr_active = clampc is None or -clampc <= raw <= clampc  # clamp passes gradient inside (inclusive)
        r = math.exp(lr)
        a = A[t]
        if cfg.mismatch_level == "none":
            w, altered = 1.0, False
        else:
            mseg = segment(cfg.mismatch_level, t)
            mm = math.exp(cl(sum(old[u] - rollout[u] for u in mseg) / len(mseg)))
            if cfg.mismatch_mode == "mask":
                keep = cfg.mismatch_low <= mm <= cfg.mismatch_high
                w, altered = (1.0 if keep else 0.0), not keep
            else:
                w, altered = min(mm, cfg.mismatch_high), mm > cfg.mismatch_high
        coef = 1.0 / n_s[seq_of[t]] if cfg.loss_agg == "seq-mean-token-mean" else 1.0
        scale = coef / D
        if cfg.surrogate == "ppo_clip":
            pg1 = -a * r
            rc = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            pg2 = -a * rc
            clipped = pg2 > pg1
            pg = pg2 if clipped else pg1
            # d pg / d lr: unclipped branch -a*r; clipped branch -a*r only inside the clip range
            dpg = (-a * r if (1 - cfg.clip_low) <= r <= (1 + cfg.clip_high) else 0.0) if clipped else -a * r
            dual = False
            if cfg.dual_clip is not None and a < 0 and pg > -a * cfg.dual_clip:
                pg, dpg, dual = -a * cfg.dual_clip, 0.0, True
            dpg = dpg if lr_active else 0.0
            for u in seg:  # lr is the mean over the segment
                grad[u] += scale * w * dpg / len(seg)
        elif cfg.surrogate == "cispo":  # the clipped ratio is a constant weight: every token keeps its gradient
            v = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            pg = -v * a * logp[t]
            grad[t] += scale * w * (-v * a)
            clipped, dual = v != r, False
        else:
            v = 1.0 if a >= 0 else min(r, 1.0)
            pg = -a * v * logp[t]
            grad[t] += scale * w * (-a * v)
            clipped, dual = (a < 0 and r > 1), False
        tok = w * pg
        if cfg.kl_beta > 0:
            if cfg.kl_estimator == "k1":
                kl, dkl = logp[t] - ref[t], 1.0
            elif cfg.kl_estimator == "k2":
                kl, dkl = 0.5 * (logp[t] - ref[t]) ** 2, logp[t] - ref[t]
            else:
                xr = ref[t] - logp[t]
                x = cl(xr)
                kl = math.exp(x) - x - 1
                dkl = -(math.exp(x) - 1) if (clampc is None or -clampc <= xr <= clampc) else 0.0
            tok += cfg.kl_beta * kl
            grad[t] += scale * cfg.kl_beta * dkl
            m["kl"] += kl
        if entropy is not None:
            m["ent"] += entropy[t]
            tok -= cfg.entropy_coef * entropy[t]
        total += scale * tok
        dt = cl(logp[t] - old[t])
        m["akl"] += math.exp(dt) - 1 - dt
        m["clip"] += clipped
        m["dual"] += dual
        m["altered"] += altered
        m["kept"] += w > 0
        m["ratio_sum"] += r
        m["ratio_max"] = max(m["ratio_max"], r)
        m["adv_nz"] += a != 0
        m["pg"] += w * pg
    n = max(len(trained), 1)
    metrics = {
        "clip_frac": m["clip"] / n, "dual_clip_frac": m["dual"] / n, "mismatch_masked_frac": m["altered"] / n,
        "approx_kl": m["akl"] / n, "ratio_mean": m["ratio_sum"] / n,
        "ratio_max": m["ratio_max"] if trained else 0.0, "adv_nonzero_frac": m["adv_nz"] / n,
        "tokens_kept": float(m["kept"]), "pg_loss": m["pg"] / n,
        "kl_mean": m["kl"] / n, "entropy_mean": m["ent"] / n if entropy is not None else 0.0,
    }
    return total, grad, metrics
