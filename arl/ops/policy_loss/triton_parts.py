"""The parts of the Triton policy-loss kernel (triton_kernel.py): option codes as constexprs, the
reduction combines, and the kernel's helpers, each a piece of the one algorithm of spec.py.

Helpers are ``@triton.jit`` functions when compiled (inlined into the kernel).  Under
``TRITON_INTERPRET=1`` (the test suite on CPU) they are plain functions that the interpreted kernel
calls as Python, the language being patched already: a call of a jitted helper re-patches the
language module every time there: 0.55 ms of CPU a call more than inline code, against 0.03 ms
for the plain function (bench/probe_triton_helpers.py; triton_kernel.py's module doc has the figures).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .group_adv import IN_PASS
from .options import KL, LEVEL, LOSS_AGG, SURROGATE

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

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


def _helper(fn):
    """A part of the kernel: ``@triton.jit`` when compiled (inlined into the kernel); a plain function
    under ``TRITON_INTERPRET=1``, where the interpreted kernel calls it as Python with the language
    already patched (a jitted helper would re-patch the language module on every call there)."""
    return fn if _INTERPRET else triton.jit(fn)


@_helper
def _sequence_advantage(adv_ptr, rew_ptr, gidx_ptr, gst_ptr, n_groups, eps, s, ADV_EST: tl.constexpr,
                        CDT: tl.constexpr):
    """A_s rounded to CDT as the reference's .to(cdt): given, or in-pass the group estimator in float64
    (group_adv.py; a zero-variance group gives 0, a row outside the table NaN)."""
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
                a64 = a64 / (tl.load(gp + 2) + eps)
        a64 = tl.where(tl.load(gp + 3) != 0, 0.0, a64)
        adv_s = tl.where(ok, a64, float("nan")).to(CDT)
    return adv_s


@_helper
def _mismatch_of(mq, lrc, m_lo, m_hi, TRUNC: tl.constexpr, CDT: tl.constexpr):
    """(w, altered) of mean log mismatch ``mq``: mask [m_lo, m_hi] or truncate at m_hi."""
    m = tl.exp(tl.minimum(tl.maximum(mq, -lrc), lrc))
    if TRUNC:
        w = tl.minimum(m, m_hi)
        alt = m > m_hi
    else:
        keep = (m >= m_lo) & (m <= m_hi)
        w = keep.to(CDT)
        alt = keep == 0
    return w, alt


@_helper
def _pass1(logp_ptr, old_ptr, roll_ptr, cid_ptr, comp_ptr, sd_ptr, sq_ptr, sk_ptr, start, L, lrc, m_lo, m_hi,
           CDT: tl.constexpr, MIS: tl.constexpr, TRUNC: tl.constexpr, NEED_RANK: tl.constexpr,
           STORE_Q: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1: trained count, chunk count and the fp64 totals of d and q; with NEED_RANK the
    per-chunk prefix table (module doc)."""
    ar = tl.arange(0, BLOCK)
    n_s = tl.full([], 0, tl.int32)
    nch = tl.full([], 0, tl.int32)
    tot_d = tl.full([], 0.0, tl.float64)
    tot_q = tl.full([], 0.0, tl.float64)
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
                mq, _alt = _mismatch_of(mq, lrc, m_lo, m_hi, TRUNC, CDT)
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
    return n_s, nch, tot_d, tot_q


@_helper
def _discounted(adv_s, dist, log2_gamma, tiny, CDT: tl.constexpr, POS_ONLY: tl.constexpr):
    """gamma**dist * A_s by the spec's underflow rule: float64 discount and product, each flushed
    below CDT's smallest normal, one rounding to CDT; positive_only clamps at 0."""
    disc = tl.exp2(dist.to(tl.float64) * log2_gamma)
    A = adv_s.to(tl.float64) * tl.where(disc < tiny, 0.0, disc)
    A = tl.where(tl.abs(A) < tiny, 0.0, A).to(CDT)
    if POS_ONLY:
        A = tl.maximum(A, 0.0)
    return A


