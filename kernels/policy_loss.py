"""Fused policy loss in Triton: one launch computes loss, metrics, dL/dlogp and dL/dentropy.

The math is ``arl/loss/reference.py`` (the spec); this module only changes *how* it is computed.

Design (one program per packed sequence, tokens walked in blocks of ``BLOCK``):

* Group advantage, in the same program: the program loads all N rewards/group ids in blocks of
  ``BLOCK_N`` and reduces its own group's count, sum, min, max (then the squared deviations), so no
  pre-pass launch and no host sync is needed.  O(N) per program, O(N^2) in all: fine for RL batches
  (N up to a few thousand); beyond that a per-group pre-pass kernel would be the better shape.
* Pass 1 (only when a segment statistic is needed): a forward walk that builds a per-chunk table
  for the sequence in the sequence's own slice ``[cu[s], cu[s+1])`` of T-sized scratch buffers (a
  sequence has at most as many chunks as tokens).  Chunk starts are found without a segmented
  scan: trained tokens are compacted by rank (``cumsum`` of the trained mask) into ``comp``, so the
  previous *trained* token's chunk id is one gather away (untrained tokens inside a chunk do not
  split it).  At every chunk start the table receives the exclusive prefix sums (fp64) of
  d = logp - old_logp, of the mismatch quantity q, and of the trained count; a chunk's sum is then
  the difference of two neighbouring table entries (the last one is the sequence total kept in
  registers).  Prefix sums are fp64 so that differencing them costs no fp32 accuracy.
* Sequence-level PPO couples every token of a sequence through one ratio; its gradient factor
  sum_t w_t * dpg_t/dr is reduced over the chunk table (chunks share A and the clip decision) before
  pass 2, so that pass 2 can write final gradients.
* Pass 2: a forward walk that recomputes ranks from ``comp``, reads its chunk's statistics from the
  table, and evaluates ratio, mismatch weight, discounted advantage, surrogate, KL and entropy for
  every token; it writes dL/dlogp and dL/dentropy *before* division by the aggregation denominator
  D (D needs global counts: it is applied as one scalar in backward) and accumulates the metric
  partials of the program in fp64; the host side sums the [N, 16] partials (deterministic).
* Token-level configs without discount, sequence statistics or per-sequence coefficients skip
  pass 1 entirely (a single streaming pass: the GRPO/DAPO case).

Only ``tl.cumsum`` and plain reductions are used (no custom-combine scans): they are fast under
``TRITON_INTERPRET=1`` (custom combines fall back to a per-element Python loop there).  Stores to
scratch are followed by ``tl.debug_barrier()`` before other threads of the program read them
(GPU risk: this relies on bar.sync ordering global memory within a CTA, which CUDA guarantees).

GPU-only risks (not testable on the CPU machine this was written on): the compiled path relies on
constexpr-if scoping, fp64 tl.exp/exp2 (fp64 inputs only) and ``tl.debug_barrier`` ordering of
global-memory stores within a program; BLOCK=1024 / 4 warps is a guess to tune on the device.

Dtypes: fp32 and bf16 logp compute in fp32, fp64 logp in fp64 (gradcheck); prefix sums and
metric partials are fp64 in both cases.  Scalar options travel in a small tensor of the compute
dtype, so fp64 runs see the options in fp64 as the reference does.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

NPART = 16  # metric partials per program, columns in the order of _PARTS
_PARTS = ("loss", "ntok", "clip", "dual", "altered", "approx_kl", "ratio_sum", "ratio_max", "adv_nonzero",
          "kept", "pg", "kl", "ent", "first", "zero_var")
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_RATIO = {"token": 0, "sequence": 1, "chunk": 2}
_MIS = {"none": 0, "token": 1, "sequence": 2, "chunk": 3}
_ADV = {"group_std": 0, "group_mean": 1, "none": 2}
_AGG = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3}
_KL = {"k1": 1, "k2": 2, "k3": 3}


# Reductions go through tl.reduce / tl.associative_scan with the standard combine functions: the
# same code as tl.sum / tl.cumsum / tl.max once compiled, but builtins under the interpreter,
# where every call of a jitted function (tl.sum is one) costs ~10 ms of re-patching and which has
# fast numpy paths for exactly these combine functions.
_ADD = getattr(tl.standard, "_sum_combine", None)
_MAXF = getattr(tl.standard, "_elementwise_max", None)
_MINF = getattr(tl.standard, "_elementwise_min", None)
if _ADD is None or _MAXF is None or _MINF is None:  # pragma: no cover - other Triton versions

    @triton.jit
    def _ADD(a, b):
        return a + b

    @triton.jit
    def _MAXF(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _MINF(a, b):
        return tl.minimum(a, b)



@triton.jit
def _policy_loss_kernel(
    logp_ptr, old_ptr, roll_ptr, ref_ptr, ent_ptr, cid_ptr, cu_ptr, rew_ptr, gid_ptr, par_ptr,
    glogp_ptr, gent_ptr, part_ptr, comp_ptr, sd_ptr, sq_ptr, sk_ptr, N,
    CDT: tl.constexpr, RATIO: tl.constexpr, SURR: tl.constexpr, DUAL: tl.constexpr, ADV: tl.constexpr,
    POS_ONLY: tl.constexpr, USE_GAMMA: tl.constexpr, MIS: tl.constexpr, TRUNC: tl.constexpr, KL: tl.constexpr,
    HAS_ENT: tl.constexpr, ENT_GRAD: tl.constexpr, AGG: tl.constexpr,
    NEED_PASS1: tl.constexpr, NEED_RANK: tl.constexpr, STORE_Q: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NPART_C: tl.constexpr,
):
    # Small helpers are written inline: under the interpreter every call of a jitted helper
    # re-patches the language module (~1 ms), which dominated the run time.
    # lrc = log_ratio_clamp, +inf when off (clamping to +-inf is the identity on finite values).
    s = tl.program_id(0)
    start = tl.load(cu_ptr + s)
    L = tl.load(cu_ptr + s + 1) - start
    clip_lo = tl.load(par_ptr + 0)  # 1 - clip_low
    clip_hi = tl.load(par_ptr + 1)  # 1 + clip_high
    dual_c = tl.load(par_ptr + 2)
    adv_eps = tl.load(par_ptr + 3)
    log2_gamma = tl.load(par_ptr + 4)
    m_lo = tl.load(par_ptr + 5)
    m_hi = tl.load(par_ptr + 6)
    kl_beta = tl.load(par_ptr + 7)
    ent_coef = tl.load(par_ptr + 8)
    lrc = tl.load(par_ptr + 9)

    # group advantage of sequence s (zero-variance groups -> exactly 0), whether its group has zero
    # variance, and whether s is its group's first member (to count groups for the metric)
    gid_s = tl.load(gid_ptr + s)
    rew_s = tl.load(rew_ptr + s).to(CDT)
    cnt = tl.full([], 0.0, CDT)
    tot = tl.full([], 0.0, CDT)
    rmax_g = tl.full([], float("-inf"), CDT)
    rmin_g = tl.full([], float("inf"), CDT)
    earlier = tl.full([], 0, tl.int32)
    for j0 in range(0, N, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        ok = j < N
        eq = ok & (tl.load(gid_ptr + j, mask=ok, other=0) == gid_s)
        rj = tl.load(rew_ptr + j, mask=ok, other=0).to(CDT)
        cnt += tl.reduce(eq.to(CDT), 0, _ADD)
        tot += tl.reduce(tl.where(eq, rj, 0.0), 0, _ADD)
        rmax_g = tl.maximum(rmax_g, tl.reduce(tl.where(eq, rj, float("-inf")), 0, _MAXF))
        rmin_g = tl.minimum(rmin_g, tl.reduce(tl.where(eq, rj, float("inf")), 0, _MINF))
        earlier += tl.reduce((eq & (j < s)).to(tl.int32), 0, _ADD)
    zero_var = rmax_g == rmin_g
    adv_s = rew_s
    if ADV != 2:
        mean = tot / cnt
        adv_s = rew_s - mean
        if ADV == 0:
            ss = tl.full([], 0.0, CDT)
            for j0 in range(0, N, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                ok = j < N
                eq = ok & (tl.load(gid_ptr + j, mask=ok, other=0) == gid_s)
                dj = tl.load(rew_ptr + j, mask=ok, other=0).to(CDT) - mean
                ss += tl.reduce(tl.where(eq, dj * dj, 0.0), 0, _ADD)
            std = tl.sqrt(ss / tl.maximum(cnt - 1, 1.0))
            adv_s = adv_s / (std + adv_eps)
        adv_s = tl.where(zero_var, 0.0, adv_s)
    first = earlier == 0
    if POS_ONLY:
        adv_pos = tl.maximum(adv_s, 0.0)
    else:
        adv_pos = adv_s
    ar = tl.arange(0, BLOCK)

    # ---- pass 1: sequence totals and the per-chunk prefix table --------------------------------
    n_s = tl.full([], 0, tl.int32)
    nch = tl.full([], 0, tl.int32)
    tot_d = tl.full([], 0.0, tl.float64)
    tot_q = tl.full([], 0.0, tl.float64)
    if NEED_PASS1:
        for b0 in range(0, L, BLOCK):
            offs = start + b0 + ar
            cid = tl.load(cid_ptr + offs, mask=b0 + ar < L, other=-1)
            tr = cid >= 0
            tri = tr.to(tl.int32)
            old = tl.load(old_ptr + offs, mask=tr, other=0).to(CDT)
            dd = (tl.load(logp_ptr + offs, mask=tr, other=0).to(CDT) - old).to(tl.float64)
            if MIS != 0:
                mq = old - tl.load(roll_ptr + offs, mask=tr, other=0).to(CDT)
                if MIS == 1:  # the token weight itself: chunk/sequence ratios need its sums
                    mt = tl.exp(tl.minimum(tl.maximum(mq, -lrc), lrc))
                    if TRUNC:
                        mq = tl.minimum(mt, m_hi)
                    else:
                        mq = ((mt >= m_lo) & (mt <= m_hi)).to(CDT)
                qq = tl.where(tr, mq, 0.0).to(tl.float64)
            else:
                qq = dd * 0
            if NEED_RANK:
                K = n_s + tl.associative_scan(tri, 0, _ADD)  # 1-based rank among the sequence's trained tokens
                tl.store(comp_ptr + start + K - 1, cid, mask=tr)
                tl.debug_barrier()
                prev = tl.load(comp_ptr + start + K - 2, mask=tr & (K >= 2), other=-1)
                st = tr & (cid != prev)  # chunk start: previous trained token has another id
                R = nch + tl.associative_scan(st.to(tl.int32), 0, _ADD)  # 1-based chunk index
                slot = start + R - 1
                tl.store(sd_ptr + slot, tot_d + tl.associative_scan(dd, 0, _ADD) - dd, mask=st)
                tl.store(sk_ptr + slot, K - 1, mask=st)
                if STORE_Q:
                    tl.store(sq_ptr + slot, tot_q + tl.associative_scan(qq, 0, _ADD) - qq, mask=st)
                nch += tl.reduce(st.to(tl.int32), 0, _ADD)
            n_s += tl.reduce(tri, 0, _ADD)
            tot_d += tl.reduce(dd, 0, _ADD)
            tot_q += tl.reduce(qq, 0, _ADD)
        tl.debug_barrier()
    n_safe = tl.maximum(n_s, 1).to(tl.float64)
    mean_d_seq = (tot_d / n_safe).to(CDT)
    mean_q_seq = (tot_q / n_safe).to(CDT)
    n_s_c = tl.maximum(n_s, 1).to(CDT)

    # ---- sequence-level PPO: sum_t w_t * dpg_t/dr, reduced over the chunk table ------------------
    seq_gfac = tl.full([], 0.0, CDT)
    if RATIO == 1:
        if SURR == 0:
            x_seq = tl.minimum(tl.maximum(mean_d_seq, -lrc), lrc)
            r_seq = tl.exp(x_seq)
            r_seq_clip = tl.minimum(tl.maximum(r_seq, clip_lo), clip_hi)
            w_seq = tl.full([], 1.0, CDT)
            if MIS == 2:
                ms = tl.exp(tl.minimum(tl.maximum(mean_q_seq, -lrc), lrc))
                if TRUNC:
                    w_seq = tl.minimum(ms, m_hi)
                else:
                    w_seq = ((ms >= m_lo) & (ms <= m_hi)).to(CDT)
            if NEED_RANK:
                acc = tl.full([], 0.0, tl.float64)
                for c0 in range(0, nch, BLOCK):
                    ci = c0 + ar
                    cv = ci < nch
                    nxt = cv & (ci + 1 < nch)
                    lo_k = tl.load(sk_ptr + start + ci, mask=cv, other=0)
                    n_c = (tl.where(nxt, tl.load(sk_ptr + start + ci + 1, mask=nxt, other=0), n_s) - lo_k).to(tl.float64)
                    if MIS == 1 or MIS == 3:
                        lo_q = tl.load(sq_ptr + start + ci, mask=cv, other=0)
                        W = tl.where(nxt, tl.load(sq_ptr + start + ci + 1, mask=nxt, other=0), tot_q) - lo_q
                        if MIS == 3:  # W = w_c * n_c with w_c from the chunk's mean of old - rollout
                            mc = tl.exp(tl.minimum(tl.maximum((W / tl.maximum(n_c, 1.0)).to(CDT), -lrc), lrc))
                            if TRUNC:
                                W = tl.minimum(mc, m_hi).to(tl.float64) * n_c
                            else:
                                W = ((mc >= m_lo) & (mc <= m_hi)).to(tl.float64) * n_c
                    else:
                        W = w_seq.to(tl.float64) * n_c
                    A_c = adv_s * tl.exp2((nch - ci - 1).to(CDT) * log2_gamma)
                    if POS_ONLY:
                        A_c = tl.maximum(A_c, 0.0)
                    sp1 = -A_c * r_seq
                    sp2 = -A_c * r_seq_clip
                    clp = sp2 > sp1
                    keep = cv & (clp == 0)
                    if DUAL:
                        keep = keep & ~((A_c < 0) & (tl.where(clp, sp2, sp1) > -A_c * dual_c))
                    acc += tl.reduce(tl.where(keep, (-A_c).to(tl.float64) * W, 0.0), 0, _ADD)
                seq_gfac = acc.to(CDT)
            else:  # gamma == 1: one advantage for the whole sequence
                if MIS == 1:
                    W1 = tot_q.to(CDT)
                else:
                    W1 = w_seq * n_s.to(CDT)
                sp1 = -adv_pos * r_seq
                sp2 = -adv_pos * r_seq_clip
                clp = sp2 > sp1
                keep = clp == 0
                if DUAL:
                    keep = keep & ~((adv_pos < 0) & (tl.where(clp, sp2, sp1) > -adv_pos * dual_c))
                seq_gfac = tl.where(keep, -adv_pos * W1, 0.0)
            # d r_seq / d logp_j = r * 1[inside the clamp] / n_s for every trained token j
            seq_gfac = seq_gfac * r_seq * ((mean_d_seq >= -lrc) & (mean_d_seq <= lrc)).to(CDT) / n_s_c

    # ---- pass 2: per-token loss, gradients and metric partials ----------------------------------
    K2 = tl.full([], 0, tl.int32)
    R2 = tl.full([], 0, tl.int32)
    acc_loss = tl.full([], 0.0, tl.float64)
    acc_ntok = tl.full([], 0.0, tl.float64)
    acc_clip = tl.full([], 0.0, tl.float64)
    acc_dual = tl.full([], 0.0, tl.float64)
    acc_alt = tl.full([], 0.0, tl.float64)
    acc_akl = tl.full([], 0.0, tl.float64)
    acc_rsum = tl.full([], 0.0, tl.float64)
    acc_rmax = tl.full([], float("-inf"), tl.float64)
    acc_anz = tl.full([], 0.0, tl.float64)
    acc_kept = tl.full([], 0.0, tl.float64)
    acc_pg = tl.full([], 0.0, tl.float64)
    acc_kl = tl.full([], 0.0, tl.float64)
    acc_ent = tl.full([], 0.0, tl.float64)
    for b0 in range(0, L, BLOCK):
        inb = b0 + ar < L
        offs = start + b0 + ar
        cid = tl.load(cid_ptr + offs, mask=inb, other=-1)
        tr = cid >= 0
        tri = tr.to(tl.int32)
        lp = tl.load(logp_ptr + offs, mask=tr, other=0).to(CDT)
        old = tl.load(old_ptr + offs, mask=tr, other=0).to(CDT)
        d = lp - old
        if NEED_RANK:
            K = K2 + tl.associative_scan(tri, 0, _ADD)
            prev = tl.load(comp_ptr + start + K - 2, mask=tr & (K >= 2), other=-1)
            st = tr & (cid != prev)
            R = R2 + tl.associative_scan(st.to(tl.int32), 0, _ADD)
            R2 += tl.reduce(st.to(tl.int32), 0, _ADD)
            K2 += tl.reduce(tri, 0, _ADD)
            slot = start + R - 1
            has_next = tr & (R < nch)
            if RATIO == 2 or MIS == 3:  # this chunk's trained-token count from the table
                lo_k = tl.load(sk_ptr + slot, mask=tr, other=0)
                hi_k = tl.where(has_next, tl.load(sk_ptr + slot + 1, mask=has_next, other=0), n_s)
                n_c = tl.maximum(hi_k - lo_k, 1).to(tl.float64)
        # policy ratio at the configured level
        if RATIO == 0:
            x = d
        elif RATIO == 1:
            x = mean_d_seq + d * 0
        else:
            lo_d = tl.load(sd_ptr + slot, mask=tr, other=0)
            hi_d = tl.where(has_next, tl.load(sd_ptr + slot + 1, mask=has_next, other=0), tot_d)
            x = ((hi_d - lo_d) / n_c).to(CDT)
        r = tl.exp(tl.minimum(tl.maximum(x, -lrc), lrc))
        # rollout/trainer mismatch weight (no gradient)
        if MIS == 0:
            w = d * 0 + 1
            alt = cid < -1
        else:
            if MIS == 1:
                mx = old - tl.load(roll_ptr + offs, mask=tr, other=0).to(CDT)
            elif MIS == 2:
                mx = mean_q_seq + d * 0
            else:
                lo_q = tl.load(sq_ptr + slot, mask=tr, other=0)
                hi_q = tl.where(has_next, tl.load(sq_ptr + slot + 1, mask=has_next, other=0), tot_q)
                mx = ((hi_q - lo_q) / n_c).to(CDT)
            m = tl.exp(tl.minimum(tl.maximum(mx, -lrc), lrc))
            if TRUNC:
                w = tl.minimum(m, m_hi)
                alt = m > m_hi
            else:
                keep_m = (m >= m_lo) & (m <= m_hi)
                w = keep_m.to(CDT)
                alt = keep_m == 0
        # discounted advantage of the token's chunk
        if USE_GAMMA:
            A = adv_s * tl.exp2((nch - R).to(CDT) * log2_gamma)
            if POS_ONLY:
                A = tl.maximum(A, 0.0)
        else:
            A = adv_pos + d * 0
        # surrogate, and its gradient w.r.t. logp before the aggregation coefficient
        if SURR == 0:
            pg1 = -A * r
            pg2 = -A * tl.minimum(tl.maximum(r, clip_lo), clip_hi)
            clipped = pg2 > pg1  # torch.where tie semantics: pg2 only if strictly larger
            pg = tl.where(clipped, pg2, pg1)
            if DUAL:
                pg3 = -A * dual_c
                dual = (A < 0) & (pg > pg3)
                pg = tl.where(dual, pg3, pg)
            else:
                dual = clipped & (cid < -1)
            if RATIO == 1:
                g = seq_gfac + d * 0
            else:
                wbar = w
                if RATIO == 2 and MIS == 1:  # chunk ratio with token weights: the chunk's mean weight
                    lo_w = tl.load(sq_ptr + slot, mask=tr, other=0)
                    hi_w = tl.where(has_next, tl.load(sq_ptr + slot + 1, mask=has_next, other=0), tot_q)
                    wbar = ((hi_w - lo_w) / n_c).to(CDT)
                ns = ((clipped == 0) & (dual == 0)).to(CDT)
                g = -A * ns * wbar * r * ((x >= -lrc) & (x <= lrc)).to(CDT)
        else:  # topr: v = sg(min(r, 1)) for negative advantages
            v = tl.where(A >= 0, 1.0, tl.minimum(r, 1.0))
            pg = -A * v * lp
            clipped = (A < 0) & (r > 1)
            dual = clipped & (cid < -1)
            g = -A * v * w
        tok = w * pg
        kl = d * 0
        if KL != 0:
            ref = tl.load(ref_ptr + offs, mask=tr, other=0).to(CDT)
            if KL == 1:
                kl = lp - ref
                g += kl_beta
            elif KL == 2:
                kl = 0.5 * (lp - ref) * (lp - ref)
                g += kl_beta * (lp - ref)
            else:
                xr = ref - lp
                xc = tl.minimum(tl.maximum(xr, -lrc), lrc)
                kl = tl.exp(xc) - xc - 1
                g += kl_beta * (1 - tl.exp(xc)) * ((xr >= -lrc) & (xr <= lrc)).to(CDT)
            tok = tok + kl_beta * kl
        ent = d * 0
        if HAS_ENT:
            ent = tl.load(ent_ptr + offs, mask=tr, other=0).to(CDT)
            if ENT_GRAD:
                tok = tok - ent_coef * ent
        g_ent = d * 0 - ent_coef
        if AGG == 1:  # seq-mean-token-mean: coefficient 1/n_s
            tok = tok / n_s_c
            g = g / n_s_c
            g_ent = g_ent / n_s_c
        tl.store(glogp_ptr + offs, tl.where(tr, g, 0.0), mask=inb)
        if ENT_GRAD:
            tl.store(gent_ptr + offs, tl.where(tr, g_ent, 0.0), mask=inb)
        # metric partials (fp64)
        dc = tl.minimum(tl.maximum(d, -lrc), lrc)
        acc_loss += tl.reduce(tl.where(tr, tok, 0.0).to(tl.float64), 0, _ADD)
        acc_ntok += tl.reduce(tri, 0, _ADD).to(tl.float64)
        acc_clip += tl.reduce((tr & clipped).to(tl.float64), 0, _ADD)
        acc_dual += tl.reduce((tr & dual).to(tl.float64), 0, _ADD)
        acc_alt += tl.reduce((tr & alt).to(tl.float64), 0, _ADD)
        acc_akl += tl.reduce(tl.where(tr, tl.exp(dc) - 1 - dc, 0.0).to(tl.float64), 0, _ADD)
        acc_rsum += tl.reduce(tl.where(tr, r, 0.0).to(tl.float64), 0, _ADD)
        acc_rmax = tl.maximum(acc_rmax, tl.reduce(tl.where(tr, r, float("-inf")).to(tl.float64), 0, _MAXF))
        acc_anz += tl.reduce((tr & (A != 0)).to(tl.float64), 0, _ADD)
        acc_kept += tl.reduce((tr & (w > 0)).to(tl.float64), 0, _ADD)
        acc_pg += tl.reduce(tl.where(tr, w * pg, 0.0).to(tl.float64), 0, _ADD)
        acc_kl += tl.reduce(tl.where(tr, kl, 0.0).to(tl.float64), 0, _ADD)
        acc_ent += tl.reduce(tl.where(tr, ent, 0.0).to(tl.float64), 0, _ADD)
    p = part_ptr + s * NPART_C
    tl.store(p + 0, acc_loss)
    tl.store(p + 1, acc_ntok)
    tl.store(p + 2, acc_clip)
    tl.store(p + 3, acc_dual)
    tl.store(p + 4, acc_alt)
    tl.store(p + 5, acc_akl)
    tl.store(p + 6, acc_rsum)
    tl.store(p + 7, acc_rmax)
    tl.store(p + 8, acc_anz)
    tl.store(p + 9, acc_kept)
    tl.store(p + 10, acc_pg)
    tl.store(p + 11, acc_kl)
    tl.store(p + 12, acc_ent)
    tl.store(p + 13, first.to(tl.float64))
    tl.store(p + 14, (first & zero_var).to(tl.float64))


_PARAM_CACHE: dict = {}


def _params(cfg, cdt: torch.dtype, device: torch.device) -> torch.Tensor:
    """The scalar options as one small tensor of the compute dtype (cached: no copy per call)."""
    key = (cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.adv_eps, cfg.gamma, cfg.mismatch_low, cfg.mismatch_high,
           cfg.kl_beta, cfg.entropy_coef, cfg.log_ratio_clamp, cdt, str(device))
    t = _PARAM_CACHE.get(key)
    if t is None:
        vals = [1.0 - cfg.clip_low, 1.0 + cfg.clip_high, cfg.dual_clip or 0.0, cfg.adv_eps, math.log2(cfg.gamma),
                cfg.mismatch_low, cfg.mismatch_high, cfg.kl_beta, cfg.entropy_coef,
                math.inf if cfg.log_ratio_clamp is None else cfg.log_ratio_clamp]
        t = torch.tensor(vals + [0.0] * (16 - len(vals)), dtype=cdt, device=device)
        if len(_PARAM_CACHE) > 256:
            _PARAM_CACHE.clear()
        _PARAM_CACHE[key] = t
    return t


def _launch_sizes(T: int, N: int, cu: torch.Tensor, block: Optional[int], block_n: Optional[int]) -> tuple[int, int, int]:
    """(BLOCK, BLOCK_N, num_warps).  The interpreter pays per op, not per element: one big block
    covering the longest sequence; on a GPU 1024-token blocks over 4 warps."""
    if block is not None or block_n is not None:  # tests force small blocks to cross block edges
        return block or 1024, block_n or 256, 4
    if _INTERPRET:
        longest = int((cu[1:] - cu[:-1]).max().item()) if N else 1
        block = min(max(triton.next_power_of_2(max(longest, 1)), 16), 4096)
        return block, min(max(triton.next_power_of_2(N), 16), 4096), 1
    return 1024, 256, 4


def fused_policy_loss(logp, old_logp, rewards, group_ids, cu_seqlens, chunk_ids, cfg, rollout_logp=None,
                      ref_logp=None, entropy=None, normalizer: Optional[float] = None,
                      block: Optional[int] = None, block_n: Optional[int] = None):
    """Run the kernel.  Returns (loss, grad_logp, grad_entropy or None, D, metrics): loss is the
    aggregated loss (0-dim, compute dtype, no graph); grad_* are dL/d(.) times D (compute dtype),
    so the backward is ``grad * (grad_out / D)``; metrics are 0-dim tensors keyed like the reference."""
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    dev = logp.device
    T, N = logp.numel(), rewards.numel()
    c = lambda x: x.contiguous() if x is not None else logp  # noqa: E731 - absent inputs are never read
    cid = chunk_ids if chunk_ids.dtype == torch.int32 else chunk_ids.to(torch.int32)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    cid, cu = cid.contiguous(), cu.contiguous()

    ratio, mis = _RATIO[cfg.ratio_level], _MIS[cfg.mismatch_level]
    use_gamma = cfg.gamma != 1.0
    need_rank = use_gamma or ratio == 2 or mis == 3
    need_pass1 = need_rank or ratio == 1 or mis == 2 or cfg.loss_agg == "seq-mean-token-mean"
    store_q = need_rank and mis in (1, 3)
    ent_grad = entropy is not None and cfg.entropy_coef != 0

    glogp = torch.empty(T, dtype=cdt, device=dev)
    gent = torch.empty(T, dtype=cdt, device=dev) if ent_grad else glogp
    parts = torch.empty((N, NPART), dtype=torch.float64, device=dev)
    if need_rank:  # per-sequence chunk tables (see module docstring)
        comp = torch.empty(T, dtype=torch.int32, device=dev)
        sd = torch.empty(T, dtype=torch.float64, device=dev)
        sk = torch.empty(T, dtype=torch.int32, device=dev)
        sq = torch.empty(T, dtype=torch.float64, device=dev) if store_q else sd
    else:
        comp, sd, sk, sq = cid, parts, cid, parts
    block, block_n, warps = _launch_sizes(T, N, cu, block, block_n)
    _policy_loss_kernel[(N,)](
        c(logp), c(old_logp), c(rollout_logp), c(ref_logp), c(entropy), cid, cu, c(rewards), c(group_ids),
        _params(cfg, cdt, dev), glogp, gent, parts, comp, sd, sq, sk, N,
        CDT=tl.float64 if cdt == torch.float64 else tl.float32, RATIO=ratio,
        SURR=0 if cfg.surrogate == "ppo_clip" else 1, DUAL=cfg.dual_clip is not None, ADV=_ADV[cfg.adv_norm],
        POS_ONLY=cfg.positive_only, USE_GAMMA=use_gamma, MIS=mis, TRUNC=cfg.mismatch_mode == "truncate",
        KL=_KL[cfg.kl_estimator] if cfg.kl_beta > 0 else 0, HAS_ENT=entropy is not None, ENT_GRAD=ent_grad,
        AGG=_AGG[cfg.loss_agg], NEED_PASS1=need_pass1,
        NEED_RANK=need_rank, STORE_Q=store_q, BLOCK=block, BLOCK_N=block_n, NPART_C=NPART, num_warps=warps,
    )

    # deterministic host-side reduction of the [N, 16] partials (no device->host sync)
    tot = parts.sum(0)
    ntok = parts[:, 1]
    n_tr = tot[1]
    if normalizer is not None:
        D = torch.full((), float(normalizer), dtype=torch.float64, device=dev)  # a fill, not a host copy
    elif cfg.loss_agg == "token-mean":
        D = n_tr
    else:
        S = (ntok > 0).sum().to(torch.float64)
        if cfg.loss_agg == "seq-mean-token-sum-norm":
            Lc = ntok.max() if cfg.agg_constant is None else torch.full((), float(cfg.agg_constant), dtype=torch.float64, device=dev)
            D = S * Lc
        else:
            D = S
    D = D.clamp_min(1e-30)
    loss = (tot[0] / D).to(cdt)
    nf = n_tr.clamp_min(1.0)
    m = {
        "clip_frac": tot[2] / nf,
        "dual_clip_frac": tot[3] / nf,
        "mismatch_masked_frac": tot[4] / nf,
        "approx_kl": tot[5] / nf,
        "ratio_mean": tot[6] / nf,
        "ratio_max": torch.where(n_tr > 0, parts[:, 7].max(), torch.zeros_like(n_tr)),
        "adv_nonzero_frac": tot[8] / nf,
        "zero_var_group_frac": tot[14] / tot[13],
        "tokens_kept": tot[9],
        "pg_loss": tot[10] / nf,
        "kl_mean": tot[11] / nf if cfg.kl_beta > 0 else torch.zeros_like(n_tr),
        "entropy_mean": tot[12] / nf if entropy is not None else torch.zeros_like(n_tr),
    }
    metrics = {k: v.to(cdt).reshape(()) for k, v in m.items()}
    return loss, glogp, (gent if ent_grad else None), D.to(cdt), metrics
