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
#include <cublasLt.h>

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

// One check for both entry points: ``op`` names the caller in the error.
void check_cublas(cublasStatus_t st, const char* op, const char* what) {
  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, op, ": ", what, " failed with cuBLAS status ", static_cast<int>(st));
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
    check_cublas(cublasGetMathMode(handle, &old_mode), "wgrad_gemm_accum_fp32", "cublasGetMathMode");
    check_cublas(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "wgrad_gemm_accum_fp32", "cublasSetMathMode");
  }
  const cublasStatus_t st = cublasGemmEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(in), static_cast<int>(out), static_cast<int>(n),
      &alpha, input.data_ptr(), ab, static_cast<int>(input.stride(0)), grad_output.data_ptr(), ab,
      static_cast<int>(grad_output.stride(0)), &beta, main_grad.data_ptr(), CUDA_R_32F,
      static_cast<int>(in), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (fp32) check_cublas(cublasSetMathMode(handle, old_mode), "wgrad_gemm_accum_fp32", "cublasSetMathMode");
  check_cublas(st, "wgrad_gemm_accum_fp32", "cublasGemmEx");
}

// ---- FP8: main_grad[out, in] += (a[out, K] @ b[in, K]^T) * a_scale_inv * b_scale_inv -------------
//
// The FP8 weight-gradient GEMM of tensor_parallel/fp8.py (a = grad_output^T, b = input^T, both
// quantized with one scale each, K = tokens contiguous) accumulated into the fp32 main_grad by
// cuBLASLt with beta = 1, as the bf16 path above: no fp32 product is materialised and no add runs.
// cuBLASLt's FP8 GEMM takes "TN" only: column-major, A = b read as [K, in] (op T), B = a read as
// [K, out] (op N), C = D = main_grad^T [in, out] (ld = in). The scales are device pointers.
namespace {

cudaDataType_t fp8_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    default: TORCH_CHECK(false, "wgrad_gemm_accum_fp8: operands must be float8_e4m3fn or float8_e5m2, got ", t);
  }
  return CUDA_R_8F_E4M3;
}

void check_lt(cublasStatus_t st, const char* what) { check_cublas(st, "wgrad_gemm_accum_fp8", what); }

constexpr size_t kLtWorkspace = size_t(32) << 20;  // cuBLASLt's recommendation for Hopper

}  // namespace

void wgrad_gemm_accum_fp8(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                          const at::Tensor& b_scale_inv, at::Tensor& main_grad) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && main_grad.is_cuda() && a_scale_inv.is_cuda() && b_scale_inv.is_cuda(),
              "wgrad_gemm_accum_fp8: all tensors must be on CUDA");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous() && a.size(1) == b.size(1),
              "wgrad_gemm_accum_fp8: a [out, K] and b [in, K] must be contiguous with the same K, got ", a.sizes(),
              " and ", b.sizes());
  TORCH_CHECK(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
              "wgrad_gemm_accum_fp8: cuBLASLt has no e5m2 x e5m2 GEMM");
  const int64_t out = a.size(0), in = b.size(0), k = a.size(1);
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat && main_grad.is_contiguous() && main_grad.dim() == 2 &&
                  main_grad.size(0) == out && main_grad.size(1) == in,
              "wgrad_gemm_accum_fp8: main_grad must be a contiguous float32 [", out, ", ", in, "], got ",
              main_grad.sizes());
  TORCH_CHECK(a_scale_inv.scalar_type() == at::kFloat && a_scale_inv.numel() == 1 &&
                  b_scale_inv.scalar_type() == at::kFloat && b_scale_inv.numel() == 1,
              "wgrad_gemm_accum_fp8: the scales must be one float32 value each");
  const int64_t lim = std::numeric_limits<int>::max();
  TORCH_CHECK(out <= lim && in <= lim && k <= lim, "wgrad_gemm_accum_fp8: dimensions must fit in int32");
  if (out == 0 || in == 0 || k == 0) return;

  c10::cuda::CUDAGuard guard(main_grad.device());
  cublasLtHandle_t lt = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)), "TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)), "TRANSB");
  const void* scale_a = b_scale_inv.data_ptr();  // cuBLASLt's A is our b
  const void* scale_b = a_scale_inv.data_ptr();
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)),
           "A_SCALE_POINTER");
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)),
           "B_SCALE_POINTER");
  const int8_t fast_accum = 0;  // torch._scaled_mm's use_fast_accum=False, as wgrad asks
  check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)),
           "FAST_ACCUM");
  check_lt(cublasLtMatrixLayoutCreate(&la, fp8_dtype(b.scalar_type()), k, in, k), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&lb, fp8_dtype(a.scalar_type()), k, out, k), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, in, out, in), "layout C");
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "preference");
  size_t ws_size = kLtWorkspace;
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                sizeof(ws_size)), "workspace preference");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &heuristic, &found), "heuristic");
  TORCH_CHECK(found > 0, "wgrad_gemm_accum_fp8: cuBLASLt found no algorithm for [", out, ", ", k, "] x [", k, ", ",
              in, "]");
  at::Tensor workspace = at::empty({static_cast<int64_t>(heuristic.workspaceSize)},
                                   main_grad.options().dtype(at::kByte));
  const float alpha = 1.f, beta = 1.f;
  const cublasStatus_t st = cublasLtMatmul(lt, desc, &alpha, b.data_ptr(), la, a.data_ptr(), lb, &beta,
                                           main_grad.data_ptr(), lc, main_grad.data_ptr(), lc, &heuristic.algo,
                                           workspace.data_ptr(), heuristic.workspaceSize,
                                           c10::cuda::getCurrentCUDAStream());
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  check_lt(st, "cublasLtMatmul");
}

}  // namespace p3d
