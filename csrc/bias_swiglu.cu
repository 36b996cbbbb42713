// Bias + SwiGLU, forward and backward, with Megatron-Core's bias_swiglu_impl
// semantics: x is [rows, 2f], z = x + bias, (a, g) = (z[:, :f], z[:, f:]),
//
//   forward:  y = silu(a) * g                                   [rows, f]
//   backward: da = dy * g * sig(a) * (1 + a * (1 - sig(a))),  dg = dy * silu(a)
//             dx = cat(da, dg),  dbias = sum over rows of dx
//
// A thread handles the same pack of columns j..j+VEC of both halves (a at j,
// g at f + j), so each pass is one read of x and one write of y (forward) or
// one read of dy and x and one write of dx (backward).  Forward runs flat over
// the output packs (flat_blocks in common.cuh); backward runs block (32, 8)
// over (column packs, rows) (row_col_grid), so that bias-gradient partials
// accumulate in registers (a flat backward without a bias measured 1.7x slower on H100).
#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

__device__ __forceinline__ float sigmoid(float a) { return 1.f / (1.f + __expf(-a)); }

template <typename T, int VEC>
__global__ void bias_swiglu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                       T* __restrict__ y, int64_t rows, int64_t f) {
  const int64_t fp = f / VEC;
  P3D_FLAT_LOOP(i, rows * fp) {
    const int64_t r = i / fp, col = (i - r * fp) * VEC;
    float ba[VEC], bg[VEC];
    load_bias<T, VEC>(bias, col, ba);
    load_bias<T, VEC>(bias, f + col, bg);
    const T* xr = x + r * 2 * f;
    const Pack<T, VEC> ap = load_pack<T, VEC>(xr + col);
    const Pack<T, VEC> gp = load_pack<T, VEC>(xr + f + col);
    Pack<T, VEC> yp;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float a = static_cast<float>(ap.v[v]) + ba[v];
      const float g = static_cast<float>(gp.v[v]) + bg[v];
      yp.v[v] = static_cast<T>(a * sigmoid(a) * g);
    }
    store_pack<T, VEC>(y + r * f + col, yp);
  }
}

template <typename T, int VEC>
__global__ void bias_swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                       const T* __restrict__ bias, T* __restrict__ dx,
                                       float* __restrict__ dbias_part, int64_t rows, int64_t f) {
  __shared__ float sm[8 * 32 * VEC];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  const bool active = col < f;
  float ba[VEC], bg[VEC], acc_a[VEC], acc_g[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) ba[v] = bg[v] = acc_a[v] = acc_g[v] = 0.f;
  if (active) {
    load_bias<T, VEC>(bias, col, ba);
    load_bias<T, VEC>(bias, f + col, bg);
    const int64_t step = static_cast<int64_t>(gridDim.y) * 8;
#pragma unroll 4
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < rows; r += step) {
      const T* xr = x + r * 2 * f;
      T* dxr = dx + r * 2 * f;
      const Pack<T, VEC> dp = load_pack<T, VEC>(dy + r * f + col);
      const Pack<T, VEC> ap = load_pack<T, VEC>(xr + col);
      const Pack<T, VEC> gp = load_pack<T, VEC>(xr + f + col);
      Pack<T, VEC> da, dg;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float d = static_cast<float>(dp.v[v]);
        const float a = static_cast<float>(ap.v[v]) + ba[v];
        const float g = static_cast<float>(gp.v[v]) + bg[v];
        const float s = sigmoid(a);
        const float ga = d * g * s * (1.f + a * (1.f - s));
        const float gg = d * a * s;
        da.v[v] = static_cast<T>(ga);
        dg.v[v] = static_cast<T>(gg);
        acc_a[v] += ga;
        acc_g[v] += gg;
      }
      store_pack<T, VEC>(dxr + col, da);
      store_pack<T, VEC>(dxr + f + col, dg);
    }
  }
  if (dbias_part != nullptr) {
    // Partial row layout [2f]: the a-half then the g-half, like the bias.
    float* row = dbias_part + blockIdx.y * 2 * f;
    write_block_partial<VEC>(acc_a, sm, row, f);
    __syncthreads();  // sm is reused
    write_block_partial<VEC>(acc_g, sm, row + f, f);
  }
}

void check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), name, ": x must be a contiguous CUDA tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, name,
              ": the last dimension of x must be even (gate and up halves), got ", x.sizes());
  if (bias) check_row_vector(*bias, x, "bias", name);
}

}  // namespace

at::Tensor bias_swiglu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  check_inputs(x, bias, "bias_swiglu");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t f = x.size(-1) / 2, rows = f == 0 ? 0 : x.numel() / (2 * f);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = f;
  at::Tensor y = new_output(out_sizes, x.options());
  if (y.numel() == 0) return y;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "bias_swiglu", [&] {
    using T = scalar_t;
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    dispatch_vec<T>(use_vec<T>(f, {x.data_ptr(), bp, y.data_ptr()}), [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      launch_kernel(bias_swiglu_fwd_kernel<T, VEC>, flat_blocks(rows * (f / VEC)), kFlatThreads, 0,
                    x.data_ptr<T>(), bp, y.data_ptr<T>(), rows, f);
    });
  });
  return y;
}

std::vector<at::Tensor> bias_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                        const std::optional<at::Tensor>& bias) {
  check_inputs(x, bias, "bias_swiglu backward");
  const int64_t f = x.size(-1) / 2, rows = f == 0 ? 0 : x.numel() / (2 * f);
  TORCH_CHECK(dy.is_contiguous() && dy.scalar_type() == x.scalar_type() && dy.numel() == rows * f &&
                  dy.size(-1) == f,
              "bias_swiglu backward: grad must be contiguous, of x's dtype and of shape [..., ", f,
              "], got ", dy.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = new_output(x.sizes(), x.options());
  if (x.numel() == 0) return dx_and_dbias(dx, bias.has_value(), at::Tensor(), 2 * f);
  at::Tensor part;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "bias_swiglu backward", [&] {
    using T = scalar_t;
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    dispatch_vec<T>(use_vec<T>(f, {dy.data_ptr(), x.data_ptr(), bp, dx.data_ptr()}), [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const RowColGrid g = row_col_grid(rows, f / VEC);
      launch_kernel(bias_swiglu_bwd_kernel<T, VEC>, g.grid, g.block, 0, dy.data_ptr<T>(), x.data_ptr<T>(), bp,
                    dx.data_ptr<T>(), new_partials(part, bias.has_value(), g, 2 * f, x), rows, f);
    });
  });
  return dx_and_dbias(dx, bias.has_value(), part, 2 * f);
}

}  // namespace p3d
