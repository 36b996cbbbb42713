// Shared helpers for the parallel3d CUDA kernels: dtype dispatch, 16-byte
// vector packs, warp/block reductions, output allocation (optionally poisoned
// with NaN so tests catch unwritten elements) and launch-geometry helpers.
//
// Headers are kept light on purpose (ATen core + c10/cuda, no torch/extension.h
// and no cuBLAS) so that each .cu compiles in well under a minute.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <vector>

namespace p3d {

// ---- dtype dispatch: float32 / float16 / bfloat16 only (no double kernels) ----
#define P3D_DISPATCH_FLOATING(TYPE, NAME, ...)                                              \
  [&] {                                                                                    \
    switch (TYPE) {                                                                        \
      case at::ScalarType::Float: {                                                        \
        using scalar_t = float;                                                            \
        return __VA_ARGS__();                                                              \
      }                                                                                    \
      case at::ScalarType::Half: {                                                         \
        using scalar_t = at::Half;                                                         \
        return __VA_ARGS__();                                                              \
      }                                                                                    \
      case at::ScalarType::BFloat16: {                                                     \
        using scalar_t = at::BFloat16;                                                     \
        return __VA_ARGS__();                                                              \
      }                                                                                    \
      default:                                                                             \
        TORCH_CHECK(false, NAME, ": unsupported dtype ", TYPE,                             \
                    " (expected float32, float16 or bfloat16)");                           \
    }                                                                                      \
  }()

// ---- test hook: fill every freshly allocated output with NaN (0xFF bytes) ----
// Defined in bindings.cpp; toggled from Python by set_poison_outputs().
bool poison_outputs();

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  at::Tensor t = at::empty(sizes, opts);
  if (poison_outputs() && t.numel() > 0) {
    // 0xFFFF / 0xFFFFFFFF is a NaN in bf16, fp16 and fp32 alike.
    C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0xFF, t.nbytes(),
                                   c10::cuda::getCurrentCUDAStream()));
  }
  return t;
}

// ---- vector packs: VEC elements moved with one (up to) 16-byte access ----
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// Elements per 16-byte access for T.
template <typename T>
constexpr int vec16() {
  return 16 / static_cast<int>(sizeof(T));
}

inline bool aligned16(const void* p) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % 16) == 0;
}

// ---- reductions (blockDim.x must be a multiple of 32, at most 1024) ----
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a 1-D block; every thread gets the total. `red` holds >= 32 floats.
// The leading barrier lets callers reuse `red` for consecutive reductions.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  return warp_sum(lane < nwarps ? red[lane] : 0.f);
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  return warp_max(lane < nwarps ? red[lane] : -INFINITY);
}

// Two sums at once (one pair of barriers instead of two). `red` holds >= 64 floats.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();
  if (lane == 0) {
    red[wid] = a;
    red[32 + wid] = b;
  }
  __syncthreads();
  a = warp_sum(lane < nwarps ? red[lane] : 0.f);
  b = warp_sum(lane < nwarps ? red[32 + lane] : 0.f);
  return make_float2(a, b);
}

// ---- host-side geometry helpers ----
inline int sm_count() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

inline int round_up(int64_t x, int64_t m) { return static_cast<int>((x + m - 1) / m * m); }

// Threads for a one-row-per-block kernel whose row holds `nvec` packs: about
// `per_thread` packs per thread, whole warps, 32..1024.
inline int row_threads(int64_t nvec, int per_thread) {
  int64_t t = (nvec + per_thread - 1) / per_thread;
  t = t < 32 ? 32 : (t > 1024 ? 1024 : t);
  return round_up(t, 32);
}

// Geometry of the element-wise "rows x columns" kernels (bias + activation,
// bias + dropout + residual).  Block (32, 8): the 32 lanes of a warp take 32
// consecutive column packs of one row (a coalesced 512-byte access in bf16), the
// 8 warps take 8 rows; the grid's y dimension strides over the remaining rows.
// Each thread owns a fixed set of columns across all of its rows, so a bias
// gradient accumulates in registers and is reduced once per block (stage 1 of a
// two-stage reduction; stage 2 is sum_partials()).
struct RowColGrid {
  dim3 grid, block;
};

inline RowColGrid row_col_grid(int64_t rows, int64_t col_packs) {
  RowColGrid g;
  g.block = dim3(32, 8);
  const int64_t gx = (col_packs + 31) / 32;
  // About 16 resident blocks' worth of work per SM is enough to saturate HBM;
  // more blocks only add stage-2 partial rows.
  const int64_t want = static_cast<int64_t>(sm_count()) * 16;
  int64_t gy = (want + gx - 1) / gx;
  const int64_t max_gy = (rows + 7) / 8;
  gy = gy < 1 ? 1 : gy;
  gy = gy > max_gy ? max_gy : gy;
  gy = gy > 65535 ? 65535 : gy;
  g.grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy < 1 ? 1 : gy));
  return g;
}

// Stage 2 of the column reductions: out[c] = sum_p partials[p, c] (fp32
// accumulation), cast to `dtype`.  Defined in reduce_partials.cu.
at::Tensor sum_partials(const at::Tensor& partials, at::ScalarType dtype);

// Stage 1 helper for the row/column kernels: reduce the 8 row-warps' register
// accumulators of a (32, 8) block and write this block's partial row.
// `sm` holds 8 * 32 * VEC floats.
template <int VEC>
__device__ __forceinline__ void write_block_partial(const float (&acc)[VEC], float* sm,
                                                    float* part_row, int64_t ncols) {
  const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
  for (int v = 0; v < VEC; ++v) sm[(ty * VEC + v) * 32 + tx] = acc[v];
  __syncthreads();
  // The 256 threads reduce this block's 32 * VEC columns over its 8 row-warps.
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 32 * VEC;
  for (int i = ty * 32 + tx; i < 32 * VEC; i += 256) {
    const int lane = i % 32, v = i / 32;
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) s += sm[(r * VEC + v) * 32 + lane];
    const int64_t c = col0 + static_cast<int64_t>(lane) * VEC + v;
    if (c < ncols) part_row[c] = s;
  }
}

}  // namespace p3d
