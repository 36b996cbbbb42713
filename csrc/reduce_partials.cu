// Stage 2 of the two-stage column reductions (bias, LayerNorm/RMSNorm weight
// and bias gradients): out[c] = sum over p of partials[p, c]. Also column_sum,
// both stages for a gradient that is only the column sum (a linear's bias, the
// bias of bias-dropout-add without dropout), and qkv_grad_merge, which writes
// the q, k and v gradients into linear_qkv's layout and sums that bias's
// gradient in the same pass (the column sum of what it writes).
//
// Launch geometry: block (32, 32), one block per 32 columns.  The 32 lanes read
// 32 consecutive columns of a partial row (coalesced); the 32 warps stride over
// the partial rows (several loads in flight each), and a shared-memory pass
// finishes the sum in a fixed order, so the result is deterministic.  Stage 1
// writes at most a few hundred partial rows, so this kernel is a few percent of
// the op's time at most.
#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

template <typename OutT>
__global__ void sum_partials_kernel(const float* __restrict__ part, int64_t nparts,
                                    int64_t ncols, OutT* __restrict__ out) {
  __shared__ float sm[32][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.f;
  if (col < ncols) {
#pragma unroll 4
    for (int64_t p = threadIdx.y; p < nparts; p += 32) acc += part[p * ncols + col];
  }
  sm[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < ncols) {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < 32; ++r) s += sm[r][threadIdx.x];
    out[col] = static_cast<OutT>(s);
  }
}

// Stage 1 of column_sum: each (32, 8) block adds its rows of 32 * VEC columns.
template <typename T, int VEC>
__global__ void column_sum_kernel(const T* __restrict__ x, float* __restrict__ part, int64_t rows, int64_t cols) {
  __shared__ float sm[8 * 32 * VEC];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
  if (col < cols) {  // inactive threads still join the block reduction
    const int64_t step = static_cast<int64_t>(gridDim.y) * 8;
#pragma unroll 4
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < rows; r += step) {
      const Pack<T, VEC> p = load_pack<T, VEC>(x + r * cols + col);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] += static_cast<float>(p.v[v]);
    }
  }
  write_block_partial<VEC>(acc, sm, part + blockIdx.y * cols, cols);
}

// Element strides over [s, b, group, head] of one of the three gradients (k's and v's: one head a group).
struct QkvSrc {
  int64_t ss, sb, sg, sh;
};

struct QkvShape {
  int64_t b, rows, qpg, d, cols;  // rows = s * b; cols = groups * (qpg + 2) * d
  QkvSrc q, k, v;
};

// Block (32, 8) over (column packs, rows), as column_sum: a thread finds its columns' source once (which of
// q/k/v, group, head, feature) and copies them down its rows, adding them up when SUM.
template <typename T, int VEC, bool SUM>
__global__ void qkv_grad_merge_kernel(const T* __restrict__ dq, const T* __restrict__ dk,
                                      const T* __restrict__ dv, QkvShape sh, T* __restrict__ out,
                                      float* __restrict__ part) {
  __shared__ float sm[SUM ? 8 * 32 * VEC : 1];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
  if (col < sh.cols) {  // inactive threads still join the block reduction
    const int64_t per_group = (sh.qpg + 2) * sh.d, g = col / per_group, w = col - g * per_group;
    const int64_t h = w / sh.d, e = w - h * sh.d;
    const T* src;
    QkvSrc st;
    if (h < sh.qpg) {
      st = sh.q;
      src = dq + g * st.sg + h * st.sh + e;
    } else {
      st = h == sh.qpg ? sh.k : sh.v;
      src = (h == sh.qpg ? dk : dv) + g * st.sg + e;
    }
    // row r = si * b + bi, stepped without a division per row (a 64-bit one is ~100 instructions)
    const int64_t step = static_cast<int64_t>(gridDim.y) * 8, step_s = step / sh.b, step_b = step - step_s * sh.b;
    int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y, si = r / sh.b, bi = r - si * sh.b;
#pragma unroll 4
    for (; r < sh.rows; r += step) {
      const Pack<T, VEC> p = load_stream<T, VEC>(src + si * st.ss + bi * st.sb);
      store_pack<T, VEC>(out + r * sh.cols + col, p);
      if (SUM) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] += static_cast<float>(p.v[v]);
      }
      si += step_s;
      bi += step_b;
      if (bi >= sh.b) {
        bi -= sh.b;
        ++si;
      }
    }
  }
  if (SUM) write_block_partial<VEC>(acc, sm, part + blockIdx.y * sh.cols, sh.cols);
}

}  // namespace

