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

// Loads and stores with an L2 evict-first hint (ld/st.global.cs) for 16-byte
// packs, for data a kernel touches once.  Measured on H100: 2-3% faster for
// RoPE, whose cos/sin tables must stay in L2, and 1-4% slower for the other
// kernels, which therefore use load_pack/store_pack.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_stream(const T* p) {
  if constexpr (sizeof(Pack<T, N>) == 16) {
    const int4 v = __ldcs(reinterpret_cast<const int4*>(p));
    Pack<T, N> r;
    *reinterpret_cast<int4*>(&r) = v;
    return r;
  } else {
    return load_pack<T, N>(p);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_stream(T* p, const Pack<T, N>& v) {
  if constexpr (sizeof(Pack<T, N>) == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
  } else {
    store_pack<T, N>(p, v);
  }
}

// Elements per 16-byte access for T.
template <typename T>
constexpr int vec16() {
  return 16 / static_cast<int>(sizeof(T));
}

inline bool aligned16(const void* p) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % 16) == 0;
}

// Whether rows of n elements of T can be moved in 16-byte packs: n divides
// into packs and every pointer (nullptr: absent) is 16-byte aligned.
template <typename T>
inline bool use_vec(int64_t n, std::initializer_list<const void*> ptrs) {
  if (n % vec16<T>() != 0) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

// Calls launch(std::integral_constant<int, VEC>{}): VEC = vec16<T>() (16-byte
// packs) when `vec`, else 1.  With a run-time `flag` as well, it becomes a
// compile-time one too: launch(vec_tag, std::true_type{} or std::false_type{}).
template <typename T, typename F>
inline void dispatch_vec(bool vec, F&& launch) {
  if (vec)
    launch(std::integral_constant<int, vec16<T>()>{});
  else
    launch(std::integral_constant<int, 1>{});
}

template <typename T, typename F>
inline void dispatch_vec(bool vec, bool flag, F&& launch) {
  dispatch_vec<T>(vec, [&](auto vec_tag) {
    if (flag)
      launch(vec_tag, std::true_type{});
    else
      launch(vec_tag, std::false_type{});
  });
}

// A row's bias (nullptr: none, zeros) from element `off` on, as floats.
template <typename T, int VEC>
__device__ __forceinline__ void load_bias(const T* bias, int64_t off, float (&b)[VEC]) {
  if (bias != nullptr) {
    const Pack<T, VEC> p = load_pack<T, VEC>(bias + off);
#pragma unroll
    for (int v = 0; v < VEC; ++v) b[v] = static_cast<float>(p.v[v]);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) b[v] = 0.f;
  }
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

// Reductions over the threadIdx.x dimension of a block ("row group"): every
// thread gets its group's total.  Blocks may be 2-D, one row group per
// threadIdx.y: each group passes its own slice of shared memory (`red` holds
// >= 32 floats, >= 64 for block_sum2), and every thread of the block must call
// (the barriers are block-wide).  A group of one warp needs no barrier.  The
// leading barrier lets callers reuse `red` for consecutive reductions.
// block_sum (MAX false) and block_max (MAX true): one warp reduction, the
// warps' results through `red`, then one more warp reduction.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = MAX ? warp_max(v) : warp_sum(v);
  if (nwarps == 1) return v;
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  const float w = lane < nwarps ? red[lane] : (MAX ? -INFINITY : 0.f);
  return MAX ? warp_max(w) : warp_sum(w);
}

__device__ __forceinline__ float block_sum(float v, float* red) { return block_reduce<false>(v, red); }
__device__ __forceinline__ float block_max(float v, float* red) { return block_reduce<true>(v, red); }

// Two sums at once (one pair of barriers instead of two).
__device__ __forceinline__ float2 block_sum2(float a, float b, float* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  if (nwarps == 1) return make_float2(a, b);
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

// ---- host-side checks and launch helpers ----

// `v` (a weight or bias named `what`) is a contiguous vector over x's last
// dimension with x's dtype and device.
inline void check_row_vector(const at::Tensor& v, const at::Tensor& x, const char* what, const char* name) {
  TORCH_CHECK(v.is_contiguous() && v.dim() == 1 && v.size(0) == x.size(-1) &&
                  v.scalar_type() == x.scalar_type() && v.device() == x.device(),
              name, ": ", what, " must be a contiguous vector of size ", x.size(-1),
              " with x's dtype and device, got ", v.sizes(), " ", v.scalar_type(), " on ", v.device());
}

// A kernel launched with more than the default 48 KB of dynamic shared memory must opt in first.
template <typename Kernel>
inline void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

// kernel<<<grid, block, smem>>>(args...) on the current stream, then the launch
// check; a kernel given more than 48 KB of dynamic shared memory opts in first.
template <typename Kernel, typename... Args>
inline void launch_kernel(Kernel kernel, dim3 grid, dim3 block, size_t smem, Args... args) {
  allow_dynamic_smem(kernel, smem);
  kernel<<<grid, block, smem, c10::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

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

// ---- rows held in registers ----
// A row of `nvec` packs belongs to one row group of blockDim.x threads (a
// multiple of 32): thread t holds packs t, t + blockDim.x, ..., t + (P - 1) *
// blockDim.x, those below nvec.  A block of (blockDim.x, blockDim.y) threads
// works on blockDim.y rows at a time.  All P loads of a thread are issued
// before any is used, so a thread keeps P 16-byte loads per tensor in flight,
// and the row is read from memory exactly once.
//
// Blocks have at most kMaxRowBlockThreads threads, and the kernels say so
// (__launch_bounds__), so the compiler keeps them within the 128 registers per
// thread that lets such a block run on any GPU since Volta; longer rows take
// more packs per thread instead of more threads.
constexpr int kMaxRowsPerBlock = 8;
constexpr int kMaxRowBlockThreads = 512;

template <typename T, int VEC, int P>
struct RowFrag {
  Pack<T, VEC> p[P];

  // Packs past nvec, or every pack when !valid, are zero.
  __device__ __forceinline__ void load(const T* row, int64_t nvec, bool valid) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (valid && i < nvec) {
        p[k] = load_pack<T, VEC>(row + i * VEC);
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) p[k].v[v] = static_cast<T>(0.f);
      }
    }
  }
  __device__ __forceinline__ float f(int k, int v) const { return static_cast<float>(p[k].v[v]); }
};

