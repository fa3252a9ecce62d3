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

Helpers (triton_parts.py): the per-sequence advantage (given or in-pass), pass 1, the sequence-level
PPO factor, a chunk's mean from the prefix table, the mismatch weight, the discount, the surrogate
and the token's loss (KL, entropy, aggregation coefficient) are functions of their own; the kernel keeps the two walks and the metric partials.  Compiled, they are ``@triton.jit``
helpers (inlined).  Under the interpreter they are plain functions, because a jitted helper's call
re-patches the language module every time there.  Process CPU time per launch of a 16-program
kernel calling a 3-op function 5 times (``python bench/probe_triton_helpers.py``; 2026-12-07, the
2-core CPU VM, Triton 3.9.0): inline 37.3 ms, jitted helper 81.2 ms (+0.55 ms a call), plain
helper 39.8 ms (+0.03 ms a call).  The suite's Triton tests (``/usr/bin/time python -m pytest
tests/ops/test_policy_loss_backends.py tests/ops/test_in_pass_advantages.py -k triton -q -n 0``,
147 tests, same day and machine, under a load average near 40, so CPU time, not wall time): whole
kernel 52.4 s user CPU, split kernel 49.7 s; the split adds nothing measurable.

Only ``tl.cumsum`` and plain reductions are used (no custom-combine scans): they are fast under
``TRITON_INTERPRET=1`` (custom combines fall back to a per-element Python loop there).  Stores to
scratch are followed by ``tl.debug_barrier()`` before other threads of the program read them
(GPU risk: this relies on bar.sync ordering global memory within a CTA, which CUDA guarantees).

GPU-only risks (not testable on the CPU machine this was written on): the compiled path relies on
constexpr-if scoping, fp64 tl.exp/exp2 (fp64 inputs only), ``tl.debug_barrier`` ordering of
global-memory stores within a program, and the helpers as ``@triton.jit`` functions with constexpr
parameters and tuple returns (the interpreter runs them as plain functions); BLOCK=1024 / 4 warps
is a guess to tune on the device.

Dtypes: fp32 and bf16 logp compute in fp32, fp64 logp in fp64 (gradcheck); prefix sums and
metric partials are fp64 in both cases.  Scalar options travel in a small float64 tensor and are
rounded to the compute dtype on load (as torch rounds python scalars); log2(gamma) stays float64
for the float64 discount of the spec's underflow rule.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_parts import (_ADD, _CHUNK, _MAXF, _NO_LEVEL, _PPO, _SEQUENCE, _TOKEN, _chunk_mean, _discounted,
                           _mismatch_of, _pass1, _sequence_advantage, _sequence_ppo_factor, _token_loss,
                           _token_surrogate)

NPART = 13  # metric partials per program, columns in the order of _PARTS
_PARTS = ("loss", "ntok", "clip", "dual", "altered", "approx_kl", "ratio_sum", "ratio_max", "adv_nonzero",
          "kept", "pg", "kl", "ent")


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

    adv_s = _sequence_advantage(adv_ptr, rew_ptr, gidx_ptr, gst_ptr, n_groups, tl.load(par_ptr + 10), s, ADV_EST, CDT)
    if POS_ONLY:
        adv_pos = tl.maximum(adv_s, 0.0)
    else:
        adv_pos = adv_s
    ar = tl.arange(0, BLOCK)

    # ---- pass 1: sequence totals and the per-chunk prefix table --------------------------------
    if NEED_PASS1:
        n_s, nch, tot_d, tot_q = _pass1(logp_ptr, old_ptr, roll_ptr, cid_ptr, comp_ptr, sd_ptr, sq_ptr, sk_ptr, start,
                                        L, lrc, m_lo, m_hi, CDT, MIS, TRUNC, NEED_RANK, STORE_Q, BLOCK)
    else:
        n_s = tl.full([], 0, tl.int32)
        nch = tl.full([], 0, tl.int32)
        tot_d = tl.full([], 0.0, tl.float64)
        tot_q = tl.full([], 0.0, tl.float64)
    n_safe = tl.maximum(n_s, 1).to(tl.float64)
    mean_d_seq = (tot_d / n_safe).to(CDT)
    mean_q_seq = (tot_q / n_safe).to(CDT)
    n_s_c = tl.maximum(n_s, 1).to(CDT)

    # ---- sequence-level PPO: sum_t w_t * dpg_t/dr, reduced over the chunk table ------------------
    seq_gfac = tl.full([], 0.0, CDT)
    if RATIO == _SEQUENCE:
        if SURR == _PPO:
            seq_gfac = _sequence_ppo_factor(sk_ptr, sq_ptr, start, nch, n_s, tot_q, mean_d_seq, mean_q_seq, n_s_c,
                                            adv_s, adv_pos, log2_gamma, tiny, lrc, clip_lo, clip_hi, dual_c, m_lo,
                                            m_hi, CDT, MIS, TRUNC, POS_ONLY, DUAL, NEED_RANK, BLOCK)

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
            x = _chunk_mean(sd_ptr, slot, tr, has_next, tot_d, n_c, CDT)
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
                mx = _chunk_mean(sq_ptr, slot, tr, has_next, tot_q, n_c, CDT)
            w, alt = _mismatch_of(mx, lrc, m_lo, m_hi, TRUNC, CDT)
        # discounted advantage of the token's chunk
        if USE_GAMMA:
            A = _discounted(adv_s, nch - R, log2_gamma, tiny, CDT, POS_ONLY)
        else:
            A = adv_pos + d * 0
        wbar = w
        if SURR == _PPO and RATIO == _CHUNK and MIS == _TOKEN:  # chunk ratio with token weights: the chunk's mean weight
            wbar = _chunk_mean(sq_ptr, slot, tr, has_next, tot_q, n_c, CDT)
        pg, clipped, dual, g = _token_surrogate(A, r, x, d, w, wbar, lp, cid, seq_gfac, lrc, clip_lo, clip_hi, dual_c,
                                                SURR, RATIO, DUAL, CDT)
        tok, g, g_ent, kl, ent = _token_loss(w * pg, g, d, lp, ref_ptr, ent_ptr, offs, tr, lrc, kl_beta, ent_coef,
                                             n_s_c, KL, HAS_ENT, ENT_GRAD, AGG, CDT)
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
