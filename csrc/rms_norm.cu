// RMSNorm forward and backward (fp32 statistics; bf16/fp16/fp32 I/O; weight of
// x's dtype; hidden sizes 1..16384, any row count).  The kernels and their
// launch geometry are in norm_kernels.cuh, shared with LayerNorm.
#include "norm_kernels.cuh"
#include "ops.h"

namespace p3d {

std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_fwd<true>(x, weight, std::nullopt, eps, "rms_norm");
}

std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& rstd, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& dresidual) {
  return norm_bwd<true>(dy, x, at::Tensor(), rstd, weight, false, dresidual, "rms_norm backward");
}

}  // namespace p3d
