// Bias + GeLU (tanh approximation or exact erf), forward and backward.
//
//   forward:  y  = gelu(x + bias)
//   backward: dx = dy * gelu'(x + bias),  dbias = sum over rows of dx
//
// x is viewed as [rows, cols] with the bias broadcast over rows.  Forward runs
// flat over the packs (flat_blocks in common.cuh).  Backward runs block
// (32, 8) over (column packs, rows) (row_col_grid): a thread keeps its
// columns' bias in registers for all of its rows and accumulates their bias
// gradient in registers too, so the bias gradient costs one block-level
// reduction plus a tiny stage-2 kernel instead of a second pass over dx.  One pass over memory each way:
// forward reads x and writes y, backward reads dy and x and writes dx.
#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kCoeff = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)

// tanh: written without the cancelling "1 + tanh" form, 1 + tanh(u) = 2 sigmoid(2u), at
// the cost of one __expf. erf: PyTorch's own formula, 0.5 x (1 + erf(x / sqrt 2)).
// erfcf(-x / sqrt 2) would keep the far negative tail's relative accuracy, but it costs
// about twice erff's instructions: with it the kernel was compute-bound, 1.4x slower than
// Inductor's erf GeLU in a GPT-1.3B step (H100). The tail it loses is below 1e-7 in size.
template <bool TANH>
__device__ __forceinline__ float gelu(float x) {
  if (TANH) {
    const float u = kSqrt2OverPi * x * (1.f + kCoeff * x * x);
    return x / (1.f + __expf(-2.f * u));
  }
  return 0.5f * x * (1.f + erff(x * kInvSqrt2));
}

// d gelu(x) / dx
template <bool TANH>
__device__ __forceinline__ float gelu_grad(float x) {
  if (TANH) {
    const float u = kSqrt2OverPi * x * (1.f + kCoeff * x * x);
    const float s = 1.f / (1.f + __expf(-2.f * u));  // (1 + tanh u) / 2
    return s + 2.f * x * s * (1.f - s) * kSqrt2OverPi * (1.f + 3.f * kCoeff * x * x);
  }
  return 0.5f * (1.f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * __expf(-0.5f * x * x);
}

template <typename T, int VEC, bool TANH>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                     T* __restrict__ y, int64_t rows, int64_t cols) {
  const int64_t cp = cols / VEC;
  P3D_FLAT_LOOP(i, rows * cp) {
    const int64_t col = (i % cp) * VEC;
    Pack<T, VEC> bp;
    if (bias != nullptr) bp = load_pack<T, VEC>(bias + col);
    const Pack<T, VEC> xp = load_pack<T, VEC>(x + i * VEC);
    Pack<T, VEC> yp;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float b = bias != nullptr ? static_cast<float>(bp.v[v]) : 0.f;
      yp.v[v] = static_cast<T>(gelu<TANH>(static_cast<float>(xp.v[v]) + b));
    }
    store_pack<T, VEC>(y + i * VEC, yp);
  }
}

template <typename T, int VEC, bool TANH>
__global__ void bias_gelu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                     const T* __restrict__ bias, T* __restrict__ dx,
                                     float* __restrict__ dbias_part, int64_t rows,
                                     int64_t cols) {
  __shared__ float sm[8 * 32 * VEC];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  const bool active = col < cols;  // inactive threads still join the block reduction
  float b[VEC], acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) b[v] = acc[v] = 0.f;
  if (active && bias != nullptr) {
    const Pack<T, VEC> bp = load_pack<T, VEC>(bias + col);
#pragma unroll
    for (int v = 0; v < VEC; ++v) b[v] = static_cast<float>(bp.v[v]);
  }
  if (active) {
    const int64_t step = static_cast<int64_t>(gridDim.y) * 8;
#pragma unroll 2
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < rows; r += step) {
      const Pack<T, VEC> gp = load_pack<T, VEC>(dy + r * cols + col);
      const Pack<T, VEC> xp = load_pack<T, VEC>(x + r * cols + col);
      Pack<T, VEC> op;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float g = static_cast<float>(gp.v[v]) *
                        gelu_grad<TANH>(static_cast<float>(xp.v[v]) + b[v]);
        op.v[v] = static_cast<T>(g);
        acc[v] += g;
      }
      store_pack<T, VEC>(dx + r * cols + col, op);
    }
  }
  if (dbias_part != nullptr) write_block_partial<VEC>(acc, sm, dbias_part + blockIdx.y * cols, cols);
}

void check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), name, ": x must be a contiguous CUDA tensor");
  TORCH_CHECK(x.dim() >= 1, name, ": x must have at least one dimension");
  if (bias) check_row_vector(*bias, x, "bias", name);
}

}  // namespace

at::Tensor bias_gelu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         bool approximate_tanh) {
  check_inputs(x, bias, "bias_gelu");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_output(x.sizes(), x.options());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (x.numel() == 0) return y;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "bias_gelu", [&] {
    using T = scalar_t;
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    const bool vec = use_vec<T>(cols, {x.data_ptr(), bp, y.data_ptr()});
    dispatch_vec<T>(vec, approximate_tanh, [&](auto vec_tag, auto tanh_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      launch_kernel(bias_gelu_fwd_kernel<T, VEC, decltype(tanh_tag)::value>, flat_blocks(rows * (cols / VEC)),
                    kFlatThreads, 0, x.data_ptr<T>(), bp, y.data_ptr<T>(), rows, cols);
    });
  });
  return y;
}

std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                      const std::optional<at::Tensor>& bias,
                                      bool approximate_tanh) {
  check_inputs(x, bias, "bias_gelu backward");
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              "bias_gelu backward: grad must be contiguous with x's shape and dtype");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = new_output(x.sizes(), x.options());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (x.numel() == 0) return dx_and_dbias(dx, bias.has_value(), at::Tensor(), cols);
  at::Tensor part;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "bias_gelu backward", [&] {
    using T = scalar_t;
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    const bool vec = use_vec<T>(cols, {dy.data_ptr(), x.data_ptr(), bp, dx.data_ptr()});
    dispatch_vec<T>(vec, approximate_tanh, [&](auto vec_tag, auto tanh_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const RowColGrid g = row_col_grid(rows, cols / VEC);
      launch_kernel(bias_gelu_bwd_kernel<T, VEC, decltype(tanh_tag)::value>, g.grid, g.block, 0,
                    dy.data_ptr<T>(), x.data_ptr<T>(), bp, dx.data_ptr<T>(),
                    new_partials(part, bias.has_value(), g, cols, x), rows, cols);
    });
  });
  return dx_and_dbias(dx, bias.has_value(), part, cols);
}

}  // namespace p3d
