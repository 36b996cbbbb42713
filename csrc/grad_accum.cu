// Gradient-accumulation fusion (Megatron's gradient_accumulation_fusion):
//
//   main_grad[out, in] += grad_output[N, out]^T @ input[N, in]
//
// as ONE cuBLAS GEMM with beta = 1 writing the fp32 main_grad directly: no
// weight-gradient tensor is materialised and no separate add runs.  bf16/fp16
// operands use fp32 compute with an fp32 C (cublasGemmEx's mixed-precision
// path, tensor cores); fp32 operands use a plain fp32 GEMM with TF32 switched
// off for the call (torch's handle may have TF32 on).
//
// Layout: cuBLAS is column-major.  Row-major main_grad[out, in] is the
// column-major matrix C^T [in, out] (ld = in), and
//   C^T = input^T @ grad_output
// where row-major input [N, in] read column-major is [in, N] (op N, lda = row
// stride) and row-major grad_output [N, out] read column-major is [out, N],
// transposed (op T, ldb = row stride).  There is no custom kernel launch here;
// cuBLAS picks its own geometry.
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <limits>

#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

cudaDataType_t cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK(false, "wgrad_gemm_accum_fp32: unsupported dtype ", t);
  }
  return CUDA_R_32F;
}

void check_cublas(cublasStatus_t st, const char* what) {
  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "wgrad_gemm_accum_fp32: ", what, " failed with cuBLAS status ",
              static_cast<int>(st));
}

}  // namespace

void wgrad_gemm_accum_fp32(const at::Tensor& input, const at::Tensor& grad_output,
                           at::Tensor& main_grad) {
  TORCH_CHECK(input.is_cuda() && grad_output.is_cuda() && main_grad.is_cuda(),
              "wgrad_gemm_accum_fp32: all tensors must be on CUDA");
  TORCH_CHECK(input.dim() == 2 && grad_output.dim() == 2 && main_grad.dim() == 2,
              "wgrad_gemm_accum_fp32: expected 2-D input, grad_output and main_grad");
  const int64_t n = input.size(0), in = input.size(1), out = grad_output.size(1);
  TORCH_CHECK(grad_output.size(0) == n, "wgrad_gemm_accum_fp32: input has ", n,
              " rows but grad_output has ", grad_output.size(0));
  TORCH_CHECK(main_grad.size(0) == out && main_grad.size(1) == in,
              "wgrad_gemm_accum_fp32: main_grad must be [", out, ", ", in, "], got ", main_grad.sizes());
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat && main_grad.is_contiguous(),
              "wgrad_gemm_accum_fp32: main_grad must be a contiguous float32 tensor");
  TORCH_CHECK(input.scalar_type() == grad_output.scalar_type(),
              "wgrad_gemm_accum_fp32: input dtype ", input.scalar_type(), " differs from grad_output dtype ",
              grad_output.scalar_type());
  TORCH_CHECK(input.stride(1) == 1 && grad_output.stride(1) == 1 && input.stride(0) >= std::max<int64_t>(in, 1) &&
                  grad_output.stride(0) >= std::max<int64_t>(out, 1),
              "wgrad_gemm_accum_fp32: input and grad_output need unit column stride (row-major rows)");
  TORCH_CHECK(input.device() == main_grad.device() && grad_output.device() == main_grad.device(),
              "wgrad_gemm_accum_fp32: tensors are on different devices");
  const int64_t lim = std::numeric_limits<int>::max();
  TORCH_CHECK(n <= lim && in <= lim && out <= lim && input.stride(0) <= lim && grad_output.stride(0) <= lim,
              "wgrad_gemm_accum_fp32: dimensions must fit in int32");
  if (n == 0 || in == 0 || out == 0) return;  // adding a zero product

  c10::cuda::CUDAGuard guard(main_grad.device());
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to the current stream
  const float alpha = 1.f, beta = 1.f;
  const cudaDataType_t ab = cuda_dtype(input.scalar_type());
  const bool fp32 = input.scalar_type() == at::kFloat;
  cublasMath_t old_mode = CUBLAS_DEFAULT_MATH;
  if (fp32) {
    check_cublas(cublasGetMathMode(handle, &old_mode), "cublasGetMathMode");
    check_cublas(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
  const cublasStatus_t st = cublasGemmEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(in), static_cast<int>(out), static_cast<int>(n),
      &alpha, input.data_ptr(), ab, static_cast<int>(input.stride(0)), grad_output.data_ptr(), ab,
      static_cast<int>(grad_output.stride(0)), &beta, main_grad.data_ptr(), CUDA_R_32F,
      static_cast<int>(in), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (fp32) check_cublas(cublasSetMathMode(handle, old_mode), "cublasSetMathMode");
  check_cublas(st, "cublasGemmEx");
}

}  // namespace p3d
