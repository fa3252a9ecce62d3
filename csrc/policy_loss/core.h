// The fused policy loss, per sequence, on raw pointers: the one algorithm that the C++ CPU op
// (cpu.cpp) and the CUDA kernel (cuda.cu) both run.
// The specification is arl/ops/policy_loss/spec.py; names below follow its notation (A, r, w, pg, D).
//
// No torch headers here: plain C++17 that nvcc also compiles for the device (ARL_HD).
// Gradients come out UNNORMALIZED (d sum_t coef_t l_t / d logp_t): D is only known after every
// sequence is done, so the caller's backward multiplies by grad_out / D — one pass, no rescale.
#pragma once

#include <cstdint>
#include <cstring>
#include <math.h>

#if defined(__CUDACC__)
#define ARL_HD __host__ __device__
#else
#define ARL_HD
#endif

namespace arl {
namespace ploss {

// ---- option codes: arl/ops/policy_loss/options.py maps LossConfig onto these (a test compares) ----
enum Level : int { kToken = 0, kSequence = 1, kChunk = 2, kNoLevel = 3 };
enum Surrogate : int { kPPOClip = 0, kTOPR = 1 };
enum MismatchMode : int { kMask = 0, kTruncate = 1 };
enum LossAgg : int { kTokenMean = 0, kSeqMeanTokenMean = 1, kSeqMeanTokenSum = 2, kSeqMeanTokenSumNorm = 3 };
enum KL : int { kKLOff = 0, kK1 = 1, kK2 = 2, kK3 = 3 };
// where A_s comes from: given per sequence, or a group estimator computed in the pass (group_adv.py IN_PASS)
enum AdvEstimator : int { kAdvGiven = 0, kGRPO = 1, kDrGRPO = 2, kRLOO = 3 };
// columns of the step's [G, 4] float64 group table (group_adv.py GROUP_STATS)
enum GroupStat : int { kGCount, kGSum, kGStd, kGZeroVar, kNumGroupStats };

// Integer options, in the order of the op's `int[] iopts`.
enum IOpt : int {
  kIRatioLevel, kISurrogate, kIPositiveOnly, kIMismatchLevel, kIMismatchMode, kILossAgg,
  kIKL, kIEntropyTerm, kIHasDual, kIHasClamp, kIHasAggConstant, kIHasNormalizer, kIAdvEstimator, kINumIOpts
};
// Float options, in the order of the op's `float[] fopts`.
enum FOpt : int {
  kFClipLow, kFClipHigh, kFDualClip, kFGamma, kFMismatchLow, kFMismatchHigh, kFAggConstant,
  kFKLBeta, kFEntropyCoef, kFLogRatioClamp, kFNormalizer, kFAdvEps, kFNumFOpts
};

// Per-sequence partial sums, reduced in sequence order by the caller (determinism).
enum Partial : int {
  kPClip, kPDual, kPAltered, kPApproxKL, kPRatioSum, kPRatioMax, kPAdvNonzero, kPKept, kPPg, kPKL, kPEnt,
  kPLoss, kPNTrained, kNumPartials
};
// The op's `stats` output: METRIC_KEYS order of arl/ops/policy_loss/spec.py, then 1/D.
enum Stat : int {
  kSClipFrac, kSDualClipFrac, kSMismatchFrac, kSApproxKL, kSRatioMean, kSRatioMax, kSAdvNonzeroFrac,
  kSTokensKept, kSPgLoss, kSKLMean, kSEntropyMean, kSInvD, kNumStats
};

// bf16 storage (raw bits); loads widen to float exactly.
struct bf16 {
  uint16_t bits;
};

template <typename T>
struct Load {
  template <typename in_t>
  ARL_HD static T from(in_t x) { return static_cast<T>(x); }
  ARL_HD static T from(bf16 x) {
    uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return static_cast<T>(f);
  }
};

ARL_HD inline float xexp(float x) { return expf(x); }
ARL_HD inline double xexp(double x) { return exp(x); }
// smallest normal number of the compute type (FLT_MIN / DBL_MIN), as a double
ARL_HD inline double tiny_of(float) { return 1.17549435082228750797e-38; }
ARL_HD inline double tiny_of(double) { return 2.22507385850720138309e-308; }
ARL_HD inline double flush_below(double x, double tiny) { return (x < tiny && x > -tiny) ? 0.0 : x; }
// torch.clamp / clamp_min / clamp_max semantics (NaN-free inputs)
template <typename T>
ARL_HD inline T clampv(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }
template <typename T>
ARL_HD inline T minv(T a, T b) { return b < a ? b : a; }
template <typename T>
ARL_HD inline T maxv(T a, T b) { return b > a ? b : a; }

// Options converted once to the compute type T (float for fp32/bf16 input, double for fp64).
template <typename T>
struct Opts {
  int ratio_level, surrogate, positive_only, mismatch_level, mismatch_mode, loss_agg, kl;
  int entropy_term, has_dual, has_clamp;
  T lo, hi, dual_c, mm_low, mm_high, kl_beta, ent_coef, clamp;
  double gamma;  // the discount is evaluated in double whatever T is (see chunk_advantage)
  // which per-sequence prepass quantities the main pass needs
  bool need_seq_pass;

