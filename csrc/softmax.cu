// Scaled upper-triangular (causal) masked softmax, forward and backward, as
// Megatron's scaled_upper_triang_masked_softmax: x is [attn_batches, sq, sk]
// with sq == sk; row i of each batch keeps columns j <= i.
//
//   forward:  y[i, j] = exp(scale * x[i, j] - m_i) / sum_{k <= i} exp(scale * x[i, k] - m_i)
//             for j <= i, and 0 for j > i (m_i the row max)
//   backward: dx[i, j] = scale * y[i, j] * (dy[i, j] - sum_{k <= i} dy[i, k] * y[i, k])
//
// fp32 arithmetic for every dtype.  Launch geometry: one block per row,
// row_threads() threads (about 4 packs each), several blocks per SM.  Each
// pass reads only the unmasked entries j <= i, once, into a shared-memory
// cache (each thread touches only its own packs, so the cache needs no
// barriers): forward caches scale * x in fp32 and takes the max, the
// exponentials and the sum from it; backward caches y and dy and takes their
// dot product.  Then the whole row is written, zeros past the diagonal without
// reading anything.  sk up to 16384 (a 64 KB forward cache, 2 * 16384 * sizeof(T)
// backward).
#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

constexpr int64_t kMaxSk = 16384;

// Both kernels' row loop: blocks stride over the rows; row r (row r % sq of its
// batch) keeps columns [0, len), which its first nvalid packs hold.
template <int VEC, typename Body>
__device__ __forceinline__ void for_each_causal_row(int64_t rows, int64_t sq, Body&& body) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t len = r % sq + 1;
    body(r, len, (len + VEC - 1) / VEC);
  }
}

template <typename T, int VEC>
__global__ void causal_softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                                          int64_t sq, int64_t sk, float scale) {
  // Column i * VEC + v is cached at cache[v * nvec + i]: consecutive lanes hit
  // consecutive words (no bank conflicts).
  extern __shared__ __align__(16) float cache[];
  __shared__ float red[32];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t nvec = sk / VEC;
  for_each_causal_row<VEC>(rows, sq, [&](int64_t r, int64_t len, int64_t nvalid) {
    const T* xr = x + r * sk;
    float m = -INFINITY;
#pragma unroll 4
    for (int64_t i = tid; i < nvalid; i += nt) {
      const Pack<T, VEC> p = load_pack<T, VEC>(xr + i * VEC);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float val = i * VEC + v < len ? static_cast<float>(p.v[v]) * scale : -INFINITY;
        cache[v * nvec + i] = val;
        m = fmaxf(m, val);
      }
    }
    m = block_max(m, red);
    float sum = 0.f;
#pragma unroll 4
    for (int64_t i = tid; i < nvalid; i += nt) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float e = __expf(cache[v * nvec + i] - m);  // exp(-inf) = 0 for masked lanes
        cache[v * nvec + i] = e;
        sum += e;
      }
    }
    const float inv = 1.f / block_sum(sum, red);
    T* yr = y + r * sk;
#pragma unroll 4
    for (int64_t i = tid; i < nvec; i += nt) {
      Pack<T, VEC> o;
#pragma unroll
      for (int v = 0; v < VEC; ++v) o.v[v] = static_cast<T>(i < nvalid ? cache[v * nvec + i] * inv : 0.f);
      store_pack<T, VEC>(yr + i * VEC, o);
    }
  });
}

