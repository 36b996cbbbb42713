// The FP8 operand cast of tensor_parallel/fp8_ops.py in one launch (its reference:
// parallel3d/fused/fp8_cast.py, fp8_cast_reference). For x [M, N] (fp32, fp16 or bf16,
// contiguous) and fp32 s given as one value, per row [M, 1] or per column [1, N]:
//
//   scale = from_amax ? float(fp8_max / max(double(s), 1e-12)) : s      (NaN stays NaN)
//   q     = fp8(clamp(float(x) * scale, -fp8_max, fp8_max))             (NaN stays NaN)
//
// q is written as x's layout [M, N] ("row") and/or transposed [N, M] ("col") from one
// read of x; also scale and scale_inv = 1 / scale (correctly rounded, as torch.reciprocal),
// the factor torch._scaled_mm takes. The conversion is c10's Float8 constructor, the
// function torch's own cast runs, so the bytes equal the eager reference's.
//
// Launch geometry: a 32 x 32 tile per block of 32 x 8 threads, each thread four rows of
// the tile. Reads and the row layout's writes run along N; the transposed writes go
// through a shared tile so that they run along M.
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

constexpr int kTile = 32, kRowsPerPass = 8;
enum ScaleMode : int { kTensor = 0, kPerRow = 1, kPerCol = 2 };

__device__ __forceinline__ float scale_from(float s, float fp8_max, bool from_amax) {
  if (!from_amax) return s;
  const double a = static_cast<double>(s);
  return a != a ? s : __double2float_rn(__ddiv_rn(static_cast<double>(fp8_max), a > 1e-12 ? a : 1e-12));
}

template <typename T, typename F8>
__global__ void fp8_cast_kernel(const T* __restrict__ x, const float* __restrict__ s, F8* __restrict__ row,
                                F8* __restrict__ col, float* __restrict__ scale_out,
                                float* __restrict__ scale_inv_out, int64_t M, int64_t N, int mode,
                                bool from_amax, float fp8_max) {
  __shared__ F8 tile[kTile][kTile + 1];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t n = n0 + tx;
  const float tensor_scale = mode == kTensor ? scale_from(s[0], fp8_max, from_amax) : 0.f;
  const float col_scale = mode == kPerCol && n < N ? scale_from(s[n], fp8_max, from_amax) : 0.f;
#pragma unroll
  for (int i = 0; i < kTile; i += kRowsPerPass) {
    const int64_t m = m0 + ty + i;
    if (m >= M || n >= N) continue;
    const float sc = mode == kTensor ? tensor_scale
                     : mode == kPerRow ? scale_from(s[m], fp8_max, from_amax) : col_scale;
    float v = static_cast<float>(x[m * N + n]) * sc;
    v = v != v ? v : fminf(fmaxf(v, -fp8_max), fp8_max);
    const F8 q(v);
    if (row != nullptr) row[m * N + n] = q;
    if (col != nullptr) tile[ty + i][tx] = q;
  }
  if (col != nullptr) {
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kTile; i += kRowsPerPass) {
      const int64_t cn = n0 + ty + i, cm = m0 + tx;  // col[cn, cm] = q[cm, cn]
      if (cn < N && cm < M) col[cn * M + cm] = tile[tx][ty + i];
    }
  }
  // The scales (scale_out only where made here), one thread per value: the first tile row or
  // column of blocks writes them.
  if (mode == kTensor && blockIdx.x == 0 && blockIdx.y == 0 && tx == 0 && ty == 0) {
    if (scale_out != nullptr) scale_out[0] = tensor_scale;
    scale_inv_out[0] = __frcp_rn(tensor_scale);
  } else if (mode == kPerCol && blockIdx.y == 0 && ty == 0 && n < N) {
    if (scale_out != nullptr) scale_out[n] = col_scale;
    scale_inv_out[n] = __frcp_rn(col_scale);
  } else if (mode == kPerRow && blockIdx.x == 0 && tx == 0) {
    for (int i = ty; i < kTile; i += kRowsPerPass) {
      const int64_t m = m0 + i;
      if (m < M) {
        const float sc = scale_from(s[m], fp8_max, from_amax);
        if (scale_out != nullptr) scale_out[m] = sc;
        scale_inv_out[m] = __frcp_rn(sc);
      }
    }
  }
}

}  // namespace

std::vector<at::Tensor> fp8_cast(const at::Tensor& x, const at::Tensor& s, int64_t mode, bool from_amax, bool e5m2,
                                 bool row, bool col) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "fp8_cast: x must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(s.is_cuda() && s.scalar_type() == at::kFloat && s.is_contiguous(), "fp8_cast: s must be contiguous fp32");
  TORCH_CHECK(row || col, "fp8_cast: ask for the row layout, the col layout or both");
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK((mode == kTensor && s.numel() == 1) ||
                  (mode == kPerRow && s.dim() == 2 && s.size(0) == M && s.size(1) == 1) ||
                  (mode == kPerCol && s.dim() == 2 && s.size(0) == 1 && s.size(1) == N),
              "fp8_cast: mode ", mode, " (0 tensor, 1 per row, 2 per column) does not fit s of shape ", s.sizes(),
              " for x of shape ", x.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  const auto f8 = e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn;
  at::Tensor out_row = row ? at::empty({M, N}, x.options().dtype(f8)) : at::Tensor();
  at::Tensor out_col = col ? at::empty({N, M}, x.options().dtype(f8)) : at::Tensor();
  at::Tensor scale = from_amax ? at::empty(s.sizes(), s.options()) : s;
  at::Tensor scale_inv = at::empty(s.sizes(), s.options());
  if (M == 0 || N == 0) return {out_row, out_col, scale, scale_inv};
  const float fp8_max = e5m2 ? 57344.f : 448.f;
  const dim3 grid(static_cast<unsigned>((N + kTile - 1) / kTile), static_cast<unsigned>((M + kTile - 1) / kTile));
  const dim3 block(kTile, kRowsPerPass);
  P3D_DISPATCH_FLOATING(x.scalar_type(), "fp8_cast", [&] {
    using T = scalar_t;
    auto launch = [&](auto f8_tag) {
      using F8 = decltype(f8_tag);
      launch_kernel(fp8_cast_kernel<T, F8>, grid, block, 0, x.data_ptr<T>(), s.data_ptr<float>(),
                    row ? static_cast<F8*>(out_row.data_ptr()) : nullptr,
                    col ? static_cast<F8*>(out_col.data_ptr()) : nullptr,
                    from_amax ? scale.data_ptr<float>() : nullptr, scale_inv.data_ptr<float>(), M, N,
                    static_cast<int>(mode), from_amax, fp8_max);
    };
    if (e5m2) launch(c10::Float8_e5m2()); else launch(c10::Float8_e4m3fn());
  });
  return {out_row, out_col, scale, scale_inv};
}

}  // namespace p3d
