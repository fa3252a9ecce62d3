// arl::policy_loss — the fused policy loss on CPU: one pass over the packed tokens gives the loss,
// the (unnormalized) dL/dlogp and every metric; arl/loss/cpu_backend.py wraps it in an
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
#include <numeric>
#include <vector>

#include "common/policy_loss_core.h"

namespace arl {
namespace {

using namespace ploss;

// Per-trajectory advantages (reference: group_advantages).  Groups by a stable sort of the ids, so
// each group's sums run in index order like torch's index_add.  Returns the zero-variance count.
template <typename T>
int64_t advantages_cpu(const T* rewards, const int64_t* gid, int64_t N, const Opts<T>& o, T* adv,
                       int64_t* n_groups) {
  std::vector<int64_t> order(N);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return gid[a] < gid[b]; });
  int64_t zero_var = 0, groups = 0;
  for (int64_t i = 0; i < N;) {
    int64_t j = i;
    while (j < N && gid[order[j]] == gid[order[i]]) ++j;
    T sum = T(0), mn = rewards[order[i]], mx = rewards[order[i]];
    for (int64_t q = i; q < j; ++q) {
      const T x = rewards[order[q]];
      sum += x;
      mn = std::min(mn, x);
      mx = std::max(mx, x);
    }
    const T cnt = static_cast<T>(j - i);
    const T mean = sum / cnt;
    T ss = T(0);
    for (int64_t q = i; q < j; ++q) {
      const T a = rewards[order[q]] - mean;
      ss += a * a;
    }
    const T sd = group_std(ss, cnt);
    const bool zv = mx == mn;
    zero_var += zv ? 1 : 0;
    ++groups;
    for (int64_t q = i; q < j; ++q) adv[order[q]] = finish_advantage(rewards[order[q]], mean, sd, zv, o);
    i = j;
  }
  *n_groups = groups;
  return zero_var;
}

template <typename in_t, typename idx_t, typename T>
void run(const Inputs<in_t, idx_t>& in, const T* rewards, const int64_t* gid, int64_t N, const int64_t* io,
         const double* fo, T* grad, T* loss_out, T* stats, T* seq_coef) {
  const Opts<T> o = Opts<T>::make(io, fo);
  std::vector<T> adv(N);
  int64_t n_groups = 0;
  const int64_t n_zero_var = advantages_cpu(rewards, gid, N, o, adv.data(), &n_groups);

  std::vector<T> part(static_cast<size_t>(N) * kNumPartials);
  const int nthreads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads)
  for (int64_t s = 0; s < N; ++s) {
    Acc<T> acc;
    acc.zero();
    process_sequence(in, o, s, adv[s], grad, acc, seq_coef + s);
    std::copy(acc.v, acc.v + kNumPartials, part.data() + s * kNumPartials);
  }

  // fixed-order reduction, in double
  double sum[kNumPartials] = {0};
  double rmax = -INFINITY, S = 0, max_ns = 0;
  for (int64_t s = 0; s < N; ++s) {
    const T* p = part.data() + s * kNumPartials;
    for (int i = 0; i < kNumPartials; ++i)
      if (i != kPRatioMax) sum[i] += static_cast<double>(p[i]);
    const double ns = static_cast<double>(p[kPNTrained]);
    if (ns > 0) {
      rmax = std::max(rmax, static_cast<double>(p[kPRatioMax]));
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
  stats[kSZeroVarGroupFrac] = static_cast<T>(static_cast<double>(n_zero_var) / static_cast<double>(n_groups));
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

template <typename in_t>
const in_t* ptr_or_null(const c10::optional<at::Tensor>& x) {
  return (x.has_value() && x->defined()) ? reinterpret_cast<const in_t*>(x->data_ptr()) : nullptr;
}

template <typename in_t, typename idx_t, typename T>
void dispatch_run(const at::Tensor& logp, const at::Tensor& old, const c10::optional<at::Tensor>& roll,
                  const c10::optional<at::Tensor>& ref, const c10::optional<at::Tensor>& ent,
                  const at::Tensor& rewards, const at::Tensor& gid, const at::Tensor& cu, const at::Tensor& cid,
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
  run<in_t, idx_t, T>(in, rewards.data_ptr<T>(), gid.data_ptr<int64_t>(), rewards.numel(), io, fo,
                      grad.defined() && grad.numel() ? grad.data_ptr<T>() : nullptr, loss.data_ptr<T>(),
                      stats.data_ptr<T>(), coef.data_ptr<T>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cpu(
    const at::Tensor& logp, const at::Tensor& old_logp, const c10::optional<at::Tensor>& rollout_logp,
    const c10::optional<at::Tensor>& ref_logp, const c10::optional<at::Tensor>& entropy, const at::Tensor& rewards,
    const at::Tensor& group_ids, const at::Tensor& cu_seqlens, const at::Tensor& chunk_ids, at::IntArrayRef iopts,
    at::ArrayRef<double> fopts, bool need_grad) {
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
  const int64_t N = rewards.numel();
  TORCH_CHECK_VALUE(N > 0, kOp, ": rewards is empty");
  TORCH_CHECK_VALUE(rewards.scalar_type() == cdt && rewards.is_contiguous() && rewards.dim() == 1, kOp,
                    ": rewards must be contiguous [N] of dtype ", cdt);
  TORCH_CHECK_VALUE(group_ids.scalar_type() == at::kLong && group_ids.is_contiguous() && group_ids.numel() == N,
                    kOp, ": group_ids must be contiguous int64 [N]");
  TORCH_CHECK_VALUE(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() &&
                        cu_seqlens.numel() == N + 1, kOp, ": cu_seqlens must be contiguous int64 [N+1]");
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

#define ARL_RUN(IN_T, IDX_T, ACC_T)                                                                        \
  dispatch_run<IN_T, IDX_T, ACC_T>(logp, old_logp, rollout_logp, ref_logp, entropy, rewards, group_ids,     \
                                   cu_seqlens, chunk_ids, io, fo, grad, loss, stats, coef)
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
      "Tensor rewards, Tensor group_ids, Tensor cu_seqlens, Tensor chunk_ids, int[] iopts, float[] fopts, "
      "bool need_grad) -> (Tensor loss, Tensor grad_logp, Tensor stats, Tensor seq_coef)");
  m.def("policy_loss_entropy_grad(Tensor chunk_ids, Tensor cu_seqlens, Tensor seq_coef, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(arl, CPU, m) {
  m.impl("policy_loss", &arl::policy_loss_cpu);
  m.impl("policy_loss_entropy_grad", &arl::policy_loss_entropy_grad_cpu);
}
