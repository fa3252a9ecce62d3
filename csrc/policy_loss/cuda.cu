// The fused policy loss on CUDA: raw pointers, stream passed in, no torch headers (bound as
// torch.ops.arl.policy_loss_cuda in bindings_cuda.cpp).  The math is csrc/policy_loss/core.h,
// the same functions the C++ CPU op runs; only the traversal is parallel:
//
//   (A_s is an input per sequence, computed before packing by arl/algo/advantages.py, or, in-pass,
//    the group estimator of the sequence's reward and its group's row of the step's table, evaluated
//    by the warp in double: core.h group_advantage)
//   1. one warp per sequence: lanes stride over the tokens of each chunk; chunk boundaries are
//      found with ballots; segment sums, G and the metric partials are warp-reduced with a fixed
//      xor butterfly, so the result does not depend on scheduling.  Writes the sequence's
//      partial sums to its own slot.
//   2. one block reduces the per-sequence slots in a fixed order and forms D, loss and metrics.
// No atomics anywhere: runs are bitwise reproducible.
#include <cuda_runtime.h>

#include <cstdint>

#include "policy_loss/core.h"
#include "policy_loss/cuda.h"

namespace arl {
namespace {

using namespace ploss;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;
constexpr int kReduceThreads = 256;

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  // xor butterfly: every lane ends with the same value (a + b == b + a in IEEE arithmetic)
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  for (int off = 16; off > 0; off >>= 1) v = maxv(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

// 1. one warp per sequence
template <typename in_t, typename idx_t, typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    sequence_kernel(Inputs<in_t, idx_t> in, Opts<T> o, int64_t N, AdvIn<T> adv, T* __restrict__ grad,
                    double* __restrict__ part, T* __restrict__ seq_coef) {
  using L = Load<T>;
  const int64_t s = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (s >= N) return;  // whole warps leave together
  const int64_t b = in.cu_seqlens[s], e = in.cu_seqlens[s + 1];
  const idx_t* cid = in.chunk_ids;
  const bool has_ent = in.entropy != nullptr;
  const bool ppo = o.surrogate == kPPOClip;
  const T adv_s = adv.of(s);  // given, or computed here from the step's group table (in-pass)

  // pass 1: trained count, chunk count (a chunk starts where an id exceeds every earlier id),
  // sequence-level sums
  int64_t n_s = 0, K = 0;
  T sd = T(0), smd = T(0);
  if (o.need_seq_pass) {
    idx_t carry = -1;
    for (int64_t base = b; base < e; base += 32) {
      const int64_t t = base + lane;
      const idx_t c = t < e ? cid[t] : idx_t(-1);
      idx_t m = c;  // inclusive max-scan over the tile
      for (int off = 1; off < 32; off <<= 1) {
        const idx_t y = __shfl_up_sync(kFull, m, off);
        if (lane >= off) m = maxv(m, y);
      }
      idx_t before = __shfl_up_sync(kFull, m, 1);
      before = maxv(lane == 0 ? idx_t(-1) : before, carry);
      const bool tr = c >= 0;
      n_s += __popc(__ballot_sync(kFull, tr));
      K += __popc(__ballot_sync(kFull, tr && c != before));
      if (tr && o.ratio_level == kSequence) sd += L::from(in.logp[t]) - L::from(in.old_logp[t]);
      if (tr && o.mismatch_level == kSequence) smd += L::from(in.old_logp[t]) - L::from(in.rollout_logp[t]);
      carry = maxv(carry, __shfl_sync(kFull, m, 31));
    }
    sd = warp_sum(sd);
    smd = warp_sum(smd);
  }
  const T coef = (o.loss_agg == kSeqMeanTokenMean && n_s > 0) ? T(1) / static_cast<T>(n_s) : T(1);
  if (lane == 0) seq_coef[s] = coef;
  SegRatio<T> seq_r{T(0), T(1), T(1)};
  Weight<T> seq_w{T(1), false};
  if (o.ratio_level == kSequence && n_s > 0) seq_r = seg_ratio(sd / static_cast<T>(n_s), o);
  if (o.mismatch_level == kSequence && n_s > 0) seq_w = mismatch_weight(smd / static_cast<T>(n_s), o);

  Acc<T> acc;
  acc.zero();
  T G_seq = T(0);  // this lane's share of the sequence-level G
  int64_t k = 0, pos = b;
  while (pos < e) {
    // next chunk start: first trained token at >= pos (untrained tokens on the way get grad 0)
    int64_t cs = e;
    for (int64_t base = pos; base < e; base += 32) {
      const int64_t t = base + lane;
      const bool tr = t < e && cid[t] >= 0;
      if (!tr && t < e && grad) grad[t] = T(0);
      const unsigned bal = __ballot_sync(kFull, tr);
      if (bal) {
        cs = base + __ffs(bal) - 1;
        break;
      }
    }
    if (cs >= e) break;
    const idx_t c = cid[cs];
    // chunk end: first token with an id above c (untrained tokens inside belong to the extent)
    int64_t ce = e;
    for (int64_t base = cs + 1; base < e; base += 32) {
      const int64_t t = base + lane;
      const unsigned bal = __ballot_sync(kFull, t < e && cid[t] > c);
      if (bal) {
        ce = base + __ffs(bal) - 1;
        break;
      }
    }
    const T A = chunk_advantage(adv_s, K - 1 - k, o);

    int64_t n_c = 0;
    SegRatio<T> ch_r = seq_r;
    Weight<T> ch_w = seq_w;
    if (o.ratio_level == kChunk || o.mismatch_level == kChunk) {
      T cd = T(0), cm = T(0);
      for (int64_t base = cs; base < ce; base += 32) {
        const int64_t t = base + lane;
        const bool tr = t < ce && cid[t] >= 0;
        n_c += __popc(__ballot_sync(kFull, tr));
        if (tr) {
          const T lp = L::from(in.logp[t]), old = L::from(in.old_logp[t]);
          cd += lp - old;
          if (o.mismatch_level == kChunk) cm += old - L::from(in.rollout_logp[t]);
        }
      }
      cd = warp_sum(cd);
      cm = warp_sum(cm);
      if (o.ratio_level == kChunk) ch_r = seg_ratio(cd / static_cast<T>(n_c), o);
      if (o.mismatch_level == kChunk) ch_w = mismatch_weight(cm / static_cast<T>(n_c), o);
    }

    T G = T(0);
    for (int64_t t = cs + lane; t < ce; t += 32) {
      if (cid[t] < 0) {
        if (grad) grad[t] = T(0);
        continue;
      }
      T g;
      const T own = trained_token(in, o, t, A, ch_r, ch_w, has_ent, ppo, coef, acc, &g);
      G += g;
      if (grad) grad[t] = own;
    }
    if (ppo && o.ratio_level == kChunk && grad) {
      // same lane -> token assignment as the pass above: each lane updates what it wrote
      const T f = warp_sum(G) * ch_r.r * ch_r.gate / static_cast<T>(n_c);
      for (int64_t t = cs + lane; t < ce; t += 32)
        if (cid[t] >= 0) grad[t] += f;
    }
    G_seq += G;
    ++k;
    pos = ce;
  }
  if (ppo && o.ratio_level == kSequence && grad && n_s > 0) {
    const T f = warp_sum(G_seq) * seq_r.r * seq_r.gate / static_cast<T>(n_s);
    __syncwarp();  // tokens were written by other lanes (per-chunk lane assignment)
    for (int64_t t = b + lane; t < e; t += 32)
      if (cid[t] >= 0) grad[t] += f;
  }
  double* p = part + s * kNumPartials;
  for (int i = 0; i < kNumPartials; ++i) {
    const double v = i == kPRatioMax ? warp_max(acc.v[i]) : warp_sum(acc.v[i]);
    if (lane == 0) p[i] = v;
  }
}

// 2. fixed-order reduction of the per-sequence slots (one block), then D, loss and the stats
struct Reduced {
  double v[kNumPartials];
  double S, max_ns;
};

template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    finalize_kernel(const double* __restrict__ part, int64_t N, int loss_agg,
                    int has_agg_constant, double agg_constant, int has_normalizer, double normalizer,
                    T* __restrict__ loss, T* __restrict__ stats) {
  __shared__ Reduced sh[kReduceThreads];
  Reduced r;
  for (int i = 0; i < kNumPartials; ++i) r.v[i] = 0.0;
  r.v[kPRatioMax] = -INFINITY;
  r.S = r.max_ns = 0.0;
  for (int64_t s = threadIdx.x; s < N; s += kReduceThreads) {  // fixed stride order per thread
    const double* p = part + s * kNumPartials;
    for (int i = 0; i < kNumPartials; ++i)
      if (i != kPRatioMax) r.v[i] += p[i];
    const double ns = p[kPNTrained];
    if (ns > 0) {
      r.v[kPRatioMax] = maxv(r.v[kPRatioMax], p[kPRatioMax]);
      r.S += 1.0;
      r.max_ns = maxv(r.max_ns, ns);
    }
  }
  sh[threadIdx.x] = r;
  __syncthreads();
  for (int half = kReduceThreads / 2; half > 0; half >>= 1) {  // fixed tree
    if (threadIdx.x < half) {
      Reduced& a = sh[threadIdx.x];
      const Reduced& c = sh[threadIdx.x + half];
      for (int i = 0; i < kNumPartials; ++i)
        a.v[i] = i == kPRatioMax ? maxv(a.v[i], c.v[i]) : a.v[i] + c.v[i];
      a.S += c.S;
      a.max_ns = maxv(a.max_ns, c.max_ns);
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const Reduced& t = sh[0];
  const double n_tr = t.v[kPNTrained];
  const double D = denominator(loss_agg, n_tr, t.S, t.max_ns, has_agg_constant != 0, agg_constant,
                               has_normalizer != 0, normalizer);
  const double nf = n_tr > 1.0 ? n_tr : 1.0;
  *loss = static_cast<T>(n_tr > 0 ? t.v[kPLoss] / D : 0.0);
  stats[kSClipFrac] = static_cast<T>(t.v[kPClip] / nf);
  stats[kSDualClipFrac] = static_cast<T>(t.v[kPDual] / nf);
  stats[kSMismatchFrac] = static_cast<T>(t.v[kPAltered] / nf);
  stats[kSApproxKL] = static_cast<T>(t.v[kPApproxKL] / nf);
  stats[kSRatioMean] = static_cast<T>(t.v[kPRatioSum] / nf);
  stats[kSRatioMax] = static_cast<T>(n_tr > 0 ? t.v[kPRatioMax] : 0.0);
  stats[kSAdvNonzeroFrac] = static_cast<T>(t.v[kPAdvNonzero] / nf);
  stats[kSTokensKept] = static_cast<T>(t.v[kPKept]);
  stats[kSPgLoss] = static_cast<T>(t.v[kPPg] / nf);
  stats[kSKLMean] = static_cast<T>(t.v[kPKL] / nf);
  stats[kSEntropyMean] = static_cast<T>(t.v[kPEnt] / nf);
  stats[kSInvD] = static_cast<T>(1.0 / D);
}

template <typename idx_t, typename T>
__global__ void entropy_grad_kernel(const idx_t* __restrict__ cid, const int64_t* __restrict__ cu,
                                    const T* __restrict__ coef, T scale, int64_t N, T* __restrict__ out) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  if (s >= N) return;
  const T v = scale * coef[s];
  for (int64_t t = cu[s] + (threadIdx.x & 31); t < cu[s + 1]; t += 32) out[t] = cid[t] >= 0 ? v : T(0);
}

template <typename in_t, typename idx_t, typename T>
cudaError_t launch(const PolicyLossArgs& a, cudaStream_t stream) {
  const Opts<T> o = Opts<T>::make(a.iopts, a.fopts);
  const int64_t N = a.n_seq;
  Inputs<in_t, idx_t> in;
  in.logp = static_cast<const in_t*>(a.logp);
  in.old_logp = static_cast<const in_t*>(a.old_logp);
  in.rollout_logp = static_cast<const in_t*>(a.rollout_logp);
  in.ref_logp = static_cast<const in_t*>(a.ref_logp);
  in.entropy = static_cast<const in_t*>(a.entropy);
  in.chunk_ids = static_cast<const idx_t*>(a.chunk_ids);
  in.cu_seqlens = a.cu_seqlens;
  AdvIn<T> adv;
  adv.est = static_cast<int>(a.iopts[kIAdvEstimator]);
  adv.eps = a.fopts[kFAdvEps];
  adv.adv = static_cast<const T*>(a.advantages);
  adv.rewards = a.rewards;
  adv.group = a.group_index;
  adv.stats = a.group_stats;
  adv.n_groups = a.n_groups;
  double* part = static_cast<double*>(a.part_scratch);
  const unsigned seq_blocks = static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  sequence_kernel<in_t, idx_t, T><<<seq_blocks, kWarpsPerBlock * 32, 0, stream>>>(
      in, o, N, adv, static_cast<T*>(a.grad), part, static_cast<T*>(a.seq_coef));
  finalize_kernel<T><<<1, kReduceThreads, 0, stream>>>(
      part, N, o.loss_agg, static_cast<int>(a.iopts[kIHasAggConstant]), a.fopts[kFAggConstant],
      static_cast<int>(a.iopts[kIHasNormalizer]), a.fopts[kFNormalizer], static_cast<T*>(a.loss),
      static_cast<T*>(a.stats));
  return cudaGetLastError();
}

}  // namespace

// Dtype codes: 0 float32, 1 float64, 2 bfloat16 (token inputs); compute dtype is float64 for
// float64 inputs and float32 otherwise (advantages, grad, loss, stats, seq_coef, scratch).
cudaError_t policy_loss_cuda_launch(const PolicyLossArgs& a, cudaStream_t stream) {
  if (a.n_seq <= 0) return cudaErrorInvalidValue;
  const bool i64 = a.idx64 != 0;
  switch (a.dtype) {
    case 0:
      return i64 ? launch<float, int64_t, float>(a, stream) : launch<float, int32_t, float>(a, stream);
    case 1:
      return i64 ? launch<double, int64_t, double>(a, stream) : launch<double, int32_t, double>(a, stream);
    case 2:
      return i64 ? launch<bf16, int64_t, float>(a, stream) : launch<bf16, int32_t, float>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t policy_loss_entropy_grad_launch(const void* chunk_ids, int idx64, const int64_t* cu, const void* coef,
                                            int is_double, double scale, int64_t N, void* out, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const int threads = kWarpsPerBlock * 32;
  if (is_double) {
    if (idx64)
      entropy_grad_kernel<int64_t, double><<<blocks, threads, 0, stream>>>(
          static_cast<const int64_t*>(chunk_ids), cu, static_cast<const double*>(coef), scale, N, static_cast<double*>(out));
    else
      entropy_grad_kernel<int32_t, double><<<blocks, threads, 0, stream>>>(
          static_cast<const int32_t*>(chunk_ids), cu, static_cast<const double*>(coef), scale, N, static_cast<double*>(out));
  } else {
    const float sc = static_cast<float>(scale);
    if (idx64)
      entropy_grad_kernel<int64_t, float><<<blocks, threads, 0, stream>>>(
          static_cast<const int64_t*>(chunk_ids), cu, static_cast<const float*>(coef), sc, N, static_cast<float*>(out));
    else
      entropy_grad_kernel<int32_t, float><<<blocks, threads, 0, stream>>>(
          static_cast<const int32_t*>(chunk_ids), cu, static_cast<const float*>(coef), sc, N, static_cast<float*>(out));
  }
  return cudaGetLastError();
}

}  // namespace arl
