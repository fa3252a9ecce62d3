// arl::policy_loss — the fused policy loss on CPU: one pass over the packed tokens gives the loss,
// the (unnormalized) dL/dlogp and every metric; arl/ops/policy_loss/fused.py wraps it in an
// autograd.Function whose backward only scales the saved gradient.
//
// OpenMP over sequences; each sequence writes its own partial sums, reduced afterwards in
// sequence order, so results do not depend on the thread count or schedule.
// Light headers on purpose: <torch/extension.h> costs ~60 s of compile per file here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "policy_loss/core.h"

namespace arl {
namespace {

using namespace ploss;

// ---- CPU fast path: the same math with the chunk's constants hoisted and the per-token loops
// written for the vectorizer (omp simd reductions; masks instead of branches).  Used for every
// config without a KL term; the KL configs and float64 (gradcheck) run process_sequence.
template <typename T>
struct ChunkSpan {
  int64_t b, e, n;  // token extent [b, e) and its trained-token count
  T sd, sm;         // sums of logp - old and old - rollout over trained tokens
};

// exp for the per-token loop: Cephes-style range reduction and a degree-6 polynomial (~1 ulp
// over the float range, inf above 88.72, denormals/0 below), written in plain arithmetic so the
// loop vectorizes; glibc's expf is a call per token and was ~40% of the op at 1M tokens.
inline float vexp(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);  // keeps n in the two-step scaling
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = std::fma(n, -0.693145751953125f, xc);  // x - n ln2, ln2 in two parts
  r = std::fma(n, -1.428606765330187045e-06f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  // 2^n as two factors, so neither exponent field overflows: inf past 88.72, denormals below
  // -87.3; a NaN x gives a NaN r and so a NaN result.  (A `/ 2` or an explicit NaN test here
  // stopped GCC 12 from vectorizing the loop.)
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof(s1));
  std::memcpy(&s2, &b2, sizeof(s2));
  return (p * s1) * s2;
}
inline double vexp(double x) { return std::exp(x); }

// Per-token loops run over blocks of kBlk tokens with float/int per-lane sums, added into double
// accumulators block by block, so long sequences do not drift.
constexpr int64_t kBlk = 256;

// Chunk or sequence ratio with a chunk/sequence (or no) mismatch weight: ratio, clip decision,
// weight and gradient are the chunk's constants, so the token loop only counts, sums the masked
// per-token terms (approx_kl, entropy, logp for TOPR) and writes the constant gradient; the
// metric sums are the counts times those constants.
template <bool Topr, typename in_t, typename idx_t, typename T>
double chunk_tokens_const(const Inputs<in_t, idx_t>& in, const Opts<T>& o, int64_t b, int64_t e, T A,
                          const SegRatio<T>& cr, const Weight<T>& cw, T coef, T* __restrict gout, Acc<T>& acc) {
  using L = Load<T>;
  const idx_t* __restrict cid = in.chunk_ids;
  const bool has_ent = in.entropy != nullptr;
  const in_t* __restrict lpp = in.logp;
  const in_t* __restrict oldp = in.old_logp;
  const in_t* __restrict entp = has_ent ? in.entropy : in.logp;  // stand-in pointer, masked out below
  const T clamp = o.clamp;
  const bool has_clamp = o.has_clamp;
  const T nA = -A, r = cr.r, w = cw.w;
  T pg = T(0), own = T(0), g = T(0), v = T(1);  // pg: PPO's per-token surrogate (TOPR: pg = nA v lp)
  bool clipped, dual = false;
  if (!Topr) {
    const PPOTerm<T> t = ppo_clip(A, r, o);
    pg = t.pg;
    clipped = t.clipped;
    dual = t.dual;
    g = coef * (w * t.dpg_dr);
  } else {
    v = A >= T(0) ? T(1) : minv(r, T(1));
    clipped = A < T(0) && r > T(1);
    own = coef * (w * (nA * v));
  }
  double s_akl = 0, s_ent = 0, s_lp = 0;
  int64_t n_tr = 0;
  for (int64_t b0 = b; b0 < e; b0 += kBlk) {
    const int64_t b1 = std::min(e, b0 + kBlk);
    T f_akl = 0, f_ent = 0, f_lp = 0;
    int i_n = 0;
#pragma omp simd reduction(+ : f_akl, f_ent, f_lp, i_n)
    for (int64_t u = b0; u < b1; ++u) {
      const bool m = cid[u] >= 0;
      const T lp = L::from(lpp[u]);
      const T d = lp - L::from(oldp[u]);
      const T dc = has_clamp ? clampv(d, -clamp, clamp) : d;
      const T akl = vexp(dc) - T(1) - dc;
      const T ent = L::from(entp[u]);  // unconditional load: a conditional one blocks vectorizing
      f_akl += m ? akl : T(0);
      f_ent += m ? ent : T(0);
      f_lp += m ? lp : T(0);
      i_n += m ? 1 : 0;
      gout[u] = m ? own : T(0);
    }
    s_akl += f_akl;
    s_ent += has_ent ? static_cast<double>(f_ent) : 0.0;
    s_lp += f_lp;
    n_tr += i_n;
  }
  const double n = static_cast<double>(n_tr);
  const double ent_c = o.entropy_term ? static_cast<double>(o.ent_coef) : 0.0;
  const double s_pg = Topr ? static_cast<double>(w * (nA * v)) * s_lp : n * static_cast<double>(w * pg);
  acc.v[kPClip] += clipped ? n : 0.0;
  acc.v[kPDual] += dual ? n : 0.0;
  acc.v[kPAltered] += cw.altered ? n : 0.0;
  acc.v[kPApproxKL] += s_akl;
  acc.v[kPRatioSum] += n * static_cast<double>(r);
  acc.v[kPRatioMax] = maxv(acc.v[kPRatioMax], n_tr ? static_cast<double>(r) : -INFINITY);
  acc.v[kPAdvNonzero] += A != T(0) ? n : 0.0;
  acc.v[kPKept] += w > T(0) ? n : 0.0;
  acc.v[kPPg] += s_pg;
  acc.v[kPLoss] += static_cast<double>(coef) * (s_pg - ent_c * s_ent);
  acc.v[kPEnt] += s_ent;
  acc.v[kPNTrained] += n;
  return n * static_cast<double>(g);
}

// The tokens [b, e) of one chunk.  Blocks of kBlk tokens run a SIMD loop with per-lane float sums
// and int counts (8 floats per AVX2 register; double sums there cost a conversion per term and
// halved the width), and each block's sums are added into double accumulators, so long
// sequences do not drift.
template <bool TokRatio, bool TokMismatch, bool Topr, typename in_t, typename idx_t, typename T>
double chunk_tokens(const Inputs<in_t, idx_t>& in, const Opts<T>& o, int64_t b, int64_t e, T A, const SegRatio<T>& cr,
                    const Weight<T>& cw, T coef, T* grad, Acc<T>& acc) {
  using L = Load<T>;
  const idx_t* __restrict cid = in.chunk_ids;
  const bool has_ent = in.entropy != nullptr;
  const in_t* __restrict lpp = in.logp;
  const in_t* __restrict oldp = in.old_logp;
  const in_t* __restrict entp = has_ent ? in.entropy : in.logp;  // stand-in pointer, masked out below
  const in_t* __restrict rollp = TokMismatch ? in.rollout_logp : in.logp;
  const T nA = -A;
  const T ent_c = o.entropy_term ? o.ent_coef : T(0);
  const T lo = o.lo, hi = o.hi, clamp = o.clamp, dual_pg = nA * o.dual_c;
  const bool has_clamp = o.has_clamp, has_dual = o.has_dual;
  const Opts<T> oc = o;  // a local copy: the loop's stores cannot alias it
  const T cr_r = cr.r, cr_gate = cr.gate, cw_w = cw.w;
  const int cw_alt = cw.altered ? 1 : 0;
  std::vector<T> scratch(grad ? 0 : static_cast<size_t>(e - b));  // no-grad calls: a throwaway target
  T* gout = grad ? grad : scratch.data() - b;
  if constexpr (!TokRatio && !TokMismatch) {
    return chunk_tokens_const<Topr>(in, o, b, e, A, cr, cw, coef, gout, acc);
  }
  double s_akl = 0, s_r = 0, s_pg = 0, s_loss = 0, s_ent = 0, s_g = 0;
  int64_t n_clip = 0, n_dual = 0, n_alt = 0, n_kept = 0, n_tr = 0;
  T f_max = -INFINITY;
  for (int64_t b0 = b; b0 < e; b0 += kBlk) {
    const int64_t b1 = std::min(e, b0 + kBlk);
    T f_akl = 0, f_r = 0, f_pg = 0, f_loss = 0, f_ent = 0, f_g = 0;
    int i_clip = 0, i_dual = 0, i_alt = 0, i_kept = 0, i_n = 0;
    // exp of the block's clamped log-ratios first, in a loop of its own: GCC 12 vectorizes it
    // alone but gives up on the whole body when it is inlined there
    T ebuf[kBlk];
#pragma omp simd
    for (int64_t u = b0; u < b1; ++u) {
      const T d = L::from(lpp[u]) - L::from(oldp[u]);
      ebuf[u - b0] = vexp(has_clamp ? clampv(d, -clamp, clamp) : d);
    }
#pragma omp simd reduction(+ : f_akl, f_r, f_pg, f_loss, f_ent, f_g, i_clip, i_dual, i_alt, i_kept, i_n) \
    reduction(max : f_max)
    for (int64_t u = b0; u < b1; ++u) {
      const bool m = cid[u] >= 0;
      const T lp = L::from(lpp[u]), old = L::from(oldp[u]);
      const T d = lp - old;
      const T dc = has_clamp ? clampv(d, -clamp, clamp) : d;
      const T ed = ebuf[u - b0];
      const T akl = ed - T(1) - dc;
      T r = cr_r, gate = cr_gate;
      if (TokRatio) {
        r = ed;
        gate = (!has_clamp || (d >= -clamp && d <= clamp)) ? T(1) : T(0);
      }
      T w = cw_w;
      bool alt = cw_alt != 0;
      if (TokMismatch) {  // mismatch_weight with the vectorizable exp
        const Weight<T> wt = mismatch_from_ratio(vexp(oc.clamp_lr(old - L::from(rollp[u]))), oc);
        w = wt.w;
        alt = wt.altered;
      }
      T pg, own, g;
      bool clipped, dual = false;
      if (!Topr) {
        // ppo_clip written out: through the helper's struct GCC 12 no longer vectorizes this loop
        const T pg1 = nA * r, pg2 = nA * clampv(r, lo, hi);
        clipped = pg2 > pg1;
        pg = clipped ? pg2 : pg1;
        T dpg = clipped ? ((r >= lo && r <= hi) ? nA : T(0)) : nA;
        dual = has_dual && A < T(0) && pg > dual_pg;  // no branch: keeps the loop vectorizable
        pg = dual ? dual_pg : pg;
        dpg = dual ? T(0) : dpg;
        g = coef * (w * dpg);
        own = TokRatio ? g * r * gate : T(0);
      } else {
        const T v = A >= T(0) ? T(1) : minv(r, T(1));
        pg = (nA * v) * lp;
        clipped = A < T(0) && r > T(1);
        own = coef * (w * (nA * v));
        g = T(0);
      }
      const T ent_raw = L::from(entp[u]);  // unconditional load (a valid stand-in without entropy):
      const T ent = has_ent ? ent_raw : T(0);  // a conditional one blocked vectorization
      const T wpg = w * pg;
      const T tok = wpg - ent_c * ent;
      i_clip += (m && clipped) ? 1 : 0;
      i_dual += (m && dual) ? 1 : 0;
      i_alt += (m && alt) ? 1 : 0;
      f_akl += m ? akl : T(0);
      f_r += m ? r : T(0);
      const T rm = m ? r : T(-INFINITY);
      f_max = rm > f_max ? rm : f_max;
      i_kept += (m && w > T(0)) ? 1 : 0;
      f_pg += m ? wpg : T(0);
      f_loss += m ? coef * tok : T(0);
      f_ent += m ? ent : T(0);
      i_n += m ? 1 : 0;
      f_g += m ? g : T(0);
      gout[u] = m ? own : T(0);
    }
    s_akl += f_akl;
    s_r += f_r;
    s_pg += f_pg;
    s_loss += f_loss;
    s_ent += f_ent;
    s_g += f_g;
    n_clip += i_clip;
    n_dual += i_dual;
    n_alt += i_alt;
    n_kept += i_kept;
    n_tr += i_n;
  }
  const double s_n = static_cast<double>(n_tr);
  acc.v[kPClip] += static_cast<double>(n_clip);
  acc.v[kPDual] += static_cast<double>(n_dual);
  acc.v[kPAltered] += static_cast<double>(n_alt);
  acc.v[kPApproxKL] += s_akl;
  acc.v[kPRatioSum] += s_r;
  acc.v[kPRatioMax] = maxv(acc.v[kPRatioMax], n_tr ? static_cast<double>(f_max) : -INFINITY);
  acc.v[kPAdvNonzero] += A != T(0) ? s_n : 0.0;
  acc.v[kPKept] += static_cast<double>(n_kept);
  acc.v[kPPg] += s_pg;
  acc.v[kPLoss] += s_loss;
  acc.v[kPEnt] += s_ent;
  acc.v[kPNTrained] += s_n;
  return s_g;
}

template <typename in_t, typename idx_t, typename T>
using ChunkFn = double (*)(const Inputs<in_t, idx_t>&, const Opts<T>&, int64_t, int64_t, T, const SegRatio<T>&,
                      const Weight<T>&, T, T*, Acc<T>&);

template <typename in_t, typename idx_t, typename T>
ChunkFn<in_t, idx_t, T> pick_chunk_fn(const Opts<T>& o) {
  const bool tr = o.ratio_level == kToken, tm = o.mismatch_level == kToken, topr = o.surrogate == kTOPR;
  static const ChunkFn<in_t, idx_t, T> table[8] = {
      chunk_tokens<false, false, false, in_t, idx_t, T>, chunk_tokens<false, false, true, in_t, idx_t, T>,
      chunk_tokens<false, true, false, in_t, idx_t, T>,  chunk_tokens<false, true, true, in_t, idx_t, T>,
      chunk_tokens<true, false, false, in_t, idx_t, T>,  chunk_tokens<true, false, true, in_t, idx_t, T>,
      chunk_tokens<true, true, false, in_t, idx_t, T>,   chunk_tokens<true, true, true, in_t, idx_t, T>,
  };
  return table[(tr ? 4 : 0) + (tm ? 2 : 0) + (topr ? 1 : 0)];
}

template <typename in_t, typename idx_t, typename T>
void process_sequence_fast(const Inputs<in_t, idx_t>& in, const Opts<T>& o, ChunkFn<in_t, idx_t, T> chunk_fn,
                           int64_t s, T adv_s, T* grad, Acc<T>& acc, T* coef_out, std::vector<ChunkSpan<T>>& spans) {
  using L = Load<T>;
  const int64_t b = in.cu_seqlens[s], e = in.cu_seqlens[s + 1];
  const idx_t* cid = in.chunk_ids;
  // structure: chunk extents (untrained tokens outside them get grad 0 here)
  spans.clear();
  for (int64_t t = b; t < e;) {
    const idx_t c = cid[t];
    if (c < 0) {
      if (grad) grad[t] = T(0);
      ++t;
      continue;
    }
    int64_t ce = t + 1;
    while (ce < e && cid[ce] <= c) ++ce;
    spans.push_back({t, ce, 0, T(0), T(0)});
    t = ce;
  }
  const int64_t K = static_cast<int64_t>(spans.size());
  // segment sums: sequential fp32 in token order, bitwise what the reference's index_add does
  const bool want_m = o.mismatch_level == kChunk || o.mismatch_level == kSequence;
  int64_t n_s = 0;
  T sd = T(0), smd = T(0);
  const bool want_sums = want_m || o.ratio_level != kToken || o.loss_agg == kSeqMeanTokenMean;
  for (auto& sp : spans) {
    if (!want_sums) break;
    T a = T(0), m = T(0), n = T(0);
    if (want_m) {
      for (int64_t u = sp.b; u < sp.e; ++u) {
        const bool tr = cid[u] >= 0;
        const T old = L::from(in.old_logp[u]);
        a += tr ? L::from(in.logp[u]) - old : T(0);
        m += tr ? old - L::from(in.rollout_logp[u]) : T(0);
        n += tr ? T(1) : T(0);
      }
    } else {
      for (int64_t u = sp.b; u < sp.e; ++u) {
        const bool tr = cid[u] >= 0;
        a += tr ? L::from(in.logp[u]) - L::from(in.old_logp[u]) : T(0);
        n += tr ? T(1) : T(0);
      }
    }
    sp.sd = a;
    sp.sm = m;
    sp.n = static_cast<int64_t>(n);
    n_s += sp.n;
    sd += a;
    smd += m;
  }
  const T coef = (o.loss_agg == kSeqMeanTokenMean && n_s > 0) ? T(1) / static_cast<T>(n_s) : T(1);
  if (coef_out) *coef_out = coef;
  SegRatio<T> seq_r{T(0), T(1), T(1)};
  Weight<T> seq_w{T(1), false};
  if (o.ratio_level == kSequence && n_s > 0) seq_r = seg_ratio(sd / static_cast<T>(n_s), o);
  if (o.mismatch_level == kSequence && n_s > 0) seq_w = mismatch_weight(smd / static_cast<T>(n_s), o);
  const bool ppo = o.surrogate == kPPOClip;
  double G_seq = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const ChunkSpan<T>& sp = spans[k];
    const T A = chunk_advantage(adv_s, K - 1 - k, o);
    const SegRatio<T> cr = o.ratio_level == kChunk ? seg_ratio(sp.sd / static_cast<T>(sp.n), o) : seq_r;
    const Weight<T> cw = o.mismatch_level == kChunk ? mismatch_weight(sp.sm / static_cast<T>(sp.n), o) : seq_w;
    const double G = chunk_fn(in, o, sp.b, sp.e, A, cr, cw, coef, grad, acc);
    if (ppo && o.ratio_level == kChunk && grad) {
      const T f = static_cast<T>(G / static_cast<double>(sp.n)) * cr.r * cr.gate;
#pragma omp simd
      for (int64_t u = sp.b; u < sp.e; ++u) grad[u] += cid[u] >= 0 ? f : T(0);
    }
    G_seq += G;
  }
  if (ppo && o.ratio_level == kSequence && grad && n_s > 0) {
    const T f = static_cast<T>(G_seq / static_cast<double>(n_s)) * seq_r.r * seq_r.gate;
    for (const auto& sp : spans) {
#pragma omp simd
      for (int64_t u = sp.b; u < sp.e; ++u) grad[u] += cid[u] >= 0 ? f : T(0);
    }
  }
}