@_helper
def _sequence_ppo_factor(sk_ptr, sq_ptr, start, nch, n_s, tot_q, mean_d_seq, mean_q_seq, n_s_c, adv_s, adv_pos,
                         log2_gamma, tiny, lrc, clip_lo, clip_hi, dual_c, m_lo, m_hi,
                         CDT: tl.constexpr, MIS: tl.constexpr, TRUNC: tl.constexpr, POS_ONLY: tl.constexpr,
                         DUAL: tl.constexpr, NEED_RANK: tl.constexpr, BLOCK: tl.constexpr):
    """Sequence-level PPO: sum_t w_t * dpg_t/dr reduced over the chunk table (chunks share A and the
    clip decision), times d r_seq / d logp_j = r * 1[inside the clamp] / n_s."""
    ar = tl.arange(0, BLOCK)
    x_seq = tl.minimum(tl.maximum(mean_d_seq, -lrc), lrc)
    r_seq = tl.exp(x_seq)
    r_seq_clip = tl.minimum(tl.maximum(r_seq, clip_lo), clip_hi)
    w_seq = tl.full([], 1.0, CDT)
    if MIS == _SEQUENCE:
        w_seq, _alt = _mismatch_of(mean_q_seq, lrc, m_lo, m_hi, TRUNC, CDT)
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
                    w_c, _alt = _mismatch_of((W / tl.maximum(n_c, 1.0)).to(CDT), lrc, m_lo, m_hi, TRUNC, CDT)
                    W = w_c.to(tl.float64) * n_c
            else:
                W = w_seq.to(tl.float64) * n_c
            A_c = _discounted(adv_s, nch - ci - 1, log2_gamma, tiny, CDT, POS_ONLY)
            sp1 = -A_c * r_seq
            sp2 = -A_c * r_seq_clip
            clp = sp2 > sp1
            keep = cv & (clp == 0)
            if DUAL:
                keep = keep & ~((A_c < 0) & (tl.where(clp, sp2, sp1) > -A_c * dual_c))
            acc += tl.reduce(tl.where(keep, (-A_c).to(tl.float64) * W, 0.0), 0, _ADD)
        gfac = acc.to(CDT)
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
        gfac = tl.where(keep, -adv_pos * W1, 0.0)
    return gfac * r_seq * ((mean_d_seq >= -lrc) & (mean_d_seq <= lrc)).to(CDT) / n_s_c


@_helper
def _token_surrogate(A, r, x, d, w, wbar, lp, cid, seq_gfac, lrc, clip_lo, clip_hi, dual_c, SURR: tl.constexpr,
                     RATIO: tl.constexpr, DUAL: tl.constexpr, CDT: tl.constexpr):
    """(pg, clipped, dual, g): the surrogate and its gradient w.r.t. logp before the aggregation
    coefficient (PPO at token / chunk level: through the ratio; sequence level: ``seq_gfac``)."""
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
            ns = ((clipped == 0) & (dual == 0)).to(CDT)
            g = -A * ns * wbar * r * ((x >= -lrc) & (x <= lrc)).to(CDT)
    else:  # topr: v = sg(min(r, 1)) for negative advantages
        v = tl.where(A >= 0, 1.0, tl.minimum(r, 1.0))
        pg = -A * v * lp
        clipped = (A < 0) & (r > 1)
        dual = clipped & (cid < -1)
        g = -A * v * w
    return pg, clipped, dual, g


@_helper
def _kl_term(lp, ref, lrc, KL: tl.constexpr, CDT: tl.constexpr):
    """(kl_t, d kl_t / d logp_t) of the configured estimator."""
    if KL == _K1:
        kl = lp - ref
        dkl = lp * 0 + 1
    elif KL == _K2:
        kl = 0.5 * (lp - ref) * (lp - ref)
        dkl = lp - ref
    else:
        xr = ref - lp
        xc = tl.minimum(tl.maximum(xr, -lrc), lrc)
        kl = tl.exp(xc) - xc - 1
        dkl = (1 - tl.exp(xc)) * ((xr >= -lrc) & (xr <= lrc)).to(CDT)
    return kl, dkl


@_helper
def _chunk_mean(tab_ptr, slot, tr, has_next, total, n_c, CDT: tl.constexpr):
    """Mean over the token's chunk of a quantity whose exclusive prefix sums (fp64) the table holds
    at chunk starts: the next entry (the sequence total after the last chunk) minus this one."""
    lo = tl.load(tab_ptr + slot, mask=tr, other=0)
    hi = tl.where(has_next, tl.load(tab_ptr + slot + 1, mask=has_next, other=0), total)
    return ((hi - lo) / n_c).to(CDT)


@_helper
def _token_loss(tok, g, d, lp, ref_ptr, ent_ptr, offs, tr, lrc, kl_beta, ent_coef, n_s_c, KL: tl.constexpr,
                HAS_ENT: tl.constexpr, ENT_GRAD: tl.constexpr, AGG: tl.constexpr, CDT: tl.constexpr):
    """(tok, g, g_ent, kl, ent): the token's loss term (weighted surrogate ``tok`` plus the KL term,
    minus the entropy bonus) and its gradients w.r.t. logp and entropy, both before the aggregation
    denominator; seq-mean-token-mean's 1/n_s coefficient applied."""
    kl = d * 0
    if KL != _KL_OFF:
        kl, dkl = _kl_term(lp, tl.load(ref_ptr + offs, mask=tr, other=0).to(CDT), lrc, KL, CDT)
        g += kl_beta * dkl
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
    return tok, g, g_ent, kl, ent