// Pack index of a thread's k-th pack.
__device__ __forceinline__ int64_t frag_index(int k) {
  return threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
}

// Launch shape for RowFrag kernels over rows of `nvec` packs: the fewest packs
// per thread P (a power of two, min_p..max_p) that fit the row in
// kMaxRowBlockThreads threads, whole warps per row, and rows per block so that
// a block has about `block_threads` threads.
struct RowGroups {
  int P;
  dim3 block;
};

inline RowGroups row_groups(int64_t nvec, int min_p, int max_p, int block_threads = 256) {
  int P = min_p < max_p ? min_p : max_p;
  while (P < max_p && (nvec + P - 1) / P > kMaxRowBlockThreads) P *= 2;
  int64_t tx = round_up((nvec + P - 1) / P, 32);
  tx = tx < 32 ? 32 : tx;
  TORCH_CHECK(tx <= kMaxRowBlockThreads, "internal error: a row of ", nvec, " packs needs more than ",
              max_p, " packs per thread");
  int64_t ry = block_threads / tx;
  ry = ry < 1 ? 1 : (ry > kMaxRowsPerBlock ? kMaxRowsPerBlock : ry);
  return {P, dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ry))};
}

// Largest P a RowFrag kernel is built for: rows of up to 16384 elements in
// kMaxRowBlockThreads threads (4 packs of 8, 8 of 4, 32 scalars per thread).
template <int VEC>
constexpr int max_packs_per_thread() {
  return 16384 / kMaxRowBlockThreads / VEC;
}

// Calls launch(std::integral_constant<int, P>{}) for a power of two P up to
// max_packs_per_thread<VEC>().
template <int VEC, typename F>
inline void dispatch_packs_per_thread(int P, F&& launch) {
  if (P == 1) return launch(std::integral_constant<int, 1>{});
  if (P == 2) return launch(std::integral_constant<int, 2>{});
  if (P == 4) return launch(std::integral_constant<int, 4>{});
  if constexpr (max_packs_per_thread<VEC>() >= 8) {
    if (P == 8) return launch(std::integral_constant<int, 8>{});
    if constexpr (max_packs_per_thread<VEC>() >= 32) {
      if (P == 16) return launch(std::integral_constant<int, 16>{});
      if (P == 32) return launch(std::integral_constant<int, 32>{});
    }
  }
  TORCH_CHECK(false, "internal error: no kernel for ", P, " packs per thread at vector width ", VEC);
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

// Launch shape of the flat element-wise kernels (the forward passes, which
// reduce nothing over rows): kFlatThreads-thread blocks grid-striding over the
// packs in row-major order, so the warps running at one time read and write
// one contiguous stretch of memory; at most 32 blocks per SM.
constexpr int kFlatThreads = 256;

inline unsigned flat_blocks(int64_t packs) {
  const int64_t want = (packs + kFlatThreads - 1) / kFlatThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 32;
  return static_cast<unsigned>(want < cap ? (want < 1 ? 1 : want) : cap);
}

// The flat kernels' loop over pack indices i in [0, total), the grid's threads
// striding over them.  A macro: written as a function taking the body as a
// lambda, the loop lost its 4-way unrolling (fp32 bias_gelu's PTX changed).
#define P3D_FLAT_LOOP(i, total)                                                            \
  _Pragma("unroll 4") for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, \
                           i##_end = (total), i##_step = static_cast<int64_t>(gridDim.x) * blockDim.x; \
                           i < i##_end; i += i##_step)

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

// Stage-1 partial rows of a bias gradient for a row_col_grid launch: with a
// bias, `part` becomes a [grid.y, ncols] fp32 tensor on x's device and its data
// is returned for the kernel; without one, nullptr.
inline float* new_partials(at::Tensor& part, bool has_bias, const RowColGrid& g, int64_t ncols,
                           const at::Tensor& x) {
  if (!has_bias) return nullptr;
  part = new_output({static_cast<int64_t>(g.grid.y), ncols}, x.options().dtype(at::kFloat));
  return part.data_ptr<float>();
}

// What the row/column backward ops return: {dx} and, with a bias, its gradient:
// stage 2 over `part`, or zeros of bias_size where nothing was launched (`part`
// undefined: dx is empty).
inline std::vector<at::Tensor> dx_and_dbias(const at::Tensor& dx, bool has_bias, const at::Tensor& part,
                                            int64_t bias_size) {
  std::vector<at::Tensor> out{dx};
  if (has_bias)
    out.push_back(part.defined() ? sum_partials(part, dx.scalar_type()) : at::zeros({bias_size}, dx.options()));
  return out;
}

}  // namespace p3d
