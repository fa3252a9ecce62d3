"""Fused policy loss in Triton: one launch computes loss, metrics, dL/dlogp and dL/dentropy.

The math is ``spec.py`` (the specification); this module only changes *how* it is computed.
The launch (options, scratch buffers, the host-side reduction) is ``triton_launch.py``.

Design (one program per packed sequence, tokens walked in blocks of ``BLOCK``):

* Advantages are an input, one per sequence (arl/algo/advantages.py computes them before packing),
  or, in-pass (``ADV_EST`` != 0), the program computes its own from its reward and its group's row
  of the step's group table (group_adv.py: count, sum, std, zero_var) in float64 and rounds it once
  to the compute dtype; it never looks at other sequences.
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
  partials of the program in fp64; the host side sums the [N, NPART] partials (deterministic).
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
metric partials are fp64 in both cases.  Scalar options travel in a small float64 tensor and are
rounded to the compute dtype on load (as torch rounds python scalars); log2(gamma) stays float64
for the float64 discount of the spec's underflow rule.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .group_adv import IN_PASS
from .options import KL, LEVEL, LOSS_AGG, SURROGATE

NPART = 13  # metric partials per program, columns in the order of _PARTS
_PARTS = ("loss", "ntok", "clip", "dual", "altered", "approx_kl", "ratio_sum", "ratio_max", "adv_nonzero",
          "kept", "pg", "kl", "ent")

# option codes of the one table (options.py), as constants the kernel's constexpr branches compare to
_TOKEN = tl.constexpr(LEVEL["token"])
_SEQUENCE = tl.constexpr(LEVEL["sequence"])
_CHUNK = tl.constexpr(LEVEL["chunk"])
_NO_LEVEL = tl.constexpr(LEVEL["none"])
_PPO = tl.constexpr(SURROGATE["ppo_clip"])
_SEQ_MEAN_TOKEN_MEAN = tl.constexpr(LOSS_AGG["seq-mean-token-mean"])
_KL_OFF = tl.constexpr(KL["off"])
_K1 = tl.constexpr(KL["k1"])
_K2 = tl.constexpr(KL["k2"])
_GRPO = tl.constexpr(IN_PASS["grpo"])
_RLOO = tl.constexpr(IN_PASS["rloo"])


# Reductions go through tl.reduce / tl.associative_scan with the standard combine functions: the
# same code as tl.sum / tl.cumsum / tl.max once compiled, but builtins under the interpreter,
# where every call of a jitted function (tl.sum is one) costs ~10 ms of re-patching and which has
# fast numpy paths for exactly these combine functions.
_ADD = getattr(tl.standard, "_sum_combine", None)
_MAXF = getattr(tl.standard, "_elementwise_max", None)
if _ADD is None or _MAXF is None:  # pragma: no cover - other Triton versions

    @triton.jit
    def _ADD(a, b):
        return a + b

    @triton.jit
    def _MAXF(a, b):
        return tl.maximum(a, b)



@triton.jit
def _policy_loss_kernel(
    logp_ptr, old_ptr, roll_ptr, ref_ptr, ent_ptr, cid_ptr, cu_ptr, adv_ptr, rew_ptr, gidx_ptr, gst_ptr, n_groups,
    par_ptr, glogp_ptr, gent_ptr, part_ptr, comp_ptr, sd_ptr, sq_ptr, sk_ptr,
    ADV_EST: tl.constexpr, CDT: tl.constexpr, RATIO: tl.constexpr, SURR: tl.constexpr, DUAL: tl.constexpr,
    POS_ONLY: tl.constexpr, USE_GAMMA: tl.constexpr, MIS: tl.constexpr, TRUNC: tl.constexpr, KL: tl.constexpr,
    HAS_ENT: tl.constexpr, ENT_GRAD: tl.constexpr, AGG: tl.constexpr,
    NEED_PASS1: tl.constexpr, NEED_RANK: tl.constexpr, STORE_Q: tl.constexpr,
    BLOCK: tl.constexpr, NPART_C: tl.constexpr,
):
    # Small helpers are written inline: under the interpreter every call of a jitted helper
    # re-patches the language module (~1 ms), which dominated the run time.
    # lrc = log_ratio_clamp, +inf when off (clamping to +-inf is the identity on finite values).
    s = tl.program_id(0)
    start = tl.load(cu_ptr + s)
    L = tl.load(cu_ptr + s + 1) - start
    # the options arrive in float64 and are rounded to CDT here, as torch rounds python scalars
    clip_lo = tl.load(par_ptr + 0).to(CDT)  # 1 - clip_low
    clip_hi = tl.load(par_ptr + 1).to(CDT)  # 1 + clip_high
    dual_c = tl.load(par_ptr + 2).to(CDT)
    log2_gamma = tl.load(par_ptr + 3)  # float64: the discount is evaluated in float64 (spec.py)
    m_lo = tl.load(par_ptr + 4).to(CDT)
    m_hi = tl.load(par_ptr + 5).to(CDT)
    kl_beta = tl.load(par_ptr + 6).to(CDT)
    ent_coef = tl.load(par_ptr + 7).to(CDT)
    lrc = tl.load(par_ptr + 8).to(CDT)
    tiny = tl.load(par_ptr + 9)  # smallest normal number of CDT, float64: the discount's flush level

    # the sequence's advantage, rounded to CDT as the reference's .to(cdt): given, or in-pass the
    # group estimator in float64 (group_adv.py; a zero-variance group gives 0, a row outside the table NaN)
    if ADV_EST == 0:
        adv_s = tl.load(adv_ptr + s).to(CDT)
    else:
        rw = tl.load(rew_ptr + s)
        gi = tl.load(gidx_ptr + s)
        ok = (gi >= 0) & (gi < n_groups)
        gp = gst_ptr + tl.where(ok, gi, 0) * 4
        g_cnt = tl.load(gp + 0)
        g_sum = tl.load(gp + 1)
        if ADV_EST == _RLOO:
            a64 = rw - (g_sum - rw) / tl.maximum(g_cnt - 1.0, 1.0)
        else:
            a64 = rw - g_sum / tl.maximum(g_cnt, 1.0)
            if ADV_EST == _GRPO:
                a64 = a64 / (tl.load(gp + 2) + tl.load(par_ptr + 10))
        a64 = tl.where(tl.load(gp + 3) != 0, 0.0, a64)
        adv_s = tl.where(ok, a64, float("nan")).to(CDT)
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
            if MIS != _NO_LEVEL:
                mq = old - tl.load(roll_ptr + offs, mask=tr, other=0).to(CDT)
                if MIS == _TOKEN:  # the token weight itself: chunk/sequence ratios need its sums
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
    if RATIO == _SEQUENCE:
        if SURR == _PPO:
            x_seq = tl.minimum(tl.maximum(mean_d_seq, -lrc), lrc)
            r_seq = tl.exp(x_seq)
            r_seq_clip = tl.minimum(tl.maximum(r_seq, clip_lo), clip_hi)
            w_seq = tl.full([], 1.0, CDT)
            if MIS == _SEQUENCE:
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
                    if MIS == _TOKEN or MIS == _CHUNK:
                        lo_q = tl.load(sq_ptr + start + ci, mask=cv, other=0)
                        W = tl.where(nxt, tl.load(sq_ptr + start + ci + 1, mask=nxt, other=0), tot_q) - lo_q
                        if MIS == _CHUNK:  # W = w_c * n_c with w_c from the chunk's mean of old - rollout
                            mc = tl.exp(tl.minimum(tl.maximum((W / tl.maximum(n_c, 1.0)).to(CDT), -lrc), lrc))
                            if TRUNC:
                                W = tl.minimum(mc, m_hi).to(tl.float64) * n_c
                            else:
                                W = ((mc >= m_lo) & (mc <= m_hi)).to(tl.float64) * n_c
                    else:
                        W = w_seq.to(tl.float64) * n_c
                    disc = tl.exp2((nch - ci - 1).to(tl.float64) * log2_gamma)  # spec's underflow rule
                    A_c = adv_s.to(tl.float64) * tl.where(disc < tiny, 0.0, disc)
                    A_c = tl.where(tl.abs(A_c) < tiny, 0.0, A_c).to(CDT)
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
                if MIS == _TOKEN:
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
            if RATIO == _CHUNK or MIS == _CHUNK:  # this chunk's trained-token count from the table
                lo_k = tl.load(sk_ptr + slot, mask=tr, other=0)
                hi_k = tl.where(has_next, tl.load(sk_ptr + slot + 1, mask=has_next, other=0), n_s)
                n_c = tl.maximum(hi_k - lo_k, 1).to(tl.float64)
        # policy ratio at the configured level
        if RATIO == _TOKEN:
            x = d
        elif RATIO == _SEQUENCE:
            x = mean_d_seq + d * 0
        else:
            lo_d = tl.load(sd_ptr + slot, mask=tr, other=0)
            hi_d = tl.where(has_next, tl.load(sd_ptr + slot + 1, mask=has_next, other=0), tot_d)
            x = ((hi_d - lo_d) / n_c).to(CDT)
        r = tl.exp(tl.minimum(tl.maximum(x, -lrc), lrc))
        # rollout/trainer mismatch weight (no gradient)
        if MIS == _NO_LEVEL:
            w = d * 0 + 1
            alt = cid < -1
        else:
            if MIS == _TOKEN:
                mx = old - tl.load(roll_ptr + offs, mask=tr, other=0).to(CDT)
            elif MIS == _SEQUENCE:
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
            # spec's underflow rule: float64 discount and product, each flushed below CDT's tiny
            disc = tl.exp2((nch - R).to(tl.float64) * log2_gamma)
            A = adv_s.to(tl.float64) * tl.where(disc < tiny, 0.0, disc)
            A = tl.where(tl.abs(A) < tiny, 0.0, A).to(CDT)
            if POS_ONLY:
                A = tl.maximum(A, 0.0)
        else:
            A = adv_pos + d * 0
        # surrogate, and its gradient w.r.t. logp before the aggregation coefficient
        if SURR == _PPO:
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
            if RATIO == _SEQUENCE:
                g = seq_gfac + d * 0
            else:
                wbar = w
                if RATIO == _CHUNK and MIS == _TOKEN:  # chunk ratio with token weights: the chunk's mean weight
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
        if KL != _KL_OFF:
            ref = tl.load(ref_ptr + offs, mask=tr, other=0).to(CDT)
            if KL == _K1:
                kl = lp - ref
                g += kl_beta
            elif KL == _K2:
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
        if AGG == _SEQ_MEAN_TOKEN_MEAN:  # seq-mean-token-mean: coefficient 1/n_s
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