  ARL_HD static Opts make(const int64_t* io, const double* fo) {
    Opts o;
    o.ratio_level = static_cast<int>(io[kIRatioLevel]);
    o.surrogate = static_cast<int>(io[kISurrogate]);
    o.positive_only = static_cast<int>(io[kIPositiveOnly]);
    o.mismatch_level = static_cast<int>(io[kIMismatchLevel]);
    o.mismatch_mode = static_cast<int>(io[kIMismatchMode]);
    o.loss_agg = static_cast<int>(io[kILossAgg]);
    o.kl = static_cast<int>(io[kIKL]);
    o.entropy_term = static_cast<int>(io[kIEntropyTerm]);
    o.has_dual = static_cast<int>(io[kIHasDual]);
    o.has_clamp = static_cast<int>(io[kIHasClamp]);
    // torch casts python scalars to the tensor dtype: 1 - clip_low is formed in double, then cast
    o.lo = static_cast<T>(1.0 - fo[kFClipLow]);
    o.hi = static_cast<T>(1.0 + fo[kFClipHigh]);
    o.dual_c = static_cast<T>(fo[kFDualClip]);
    o.gamma = fo[kFGamma];
    o.mm_low = static_cast<T>(fo[kFMismatchLow]);
    o.mm_high = static_cast<T>(fo[kFMismatchHigh]);
    o.kl_beta = static_cast<T>(fo[kFKLBeta]);
    o.ent_coef = static_cast<T>(fo[kFEntropyCoef]);
    o.clamp = static_cast<T>(fo[kFLogRatioClamp]);
    o.need_seq_pass = o.ratio_level == kSequence || o.mismatch_level == kSequence ||
                      o.loss_agg == kSeqMeanTokenMean || o.gamma != 1.0;
    return o;
  }
  ARL_HD T clamp_lr(T x) const { return has_clamp ? clampv(x, -clamp, clamp) : x; }
  // d clamp(x) / dx: torch's clamp passes the gradient on the closed interval
  ARL_HD T clamp_gate(T x) const { return (!has_clamp || (x >= -clamp && x <= clamp)) ? T(1) : T(0); }
};

// ---- in-pass advantages: the group estimator of sequence s from its reward r and its group's row g
// of the step's table (count, sum, std, zero_var; group_adv.py), in double with the registry's
// operations (arl/algo/advantages.py); a zero-variance group (a singleton too) gives exactly 0.
// The caller rounds the result once to T, as a given advantage is rounded.
ARL_HD inline double group_advantage(int est, double r, const double* g, double eps) {
  if (g[kGZeroVar] != 0.0) return 0.0;
  const double cnt = g[kGCount], sum = g[kGSum];
  if (est == kRLOO) return r - (sum - r) / maxv(cnt - 1.0, 1.0);
  const double d = r - sum / maxv(cnt, 1.0);
  return est == kGRPO ? d / (g[kGStd] + eps) : d;
}

// The per-sequence advantage inputs: given (adv) or in-pass (rewards, group rows, the step's table).
template <typename T>
struct AdvIn {
  const T* adv;             // [N] given advantages, or null
  const double* rewards;    // [N] in-pass rewards
  const int64_t* group;     // [N] row of each sequence in stats
  const double* stats;      // [G, kNumGroupStats]
  int64_t n_groups;         // G
  int est;
  double eps;
  ARL_HD T of(int64_t s) const {
    if (est == kAdvGiven) return adv[s];
    const int64_t g = group[s];
    if (g < 0 || g >= n_groups) return static_cast<T>(NAN);  // never read outside the table
    return static_cast<T>(group_advantage(est, rewards[s], stats + g * kNumGroupStats, eps));
  }
};

// ---- advantages: A_s per sequence (given, or in-pass above) ----
// A_c = gamma**Delta(c) * A_s, Delta(c) = chunks after c in the sequence; positive_only clamps at 0.
// The spec's underflow rule: discount and product in double, each flushed to 0 below T's smallest
// normal, one rounding to T — no subnormal reaches T arithmetic (a GPU would flush it).
template <typename T>
ARL_HD inline T chunk_advantage(T adv_s, int64_t chunks_after, const Opts<T>& o) {
  T a = adv_s;
  if (o.gamma != 1.0) {
    const double tiny = tiny_of(T(0));
    const double disc = flush_below(pow(o.gamma, static_cast<double>(chunks_after)), tiny);
    a = static_cast<T>(flush_below(static_cast<double>(adv_s) * disc, tiny));
  }
  return o.positive_only ? maxv(a, T(0)) : a;
}

// ---- the level's ratio and mismatch weight ----
template <typename T>
struct SegRatio {
  T lr, r, gate;  // clamped mean log-ratio, exp(lr), d lr / d mean (0 when clamped)
};
template <typename T>
ARL_HD inline SegRatio<T> seg_ratio(T mean, const Opts<T>& o) {
  SegRatio<T> s;
  s.lr = o.clamp_lr(mean);
  s.r = xexp(s.lr);
  s.gate = o.clamp_gate(mean);
  return s;
}
template <typename T>
struct Weight {
  T w;
  bool altered;
};
// The weight of a mismatch ratio m = exp(clamped mean of old - rollout): mask or truncate.
template <typename T>
ARL_HD inline Weight<T> mismatch_from_ratio(T m, const Opts<T>& o) {
  Weight<T> out;
  if (o.mismatch_mode == kMask) {
    const bool keep = m >= o.mm_low && m <= o.mm_high;
    out.w = keep ? T(1) : T(0);
    out.altered = !keep;
  } else {
    out.w = minv(m, o.mm_high);
    out.altered = m > o.mm_high;
  }
  return out;
}
template <typename T>
ARL_HD inline Weight<T> mismatch_weight(T mean, const Opts<T>& o) {
  Weight<T> out;
  if (o.mismatch_level == kNoLevel) {
    out.w = T(1);
    out.altered = false;
    return out;
  }
  return mismatch_from_ratio(xexp(o.clamp_lr(mean)), o);
}

// Metric and loss partial sums are kept in double: an fp32 running sum of ~1.0 values over a
// few thousand tokens drifts by 1e-4 (the reference's torch.sum does not).
template <typename T>
struct Acc {
  double v[kNumPartials];
  ARL_HD void zero() {
    for (int i = 0; i < kNumPartials; ++i) v[i] = 0.0;
    v[kPRatioMax] = -INFINITY;
  }
};

// The clipped PPO surrogate at ratio r with advantage A: pg = max(-A r, -A clip(r)) (ties take
// -A r, as torch.where), then the dual clip; dpg_dr its derivative.
template <typename T>
struct PPOTerm {
  T pg, dpg_dr;
  bool clipped, dual;
};
template <typename T>
ARL_HD inline PPOTerm<T> ppo_clip(T A, T r, const Opts<T>& o) {
  const T nA = -A;
  const T pg1 = nA * r, pg2 = nA * clampv(r, o.lo, o.hi);
  PPOTerm<T> t;
  t.clipped = pg2 > pg1;
  const T pg = t.clipped ? pg2 : pg1;
  const T dpg = t.clipped ? ((r >= o.lo && r <= o.hi) ? nA : T(0)) : nA;
  const T pg3 = nA * o.dual_c;
  t.dual = o.has_dual && A < T(0) && pg > pg3;
  t.pg = t.dual ? pg3 : pg;
  t.dpg_dr = t.dual ? T(0) : dpg;
  return t;
}

// One trained token: surrogate, KL, entropy, metrics.  Returns the token's own gradient
// coef*(w*dpg/dlogp|TOPR + kl_beta*dkl/dlogp); *seg_g gets coef*w*dpg/dr (PPO), which the caller
// sums over the ratio segment and spreads as seg_g_sum * r * gate / n_seg to its tokens.
template <typename T>
ARL_HD inline T token_step(const Opts<T>& o, T A, const SegRatio<T>& sr, T approx_kl, const Weight<T>& wt, T lp,
                           T ref, T ent, bool has_ent, T coef, Acc<T>& acc, T* seg_g) {
  const T nA = -A;
  const T r = sr.r;
  T pg, own = T(0), g = T(0);
  bool clipped, dual = false;
  if (o.surrogate == kPPOClip) {
    const PPOTerm<T> t = ppo_clip(A, r, o);
    pg = t.pg;
    clipped = t.clipped;
    dual = t.dual;
    g = coef * (wt.w * t.dpg_dr);
  } else {  // TOPR: v = 1 for A >= 0, else sg(min(r, 1)); pg = -A v logp
    const T v = A >= T(0) ? T(1) : minv(r, T(1));
    pg = (nA * v) * lp;
    clipped = A < T(0) && r > T(1);
    own = coef * (wt.w * (nA * v));
  }
  const T wpg = wt.w * pg;
  T tok = wpg;
  if (o.kl != kKLOff) {
    T kl, dkl;
    if (o.kl == kK1) {
      kl = lp - ref;
      dkl = T(1);
    } else if (o.kl == kK2) {
      const T x = lp - ref;
      kl = T(0.5) * (x * x);
      dkl = x;
    } else {
      const T x0 = ref - lp;
      const T x = o.clamp_lr(x0);
      const T ex = xexp(x);
      kl = ex - x - T(1);
      dkl = -(ex - T(1)) * o.clamp_gate(x0);
    }
    tok = tok + o.kl_beta * kl;
    own += coef * (o.kl_beta * dkl);
    acc.v[kPKL] += static_cast<double>(kl);
  }
  if (has_ent) {
    if (o.entropy_term) tok = tok - o.ent_coef * ent;
    acc.v[kPEnt] += static_cast<double>(ent);
  }
  acc.v[kPClip] += clipped ? 1.0 : 0.0;
  acc.v[kPDual] += dual ? 1.0 : 0.0;
  acc.v[kPAltered] += wt.altered ? 1.0 : 0.0;
  acc.v[kPApproxKL] += static_cast<double>(approx_kl);
  acc.v[kPRatioSum] += static_cast<double>(r);
  acc.v[kPRatioMax] = maxv(acc.v[kPRatioMax], static_cast<double>(r));
  acc.v[kPAdvNonzero] += A != T(0) ? 1.0 : 0.0;
  acc.v[kPKept] += wt.w > T(0) ? 1.0 : 0.0;
  acc.v[kPPg] += static_cast<double>(wpg);
  acc.v[kPLoss] += static_cast<double>(coef * tok);
  acc.v[kPNTrained] += 1.0;
  *seg_g = g;
  return own;
}

// exp(d) - 1 - d of the token's clamped log-ratio (the approx_kl metric)
template <typename T>
ARL_HD inline T approx_kl_of(T d, const Opts<T>& o) {
  const T dc = o.clamp_lr(d);
  return xexp(dc) - T(1) - dc;
}

// Raw inputs of the whole pack.  Token arrays have T entries; optional ones may be null.
template <typename in_t, typename idx_t>
struct Inputs {
  const in_t* logp;
  const in_t* old_logp;
  const in_t* rollout_logp;  // needed when mismatch_level != none
  const in_t* ref_logp;      // needed when kl != off
  const in_t* entropy;       // may be null
  const idx_t* chunk_ids;
  const int64_t* cu_seqlens;  // [N+1]
};

// One trained token u inside a chunk whose ratio / mismatch weight are ch_r / ch_w (token levels
// recompute them here).  Returns the token's own gradient; *g gets its PPO segment term (see
// token_step).  Shared by the serial CPU loop and the CUDA warp loop.
template <typename in_t, typename idx_t, typename T>
ARL_HD inline T trained_token(const Inputs<in_t, idx_t>& in, const Opts<T>& o, int64_t u, T A, const SegRatio<T>& ch_r,
                              const Weight<T>& ch_w, bool has_ent, bool ppo, T coef, Acc<T>& acc, T* g) {
  using L = Load<T>;
  const T lp = L::from(in.logp[u]), old = L::from(in.old_logp[u]);
  const T d = lp - old;
  SegRatio<T> sr = ch_r;
  T akl;
  if (o.ratio_level == kToken) {
    sr = seg_ratio(d, o);
    akl = sr.r - T(1) - sr.lr;  // same clamped d: reuse exp
  } else {
    akl = approx_kl_of(d, o);
  }
  Weight<T> wt = ch_w;
  if (o.mismatch_level == kToken) wt = mismatch_weight(old - L::from(in.rollout_logp[u]), o);
  const T ref = o.kl != kKLOff ? L::from(in.ref_logp[u]) : T(0);
  const T ent = has_ent ? L::from(in.entropy[u]) : T(0);
  T own = token_step(o, A, sr, akl, wt, lp, ref, ent, has_ent, coef, acc, g);
  if (ppo && o.ratio_level == kToken) own += *g * sr.r * sr.gate;
  return own;
}

// The whole algorithm for sequence s, serially.  grad (may be null: no gradient wanted) gets the
// unnormalized dL/dlogp of every token of the sequence (0 on untrained tokens); acc gets the
// sequence's partial sums; *coef_out the aggregation coefficient of its tokens (1 or 1/n_s).
template <typename in_t, typename idx_t, typename T>
ARL_HD inline void process_sequence(const Inputs<in_t, idx_t>& in, const Opts<T>& o, int64_t s, T adv_s, T* grad,
                                    Acc<T>& acc, T* coef_out) {
  using L = Load<T>;
  const int64_t b = in.cu_seqlens[s], e = in.cu_seqlens[s + 1];
  const idx_t* cid = in.chunk_ids;
  const bool has_ent = in.entropy != nullptr;
  const bool ppo = o.surrogate == kPPOClip;

  // pass 1 (only when needed): trained count, chunk count, sequence-level sums
  int64_t n_s = 0, K = 0;
  T sd = T(0), smd = T(0);
  if (o.need_seq_pass) {
    const bool sums_d = o.ratio_level == kSequence, sums_m = o.mismatch_level == kSequence;
    idx_t last = -1;
    for (int64_t t = b; t < e; ++t) {
      const idx_t c = cid[t];
      if (c < 0) continue;
      ++n_s;
      K += (c != last) ? 1 : 0;
      last = c;
      if (sums_d) sd += L::from(in.logp[t]) - L::from(in.old_logp[t]);
      if (sums_m) smd += L::from(in.old_logp[t]) - L::from(in.rollout_logp[t]);
    }
  }
  const T coef = (o.loss_agg == kSeqMeanTokenMean && n_s > 0) ? T(1) / static_cast<T>(n_s) : T(1);
  if (coef_out) *coef_out = coef;
  SegRatio<T> seq_r{T(0), T(1), T(1)};
  Weight<T> seq_w{T(1), false};
  if (o.ratio_level == kSequence && n_s > 0) seq_r = seg_ratio(sd / static_cast<T>(n_s), o);
  if (o.mismatch_level == kSequence && n_s > 0) seq_w = mismatch_weight(smd / static_cast<T>(n_s), o);
  T G_seq = T(0);

  int64_t k = 0, t = b;
  while (t < e) {
    const idx_t c = cid[t];
    if (c < 0) {
      if (grad) grad[t] = T(0);
      ++t;
      continue;
    }
    // chunk extent [t, ce): tokens of id c and the untrained tokens among them (ids never decrease)
    int64_t ce = t + 1;
    while (ce < e && cid[ce] <= c) ++ce;
    const T A = chunk_advantage(adv_s, K - 1 - k, o);

    int64_t n_c = 0;
    SegRatio<T> ch_r = seq_r;
    Weight<T> ch_w = seq_w;
    if (o.ratio_level == kChunk || o.mismatch_level == kChunk) {
      T cd = T(0), cm = T(0);
      for (int64_t u = t; u < ce; ++u) {
        if (cid[u] < 0) continue;
        ++n_c;
        const T lp = L::from(in.logp[u]), old = L::from(in.old_logp[u]);
        cd += lp - old;
        if (o.mismatch_level == kChunk) cm += old - L::from(in.rollout_logp[u]);
      }
      if (o.ratio_level == kChunk) ch_r = seg_ratio(cd / static_cast<T>(n_c), o);
      if (o.mismatch_level == kChunk) ch_w = mismatch_weight(cm / static_cast<T>(n_c), o);
    }

    T G = T(0);
    for (int64_t u = t; u < ce; ++u) {
      if (cid[u] < 0) {
        if (grad) grad[u] = T(0);
        continue;
      }
      T g;
      const T own = trained_token(in, o, u, A, ch_r, ch_w, has_ent, ppo, coef, acc, &g);
      G += g;
      if (grad) grad[u] = own;
    }
    if (ppo && o.ratio_level == kChunk && grad) {
      const T f = G * ch_r.r * ch_r.gate / static_cast<T>(n_c);
      for (int64_t u = t; u < ce; ++u)
        if (cid[u] >= 0) grad[u] += f;
    }
    G_seq += G;
    ++k;
    t = ce;
  }
  if (ppo && o.ratio_level == kSequence && grad && n_s > 0) {
    const T f = G_seq * seq_r.r * seq_r.gate / static_cast<T>(n_s);
    for (int64_t u = b; u < e; ++u)
      if (cid[u] >= 0) grad[u] += f;
  }
}

// D of the aggregation (reference: "Aggregation"), from the reduced counts.
ARL_HD inline double denominator(int loss_agg, double n_trained, double n_seq_nonempty, double max_n_s,
                                 bool has_agg_constant, double agg_constant, bool has_normalizer, double normalizer) {
  double D;
  if (loss_agg == kTokenMean) {
    D = n_trained;
  } else if (loss_agg == kSeqMeanTokenSumNorm) {
    D = n_seq_nonempty * (has_agg_constant ? agg_constant : max_n_s);
  } else {
    D = n_seq_nonempty;
  }
  if (has_normalizer) D = normalizer;
  return D > 1e-30 ? D : 1e-30;
}

}  // namespace ploss
}  // namespace arl
