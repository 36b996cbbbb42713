// LayerNorm forward and backward (fp32 statistics; bf16/fp16/fp32 I/O; weight
// and optional bias of x's dtype; hidden sizes 1..16384, any row count).
// The kernels and their launch geometry are in norm_kernels.cuh, shared with
// RMSNorm.
#include "norm_kernels.cuh"
#include "ops.h"

namespace p3d {

std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, double eps) {
  return norm_fwd<false>(x, weight, bias, eps, "layer_norm");
}

std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& mean, const at::Tensor& rstd,
                                       const at::Tensor& weight, bool has_bias,
                                       const std::optional<at::Tensor>& dresidual) {
  return norm_bwd<false>(dy, x, mean, rstd, weight, has_bias, dresidual, "layer_norm backward");
}

}  // namespace p3d
