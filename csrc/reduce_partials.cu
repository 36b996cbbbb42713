// Stage 2 of the two-stage column reductions (bias, LayerNorm/RMSNorm weight
// and bias gradients): out[c] = sum over p of partials[p, c]. Also column_sum,
// both stages for a gradient that is only the column sum (a linear's bias, the
// bias of bias-dropout-add without dropout).
//
// Launch geometry: block (32, 32), one block per 32 columns.  The 32 lanes read
// 32 consecutive columns of a partial row (coalesced); the 32 warps stride over
// the partial rows (several loads in flight each), and a shared-memory pass
// finishes the sum in a fixed order, so the result is deterministic.  Stage 1
// writes at most a few hundred partial rows, so this kernel is a few percent of
// the op's time at most.
#include "common.cuh"

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
