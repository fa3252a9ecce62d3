// Raw-pointer CUDA kernel (no torch headers): compile-checked by nvcc in CI for sm_80/sm_90 and
// bound as a torch op only on a CUDA build (see csrc/cuda/bindings.cpp).
#include <cuda_runtime.h>
#include <cstdint>

namespace arl {

__global__ void scale_kernel(const float* __restrict__ x, float* __restrict__ y, float s, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = x[i] * s;
}

cudaError_t scale_launch(const float* x, float* y, float s, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  scale_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(x, y, s, n);
  return cudaGetLastError();
}

}  // namespace arl
