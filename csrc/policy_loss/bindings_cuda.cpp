// Torch bindings of the raw-pointer CUDA kernels; compiled only when torch has CUDA and nvcc exists.
// The policy-loss ops have their own names and schemas (arl::policy_loss_cuda,
// arl::policy_loss_entropy_grad_cuda) so that this library does not depend on arl._C.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <cuda_runtime.h>

#include "policy_loss/core.h"
#include "policy_loss/cuda.h"

namespace arl {
namespace {
const char* kOp = "arl::policy_loss_cuda";

const void* token_ptr(const c10::optional<at::Tensor>& x, const char* name, const at::Tensor& logp, bool required) {
  if (!x.has_value() || !x->defined()) {
    TORCH_CHECK_VALUE(!required, kOp, ": ", name, " is required by the options");
    return nullptr;
  }
  TORCH_CHECK_VALUE(x->is_cuda() && x->device() == logp.device(), kOp, ": ", name, " must be on ", logp.device());
  TORCH_CHECK_VALUE(x->dim() == 1 && x->numel() == logp.numel() && x->is_contiguous(), kOp, ": ", name,
                    " must be contiguous [T] like logp");
  TORCH_CHECK_VALUE(x->scalar_type() == logp.scalar_type(), kOp, ": ", name, " dtype differs from logp");
  return x->data_ptr();
}

const void* vec_ptr(const c10::optional<at::Tensor>& x, const char* name, at::ScalarType dt, int64_t N,
                    const at::Tensor& logp) {
  TORCH_CHECK_VALUE(x.has_value() && x->defined(), kOp, ": ", name, " is required by the options");
  TORCH_CHECK_VALUE(x->scalar_type() == dt && x->dim() == 1 && x->numel() == N && x->is_contiguous() &&
                        x->device() == logp.device(),
                    kOp, ": ", name, " must be contiguous [N] of dtype ", dt, " on logp's device");
  return x->data_ptr();
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cuda(
    const at::Tensor& logp, const at::Tensor& old_logp, const c10::optional<at::Tensor>& rollout_logp,
    const c10::optional<at::Tensor>& ref_logp, const c10::optional<at::Tensor>& entropy,
    const c10::optional<at::Tensor>& advantages, const at::Tensor& cu_seqlens, const at::Tensor& chunk_ids,
    at::IntArrayRef iopts, at::ArrayRef<double> fopts, bool need_grad, const c10::optional<at::Tensor>& rewards,
    const c10::optional<at::Tensor>& group_index, const c10::optional<at::Tensor>& group_stats) {
  using namespace ploss;
  TORCH_CHECK_VALUE(iopts.size() == kINumIOpts && fopts.size() == kFNumFOpts, kOp, ": wrong number of options");
  const auto dt = logp.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16, kOp,
                    ": logp must be float32, float64 or bfloat16");
  TORCH_CHECK_VALUE(logp.is_cuda() && logp.dim() == 1 && logp.is_contiguous(), kOp,
                    ": logp must be a contiguous 1-D CUDA tensor");
  const int64_t T = logp.numel();
  TORCH_CHECK_VALUE(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 && cu_seqlens.is_contiguous() &&
                        cu_seqlens.device() == logp.device(),
                    kOp, ": cu_seqlens must be int64 [N+1] on logp's device");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK_VALUE(N > 0, kOp, ": empty batch (0 sequences)");
  const auto cdt = dt == at::kDouble ? at::kDouble : at::kFloat;
  const bool in_pass = iopts[kIAdvEstimator] != kAdvGiven;
  // given advantages, or the in-pass inputs (a row outside the table reads as NaN in the kernel)
  const void* adv_ptr = vec_ptr(in_pass ? rewards : advantages, in_pass ? "rewards" : "advantages",
                                in_pass ? at::kDouble : cdt, N, logp);
  const void* gidx_ptr = in_pass ? vec_ptr(group_index, "group_index", at::kLong, N, logp) : nullptr;
  int64_t G = 0;
  if (in_pass) {
    TORCH_CHECK_VALUE(iopts[kIAdvEstimator] == kGRPO || iopts[kIAdvEstimator] == kDrGRPO ||
                          iopts[kIAdvEstimator] == kRLOO, kOp, ": unknown adv_estimator code");
    TORCH_CHECK_VALUE(group_stats.has_value() && group_stats->defined() && group_stats->scalar_type() == at::kDouble &&
                          group_stats->dim() == 2 && group_stats->size(1) == kNumGroupStats &&
                          group_stats->is_contiguous() && group_stats->device() == logp.device(),
                      kOp, ": group_stats must be contiguous float64 [G, ", int(kNumGroupStats), "] on logp's device");
    G = group_stats->size(0);
  }
  TORCH_CHECK_VALUE((chunk_ids.scalar_type() == at::kInt || chunk_ids.scalar_type() == at::kLong) &&
                        chunk_ids.numel() == T && chunk_ids.is_contiguous() && chunk_ids.device() == logp.device(),
                    kOp, ": chunk_ids must be int32/int64 [T] on logp's device");

  const c10::cuda::CUDAGuard guard(logp.device());  // allocate and launch on logp's GPU
  const auto fopt = logp.options().dtype(cdt);
  at::Tensor grad = need_grad ? at::empty({T}, fopt) : at::empty({0}, fopt);
  at::Tensor loss = at::empty({}, fopt);
  at::Tensor stats = at::empty({kNumStats}, fopt);
  at::Tensor coef = at::empty({N}, fopt);
  at::Tensor part = at::empty({N * kNumPartials}, logp.options().dtype(at::kDouble));

  PolicyLossArgs a;
  a.dtype = dt == at::kFloat ? 0 : (dt == at::kDouble ? 1 : 2);
  a.idx64 = chunk_ids.scalar_type() == at::kLong;
  a.n_seq = N;
  a.logp = logp.data_ptr();
  a.old_logp = token_ptr(old_logp, "old_logp", logp, true);
  a.rollout_logp = token_ptr(rollout_logp, "rollout_logp", logp, iopts[kIMismatchLevel] != kNoLevel);
  a.ref_logp = token_ptr(ref_logp, "ref_logp", logp, iopts[kIKL] != kKLOff);
  a.entropy = token_ptr(entropy, "entropy", logp, iopts[kIEntropyTerm] != 0);
  a.chunk_ids = chunk_ids.data_ptr();
  a.advantages = in_pass ? nullptr : adv_ptr;
  a.rewards = in_pass ? static_cast<const double*>(adv_ptr) : nullptr;
  a.group_index = static_cast<const int64_t*>(gidx_ptr);
  a.group_stats = in_pass ? group_stats->data_ptr<double>() : nullptr;
  a.n_groups = G;
  a.cu_seqlens = cu_seqlens.data_ptr<int64_t>();
  a.iopts = iopts.data();
  a.fopts = fopts.data();
  a.grad = need_grad ? grad.data_ptr() : nullptr;
  a.loss = loss.data_ptr();
  a.stats = stats.data_ptr();
  a.seq_coef = coef.data_ptr();
  a.part_scratch = part.data_ptr();
  const cudaError_t err = policy_loss_cuda_launch(a, c10::cuda::getCurrentCUDAStream(logp.device().index()));
  TORCH_CHECK(err == cudaSuccess, kOp, ": ", cudaGetErrorString(err));
  return {loss, grad, stats, coef};
}

at::Tensor policy_loss_entropy_grad_cuda(const at::Tensor& chunk_ids, const at::Tensor& cu_seqlens,
                                         const at::Tensor& seq_coef, double scale) {
  const int64_t N = seq_coef.numel();
  TORCH_CHECK_VALUE(seq_coef.is_cuda() && (seq_coef.scalar_type() == at::kFloat || seq_coef.scalar_type() == at::kDouble),
                    "arl::policy_loss_entropy_grad_cuda: seq_coef must be a float32/64 CUDA tensor");
  TORCH_CHECK_VALUE(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.numel() == N + 1 && cu_seqlens.is_contiguous(),
                    "arl::policy_loss_entropy_grad_cuda: cu_seqlens must be int64 [N+1]");
  TORCH_CHECK_VALUE((chunk_ids.scalar_type() == at::kInt || chunk_ids.scalar_type() == at::kLong) &&
                        chunk_ids.is_contiguous(), "arl::policy_loss_entropy_grad_cuda: chunk_ids must be int32/int64");
  const c10::cuda::CUDAGuard guard(seq_coef.device());
  at::Tensor out = at::empty({chunk_ids.numel()}, seq_coef.options());
  const cudaError_t err = policy_loss_entropy_grad_launch(
      chunk_ids.data_ptr(), chunk_ids.scalar_type() == at::kLong, cu_seqlens.data_ptr<int64_t>(), seq_coef.data_ptr(),
      seq_coef.scalar_type() == at::kDouble, scale, N, out.data_ptr(),
      c10::cuda::getCurrentCUDAStream(seq_coef.device().index()));
  TORCH_CHECK(err == cudaSuccess, "arl::policy_loss_entropy_grad_cuda: ", cudaGetErrorString(err));
  return out;
}
}  // namespace arl

TORCH_LIBRARY_FRAGMENT(arl, m) {
  m.def(
      "policy_loss_cuda(Tensor logp, Tensor old_logp, Tensor? rollout_logp, Tensor? ref_logp, Tensor? entropy, "
      "Tensor? advantages, Tensor cu_seqlens, Tensor chunk_ids, int[] iopts, float[] fopts, "
      "bool need_grad, Tensor? rewards=None, Tensor? group_index=None, Tensor? group_stats=None) "
      "-> (Tensor loss, Tensor grad_logp, Tensor stats, Tensor seq_coef)");
  m.def("policy_loss_entropy_grad_cuda(Tensor chunk_ids, Tensor cu_seqlens, Tensor seq_coef, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(arl, CUDA, m) {
  m.impl("policy_loss_cuda", &arl::policy_loss_cuda);
  m.impl("policy_loss_entropy_grad_cuda", &arl::policy_loss_entropy_grad_cuda);
}