template <typename in_t, typename idx_t, typename T>
void run(const Inputs<in_t, idx_t>& in, const AdvIn<T>& adv, int64_t N, const int64_t* io, const double* fo, T* grad,
         T* loss_out, T* stats, T* seq_coef) {
  const Opts<T> o = Opts<T>::make(io, fo);

  std::vector<double> part(static_cast<size_t>(N) * kNumPartials);
  // fast path unless a KL term is on; float64 (gradcheck) keeps the serial reference-order path
  const bool fast = o.kl == kKLOff && sizeof(T) == sizeof(float);
  const ChunkFn<in_t, idx_t, T> chunk_fn = pick_chunk_fn<in_t, idx_t, T>(o);
  // small packs stay on one thread: a parallel region costs more than it saves
  const int64_t T_tok = in.cu_seqlens[N];
  const int nthreads = T_tok < (1 << 14) ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<ChunkSpan<T>> spans;
#pragma omp for schedule(dynamic, 4)
    for (int64_t s = 0; s < N; ++s) {
      Acc<T> acc;
      acc.zero();
      const T adv_s = adv.of(s);  // given, or the group estimator computed here (in-pass)
      if (fast)
        process_sequence_fast(in, o, chunk_fn, s, adv_s, grad, acc, seq_coef + s, spans);
      else
        process_sequence(in, o, s, adv_s, grad, acc, seq_coef + s);
      std::copy(acc.v, acc.v + kNumPartials, part.data() + s * kNumPartials);
    }
  }

  // fixed-order reduction, in double
  double sum[kNumPartials] = {0};
  double rmax = -INFINITY, S = 0, max_ns = 0;
  for (int64_t s = 0; s < N; ++s) {
    const double* p = part.data() + s * kNumPartials;
    for (int i = 0; i < kNumPartials; ++i)
      if (i != kPRatioMax) sum[i] += p[i];
    const double ns = p[kPNTrained];
    if (ns > 0) {
      rmax = std::max(rmax, p[kPRatioMax]);
      S += 1;
      max_ns = std::max(max_ns, ns);
    }
  }
  const double n_tr = sum[kPNTrained];
  const double D = denominator(o.loss_agg, n_tr, S, max_ns, io[kIHasAggConstant] != 0, fo[kFAggConstant],
                               io[kIHasNormalizer] != 0, fo[kFNormalizer]);
  const double nf = std::max(n_tr, 1.0);
  *loss_out = static_cast<T>(n_tr > 0 ? sum[kPLoss] / D : 0.0);
  stats[kSClipFrac] = static_cast<T>(sum[kPClip] / nf);
  stats[kSDualClipFrac] = static_cast<T>(sum[kPDual] / nf);
  stats[kSMismatchFrac] = static_cast<T>(sum[kPAltered] / nf);
  stats[kSApproxKL] = static_cast<T>(sum[kPApproxKL] / nf);
  stats[kSRatioMean] = static_cast<T>(sum[kPRatioSum] / nf);
  stats[kSRatioMax] = static_cast<T>(n_tr > 0 ? rmax : 0.0);
  stats[kSAdvNonzeroFrac] = static_cast<T>(sum[kPAdvNonzero] / nf);
  stats[kSTokensKept] = static_cast<T>(sum[kPKept]);
  stats[kSPgLoss] = static_cast<T>(sum[kPPg] / nf);
  stats[kSKLMean] = static_cast<T>(sum[kPKL] / nf);
  stats[kSEntropyMean] = static_cast<T>(sum[kPEnt] / nf);
  stats[kSInvD] = static_cast<T>(1.0 / D);
}