template <typename T, int VEC>
__global__ void causal_softmax_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                                          T* __restrict__ dx, int64_t rows, int64_t sq, int64_t sk,
                                          float scale) {
  // The row's unmasked packs: y at cache[i], dy at cache[nvec + i].  Each
  // thread reads back only the packs it wrote, so no barrier guards the cache.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Pack<T, VEC>* cache = reinterpret_cast<Pack<T, VEC>*>(smem_raw);
  __shared__ float red[32];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t nvec = sk / VEC;
  for_each_causal_row<VEC>(rows, sq, [&](int64_t r, int64_t len, int64_t nvalid) {
    const T* yr = y + r * sk;
    const T* gr = dy + r * sk;
    float dot = 0.f;
#pragma unroll 4
    for (int64_t i = tid; i < nvalid; i += nt) {
      const Pack<T, VEC> yp = load_pack<T, VEC>(yr + i * VEC);
      const Pack<T, VEC> gp = load_pack<T, VEC>(gr + i * VEC);
      cache[i] = yp;
      cache[nvec + i] = gp;
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        if (i * VEC + v < len) dot += static_cast<float>(yp.v[v]) * static_cast<float>(gp.v[v]);
    }
    dot = block_sum(dot, red);
    T* dxr = dx + r * sk;
#pragma unroll 4
    for (int64_t i = tid; i < nvec; i += nt) {
      Pack<T, VEC> o;
      if (i < nvalid) {
        const Pack<T, VEC> yp = cache[i], gp = cache[nvec + i];
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float yv = static_cast<float>(yp.v[v]);
          o.v[v] = static_cast<T>(i * VEC + v < len ? scale * yv * (static_cast<float>(gp.v[v]) - dot) : 0.f);
        }
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) o.v[v] = static_cast<T>(0.f);
      }
      store_pack<T, VEC>(dxr + i * VEC, o);
    }
  });
}

struct Shape {
  int64_t sq, sk, rows;
};

// Checks the [attn_batches, sq, sk] tensor both passes take, and returns its shape.
Shape check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 3, name,
              ": expected a contiguous 3-D [attn_batches, sq, sk] CUDA tensor, got ", x.sizes());
  TORCH_CHECK(x.size(1) == x.size(2), name, ": the causal mask needs sq == sk, got sq = ", x.size(1),
              ", sk = ", x.size(2));
  TORCH_CHECK(x.size(2) <= kMaxSk, name, ": sk must be at most ", kMaxSk, ", got ", x.size(2));
  return {x.size(1), x.size(2), x.size(0) * x.size(1)};
}

// Both passes: one block per row (at most 2^30, the rest grid-striding),
// row_threads() threads of about 4 packs each, `smem` bytes of row cache.
template <typename Kernel, typename... Args>
void launch_rows(Kernel kernel, int64_t rows, int64_t nvec, size_t smem, Args... args) {
  const int64_t grid = rows < (int64_t{1} << 30) ? rows : (int64_t{1} << 30);
  launch_kernel(kernel, static_cast<unsigned>(grid), row_threads(nvec, 4), smem, args...);
}

}  // namespace

at::Tensor scaled_upper_triang_masked_softmax_fwd(const at::Tensor& x, double scale) {
  const Shape sh = check_x(x, "scaled_upper_triang_masked_softmax");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_output(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "scaled_upper_triang_masked_softmax", [&] {
    using T = scalar_t;
    dispatch_vec<T>(use_vec<T>(sh.sk, {x.data_ptr(), y.data_ptr()}), [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const size_t smem = static_cast<size_t>(sh.sk) * sizeof(float);
      launch_rows(causal_softmax_fwd_kernel<T, VEC>, sh.rows, sh.sk / VEC, smem, x.data_ptr<T>(), y.data_ptr<T>(),
                  sh.rows, sh.sq, sh.sk, static_cast<float>(scale));
    });
  });
  return y;
}

at::Tensor scaled_upper_triang_masked_softmax_bwd(const at::Tensor& dy, const at::Tensor& y,
                                                  double scale) {
  const Shape sh = check_x(y, "scaled_upper_triang_masked_softmax backward");
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(),
              "scaled_upper_triang_masked_softmax backward: grad must be contiguous with y's shape "
              "and dtype");
  c10::cuda::CUDAGuard guard(y.device());
  at::Tensor dx = new_output(y.sizes(), y.options());
  if (y.numel() == 0) return dx;
  P3D_DISPATCH_FLOATING(y.scalar_type(), "scaled_upper_triang_masked_softmax backward", [&] {
    using T = scalar_t;
    dispatch_vec<T>(use_vec<T>(sh.sk, {dy.data_ptr(), y.data_ptr(), dx.data_ptr()}), [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const size_t smem = 2 * static_cast<size_t>(sh.sk) * sizeof(T);
      launch_rows(causal_softmax_bwd_kernel<T, VEC>, sh.rows, sh.sk / VEC, smem, dy.data_ptr<T>(),
                  y.data_ptr<T>(), dx.data_ptr<T>(), sh.rows, sh.sq, sh.sk, static_cast<float>(scale));
    });
  });
  return dx;
}

}  // namespace p3d
