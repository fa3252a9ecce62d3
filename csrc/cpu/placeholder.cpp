// Smallest possible op: proves the build, the registration and the import path.
// Light headers on purpose: <torch/extension.h> costs ~60 s of compile per file here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace arl {

at::Tensor scale_cpu(const at::Tensor& x, double s) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "arl::scale: expected float32, got ", x.scalar_type());
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  const float* src = xc.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  const int64_t n = xc.numel();
  const float f = static_cast<float>(s);
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * f;
  return y;
}

}  // namespace arl

TORCH_LIBRARY_FRAGMENT(arl, m) { m.def("scale(Tensor x, float s) -> Tensor"); }
TORCH_LIBRARY_IMPL(arl, CPU, m) { m.impl("scale", &arl::scale_cpu); }