const char* kOp = "arl::policy_loss";

void check_token(const c10::optional<at::Tensor>& x, const char* name, const at::Tensor& logp, bool required) {
  if (!x.has_value() || !x->defined()) {
    TORCH_CHECK_VALUE(!required, kOp, ": ", name, " is required by the options");
    return;
  }
  TORCH_CHECK_VALUE(x->dim() == 1 && x->numel() == logp.numel(), kOp, ": ", name, " must be [T] like logp");
  TORCH_CHECK_VALUE(x->scalar_type() == logp.scalar_type(), kOp, ": ", name, " dtype ", x->scalar_type(),
                    " differs from logp ", logp.scalar_type());
  TORCH_CHECK_VALUE(x->is_contiguous() && x->device().is_cpu(), kOp, ": ", name, " must be contiguous on CPU");
}

bool given(const c10::optional<at::Tensor>& x) { return x.has_value() && x->defined(); }

// Either the given advantages [N] of the compute dtype, or the in-pass inputs: float64 rewards [N],
// int64 group rows [N] inside the float64 [G, 4] table (checked here: the op indexes the table).
void check_advantages(const c10::optional<at::Tensor>& adv, const c10::optional<at::Tensor>& rew,
                      const c10::optional<at::Tensor>& gidx, const c10::optional<at::Tensor>& gstats, int64_t est,
                      int64_t N, at::ScalarType cdt) {
  auto vec = [&](const c10::optional<at::Tensor>& x, const char* name, at::ScalarType dt) {
    TORCH_CHECK_VALUE(given(x), kOp, ": ", name, " is required (", est == kAdvGiven ? "advantages given" : "in-pass",
                      ")");
    TORCH_CHECK_VALUE(x->scalar_type() == dt && x->is_contiguous() && x->dim() == 1 && x->numel() == N &&
                          x->device().is_cpu(), kOp, ": ", name, " must be contiguous [N] of dtype ", dt, " on CPU");
  };
  if (est == kAdvGiven) {
    vec(adv, "advantages", cdt);
    return;
  }
  TORCH_CHECK_VALUE(est == kGRPO || est == kDrGRPO || est == kRLOO, kOp, ": unknown adv_estimator code ", est);
  vec(rew, "rewards", at::kDouble);
  vec(gidx, "group_index", at::kLong);
  TORCH_CHECK_VALUE(given(gstats) && gstats->scalar_type() == at::kDouble && gstats->dim() == 2 &&
                        gstats->size(1) == kNumGroupStats && gstats->is_contiguous() && gstats->device().is_cpu(),
                    kOp, ": group_stats must be contiguous float64 [G, ", int(kNumGroupStats), "] on CPU");
  const int64_t G = gstats->size(0);
  const int64_t* g = gidx->data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK_VALUE(g[i] >= 0 && g[i] < G, kOp, ": group_index ", g[i], " at ", i, " is outside the ", G, " groups");
}