at::Tensor column_sum(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() >= 1, "column_sum: x must be a contiguous CUDA tensor");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return at::zeros({cols}, x.options());
  at::Tensor part;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "column_sum", [&] {
    using T = scalar_t;
    dispatch_vec<T>(use_vec<T>(cols, {x.data_ptr()}), [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const RowColGrid g = row_col_grid(rows, cols / VEC);
      launch_kernel(column_sum_kernel<T, VEC>, g.grid, g.block, 0, x.data_ptr<T>(),
                    new_partials(part, true, g, cols, x), rows, cols);
    });
  });
  return sum_partials(part, x.scalar_type());
}

std::vector<at::Tensor> qkv_grad_merge(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                                       bool with_sum) {
  TORCH_CHECK(dq.is_cuda() && dq.dim() == 5 && dk.dim() == 4 && dv.dim() == 4,
              "qkv_grad_merge: expected CUDA dq [s, b, groups, q heads a group, d] and dk, dv [s, b, groups, d], got ",
              dq.sizes(), ", ", dk.sizes(), ", ", dv.sizes());
  const int64_t s = dq.size(0), b = dq.size(1), ng = dq.size(2), qpg = dq.size(3), d = dq.size(4);
  for (const at::Tensor* t : {&dq, &dk, &dv}) {
    TORCH_CHECK(t->size(0) == s && t->size(1) == b && t->size(2) == ng && t->size(-1) == d &&
                    t->stride(-1) == 1 && t->scalar_type() == dq.scalar_type() && t->device() == dq.device(),
                "qkv_grad_merge: dq, dk and dv must share s, b, groups, d, dtype and device, with a contiguous "
                "last dim; got sizes ", t->sizes(), " strides ", t->strides());
  }
  c10::cuda::CUDAGuard guard(dq.device());
  const int64_t rows = s * b, cols = ng * (qpg + 2) * d;
  at::Tensor out = new_output({s, b, ng, (qpg + 2) * d}, dq.options()), part;
  if (rows == 0 || cols == 0) return dx_and_dbias(out, with_sum, part, cols);
  const QkvShape sh{b, rows, qpg, d, cols, {dq.stride(0), dq.stride(1), dq.stride(2), dq.stride(3)},
                    {dk.stride(0), dk.stride(1), dk.stride(2), 0}, {dv.stride(0), dv.stride(1), dv.stride(2), 0}};
  P3D_DISPATCH_FLOATING(dq.scalar_type(), "qkv_grad_merge", [&] {
    using T = scalar_t;
    constexpr int V = vec16<T>();
    // a pack never straddles two heads or two rows of a source
    bool vec = use_vec<T>(d, {dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), out.data_ptr()});
    for (const at::Tensor* t : {&dq, &dk, &dv})
      for (int64_t j = 0; j + 1 < t->dim(); ++j) vec = vec && t->stride(j) % V == 0;
    dispatch_vec<T>(vec, with_sum, [&](auto vec_tag, auto sum_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      constexpr bool SUM = decltype(sum_tag)::value;
      const RowColGrid g = row_col_grid(rows, cols / VEC);
      launch_kernel(qkv_grad_merge_kernel<T, VEC, SUM>, g.grid, g.block, 0, dq.data_ptr<T>(), dk.data_ptr<T>(),
                    dv.data_ptr<T>(), sh, out.data_ptr<T>(), new_partials(part, SUM, g, cols, out));
    });
  });
  return dx_and_dbias(out, with_sum, part, cols);
}

at::Tensor sum_partials(const at::Tensor& partials, at::ScalarType dtype) {
  TORCH_CHECK(partials.dim() == 2 && partials.scalar_type() == at::kFloat && partials.is_contiguous(),
              "sum_partials: expected a contiguous 2-D float32 tensor");
  const int64_t nparts = partials.size(0), ncols = partials.size(1);
  at::Tensor out = new_output({ncols}, partials.options().dtype(dtype));
  if (ncols == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 block(32, 32), grid(static_cast<unsigned>((ncols + 31) / 32));
  P3D_DISPATCH_FLOATING(dtype, "sum_partials", [&] {
    sum_partials_kernel<scalar_t><<<grid, block, 0, stream>>>(
        partials.data_ptr<float>(), nparts, ncols, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace p3d
