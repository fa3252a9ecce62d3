// Torch bindings of the raw-pointer CUDA kernels; compiled only when torch has CUDA and nvcc exists.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <Python.h>
#include <torch/library.h>
#include <cuda_runtime.h>

namespace arl {
cudaError_t scale_launch(const float* x, float* y, float s, int64_t n, cudaStream_t stream);

at::Tensor scale_cuda(const at::Tensor& x, double s) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat, "arl::scale_cuda: expected a float32 CUDA tensor");
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  auto err = scale_launch(xc.data_ptr<float>(), y.data_ptr<float>(), static_cast<float>(s), xc.numel(),
                          at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "arl::scale_cuda: ", cudaGetErrorString(err));
  return y;
}
}  // namespace arl

TORCH_LIBRARY_IMPL(arl, CUDA, m) { m.impl("scale", &arl::scale_cuda); }

static struct PyModuleDef arl_cuda_module = {PyModuleDef_HEAD_INIT, "_C_cuda", "arl CUDA ops", -1, nullptr};
PyMODINIT_FUNC PyInit__C_cuda(void) { return PyModule_Create(&arl_cuda_module); }