template <typename in_t>
const in_t* ptr_or_null(const c10::optional<at::Tensor>& x) {
  return (x.has_value() && x->defined()) ? reinterpret_cast<const in_t*>(x->data_ptr()) : nullptr;
}

template <typename in_t, typename idx_t, typename T>
void dispatch_run(const at::Tensor& logp, const at::Tensor& old, const c10::optional<at::Tensor>& roll,
                  const c10::optional<at::Tensor>& ref, const c10::optional<at::Tensor>& ent,
                  const c10::optional<at::Tensor>& adv, const c10::optional<at::Tensor>& rew,
                  const c10::optional<at::Tensor>& gidx, const c10::optional<at::Tensor>& gstats,
                  const at::Tensor& cu, const at::Tensor& cid,
                  const int64_t* io, const double* fo, at::Tensor& grad, at::Tensor& loss, at::Tensor& stats,
                  at::Tensor& coef) {
  Inputs<in_t, idx_t> in;
  in.logp = reinterpret_cast<const in_t*>(logp.data_ptr());
  in.old_logp = reinterpret_cast<const in_t*>(old.data_ptr());
  in.rollout_logp = ptr_or_null<in_t>(roll);
  in.ref_logp = ptr_or_null<in_t>(ref);
  in.entropy = ptr_or_null<in_t>(ent);
  in.chunk_ids = cid.data_ptr<idx_t>();
  in.cu_seqlens = cu.data_ptr<int64_t>();
  AdvIn<T> a;
  a.est = static_cast<int>(io[kIAdvEstimator]);
  a.eps = fo[kFAdvEps];
  a.adv = a.est == kAdvGiven ? adv->data_ptr<T>() : nullptr;
  a.rewards = a.est == kAdvGiven ? nullptr : rew->data_ptr<double>();
  a.group = a.est == kAdvGiven ? nullptr : gidx->data_ptr<int64_t>();
  a.stats = a.est == kAdvGiven ? nullptr : gstats->data_ptr<double>();
  a.n_groups = a.est == kAdvGiven ? 0 : gstats->size(0);
  run<in_t, idx_t, T>(in, a, cu.numel() - 1, io, fo,
                      grad.defined() && grad.numel() ? grad.data_ptr<T>() : nullptr, loss.data_ptr<T>(),
                      stats.data_ptr<T>(), coef.data_ptr<T>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cpu(
    const at::Tensor& logp, const at::Tensor& old_logp, const c10::optional<at::Tensor>& rollout_logp,
    const c10::optional<at::Tensor>& ref_logp, const c10::optional<at::Tensor>& entropy,
    const c10::optional<at::Tensor>& advantages, const at::Tensor& cu_seqlens, const at::Tensor& chunk_ids,
    at::IntArrayRef iopts, at::ArrayRef<double> fopts, bool need_grad, const c10::optional<at::Tensor>& rewards,
    const c10::optional<at::Tensor>& group_index, const c10::optional<at::Tensor>& group_stats) {
  TORCH_CHECK_VALUE(iopts.size() == kINumIOpts, kOp, ": iopts must have ", int(kINumIOpts), " entries");
  TORCH_CHECK_VALUE(fopts.size() == kFNumFOpts, kOp, ": fopts must have ", int(kFNumFOpts), " entries");
  const auto dt = logp.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16, kOp,
                    ": logp must be float32, float64 or bfloat16, got ", dt);
  TORCH_CHECK_VALUE(logp.dim() == 1 && logp.is_contiguous() && logp.device().is_cpu(), kOp,
                    ": logp must be a contiguous 1-D CPU tensor");
  const int64_t T = logp.numel();
  check_token(old_logp, "old_logp", logp, true);
  check_token(rollout_logp, "rollout_logp", logp, iopts[kIMismatchLevel] != kNoLevel);
  check_token(ref_logp, "ref_logp", logp, iopts[kIKL] != kKLOff);
  check_token(entropy, "entropy", logp, iopts[kIEntropyTerm] != 0);
  const auto cdt = dt == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK_VALUE(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() && cu_seqlens.dim() == 1 &&
                        cu_seqlens.device().is_cpu(), kOp, ": cu_seqlens must be contiguous int64 [N+1] on CPU");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK_VALUE(N > 0, kOp, ": empty batch (0 sequences)");
  check_advantages(advantages, rewards, group_index, group_stats, iopts[kIAdvEstimator], N, cdt);
  TORCH_CHECK_VALUE(
      (chunk_ids.scalar_type() == at::kInt || chunk_ids.scalar_type() == at::kLong) && chunk_ids.is_contiguous() &&
          chunk_ids.numel() == T, kOp, ": chunk_ids must be contiguous int32/int64 [T]");
  // O(N) bounds check so that bad cu_seqlens can never index out of range, validation or not
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[N] == T, kOp, ": cu_seqlens must start at 0 and end at T=", T);
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK_VALUE(cu[i + 1] >= cu[i], kOp, ": cu_seqlens decreases at index ", i + 1);

  auto fopt = logp.options().dtype(cdt);
  at::Tensor grad = need_grad ? at::empty({T}, fopt) : at::empty({0}, fopt);
  at::Tensor loss = at::empty({}, fopt);
  at::Tensor stats = at::empty({kNumStats}, fopt);
  at::Tensor coef = at::empty({N}, fopt);
  const int64_t* io = iopts.data();
  const double* fo = fopts.data();
  const bool i32 = chunk_ids.scalar_type() == at::kInt;

#define ARL_RUN(IN_T, IDX_T, ACC_T)                                                                         \
  dispatch_run<IN_T, IDX_T, ACC_T>(logp, old_logp, rollout_logp, ref_logp, entropy, advantages, rewards,       \
                                   group_index, group_stats, cu_seqlens, chunk_ids, io, fo, grad, loss, stats, coef)
  if (dt == at::kFloat) {
    if (i32) ARL_RUN(float, int32_t, float); else ARL_RUN(float, int64_t, float);
  } else if (dt == at::kDouble) {
    if (i32) ARL_RUN(double, int32_t, double); else ARL_RUN(double, int64_t, double);
  } else {
    if (i32) ARL_RUN(bf16, int32_t, float); else ARL_RUN(bf16, int64_t, float);
  }
#undef ARL_RUN
  return {loss, grad, stats, coef};
}

