// Launch interface of cuda.cu, shared with bindings_cuda.cpp (no torch headers).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace arl {

// Device pointers unless noted.  Token arrays [T] of the input dtype (null when absent); advantages,
// grad, seq_coef [N] / [T] and loss, stats of the compute dtype (float64 for float64 input,
// float32 otherwise).  Scratch: part [N * ploss::kNumPartials] float64.  grad may be null (no
// gradient wanted).
struct PolicyLossArgs {
  int dtype;  // token inputs: 0 float32, 1 float64, 2 bfloat16
  int idx64;  // chunk_ids int64 (else int32)
  int64_t n_seq;
  const void *logp, *old_logp, *rollout_logp, *ref_logp, *entropy, *chunk_ids, *advantages;  // advantages: null in-pass
  // in-pass advantages (iopts[kIAdvEstimator] != kAdvGiven): float64 rewards [N], int64 group rows [N],
  // the step's float64 group table [n_groups, ploss::kNumGroupStats]
  const double* rewards;
  const int64_t* group_index;
  const double* group_stats;
  int64_t n_groups;
  const int64_t* cu_seqlens;
  const int64_t* iopts;  // host, ploss::kINumIOpts entries
  const double* fopts;   // host, ploss::kFNumFOpts entries
  void *grad, *loss, *stats, *seq_coef, *part_scratch;
};

cudaError_t policy_loss_cuda_launch(const PolicyLossArgs& args, cudaStream_t stream);
cudaError_t policy_loss_entropy_grad_launch(const void* chunk_ids, int idx64, const int64_t* cu_seqlens,
                                            const void* seq_coef, int is_double, double scale, int64_t n_seq,
                                            void* out, cudaStream_t stream);

}  // namespace arl