// Backward of the entropy term: dL/dH_t = scale * coef_s(t) on trained tokens, 0 elsewhere
// (scale = -entropy_coef * grad_out / D).  Computed here instead of saved: one T buffer less.
template <typename idx_t, typename T>
void entropy_grad_run(const idx_t* cid, const int64_t* cu, const T* coef, T scale, int64_t N, T* out) {
  const int nthreads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 8) num_threads(nthreads)
  for (int64_t s = 0; s < N; ++s) {
    const T v = scale * coef[s];
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) out[t] = cid[t] >= 0 ? v : T(0);
  }
}

at::Tensor policy_loss_entropy_grad_cpu(const at::Tensor& chunk_ids, const at::Tensor& cu_seqlens,
                                        const at::Tensor& seq_coef, double scale) {
  const int64_t N = seq_coef.numel();
  TORCH_CHECK_VALUE(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.numel() == N + 1 &&
                        cu_seqlens.is_contiguous(), "arl::policy_loss_entropy_grad: cu_seqlens must be int64 [N+1]");
  TORCH_CHECK_VALUE(chunk_ids.is_contiguous() && chunk_ids.dim() == 1, "arl::policy_loss_entropy_grad: chunk_ids");
  TORCH_CHECK_VALUE(cu_seqlens.data_ptr<int64_t>()[N] == chunk_ids.numel(),
                    "arl::policy_loss_entropy_grad: cu_seqlens must end at T");
  at::Tensor out = at::empty({chunk_ids.numel()}, seq_coef.options());
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const bool i32 = chunk_ids.scalar_type() == at::kInt;
  if (seq_coef.scalar_type() == at::kDouble) {
    if (i32) entropy_grad_run(chunk_ids.data_ptr<int32_t>(), cu, seq_coef.data_ptr<double>(), scale, N, out.data_ptr<double>());
    else entropy_grad_run(chunk_ids.data_ptr<int64_t>(), cu, seq_coef.data_ptr<double>(), scale, N, out.data_ptr<double>());
  } else {
    TORCH_CHECK_VALUE(seq_coef.scalar_type() == at::kFloat, "arl::policy_loss_entropy_grad: seq_coef float32/64");
    const float sc = static_cast<float>(scale);
    if (i32) entropy_grad_run(chunk_ids.data_ptr<int32_t>(), cu, seq_coef.data_ptr<float>(), sc, N, out.data_ptr<float>());
    else entropy_grad_run(chunk_ids.data_ptr<int64_t>(), cu, seq_coef.data_ptr<float>(), sc, N, out.data_ptr<float>());
  }
  return out;
}

}  // namespace
}  // namespace arl

TORCH_LIBRARY_FRAGMENT(arl, m) {
  m.def(
      "policy_loss(Tensor logp, Tensor old_logp, Tensor? rollout_logp, Tensor? ref_logp, Tensor? entropy, "
      "Tensor? advantages, Tensor cu_seqlens, Tensor chunk_ids, int[] iopts, float[] fopts, "
      "bool need_grad, Tensor? rewards=None, Tensor? group_index=None, Tensor? group_stats=None) "
      "-> (Tensor loss, Tensor grad_logp, Tensor stats, Tensor seq_coef)");
  m.def("policy_loss_entropy_grad(Tensor chunk_ids, Tensor cu_seqlens, Tensor seq_coef, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(arl, CPU, m) {
  m.impl("policy_loss", &arl::policy_loss_cpu);
  m.impl("policy_loss_entropy_grad", &arl::policy_loss_entropy_grad_cpu);
}
