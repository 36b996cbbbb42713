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
// With amax_out (one fp32 value, >= 0), the cast also records max |x| into it:
// amax_out = max(amax_out, max |x|), NaN kept (the delayed recipe's amax, read in the same pass
// instead of a launch of its own). Non-negative floats order as their bits do, so an integer
// atomicMax per warp does it; a NaN's |.| is a positive NaN, above inf.
//
// Launch geometry: where M and N are multiples of 64 (the activations and weights of every
// model we train), fp8_cast_vec_kernel: a 64 x 64 tile per block of 256 threads, 16-byte
// reads of x, 8-byte writes of the row layout, 16-byte writes of the transposed one through
// a shared tile, and the hardware's conversion (cvt.rn.satfinite: round to nearest even,
// the same bytes as c10's for every finite value; NaN still goes through c10's). Elsewhere
// fp8_cast_kernel: a 32 x 32 tile per block of 32 x 8 threads, one element at a time.
#include <cuda_fp8.h>
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

// v clamped to +-fp8_max, NaN kept (the saturating cast's input).
__device__ __forceinline__ float clamp_fp8(float v, float fp8_max) {
  return v != v ? v : fminf(fmaxf(v, -fp8_max), fp8_max);
}

// One scale and the reciprocal torch._scaled_mm takes (scale_out only where the cast made the scale).
__device__ __forceinline__ void store_scale(float* scale_out, float* scale_inv_out, int64_t i, float sc) {
  if (scale_out != nullptr) scale_out[i] = sc;
  scale_inv_out[i] = __frcp_rn(sc);
}

// max(a, b) for a, b >= 0 or NaN, NaN kept.
__device__ __forceinline__ float nan_max(float a, float b) { return (b != b || b > a) ? b : a; }

// amax_out = max(amax_out, the warp's values): every thread of the warp calls it.
__device__ __forceinline__ void record_amax(float* amax_out, float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, off));
  if ((threadIdx.x + threadIdx.y * blockDim.x) % 32 == 0) atomicMax(reinterpret_cast<int*>(amax_out), __float_as_int(v));
}

template <typename T, typename F8>
__global__ void fp8_cast_kernel(const T* __restrict__ x, const float* __restrict__ s, F8* __restrict__ row,
                                F8* __restrict__ col, float* __restrict__ scale_out,
                                float* __restrict__ scale_inv_out, float* __restrict__ amax_out, int64_t M,
                                int64_t N, int mode, bool from_amax, float fp8_max) {
  __shared__ F8 tile[kTile][kTile + 1];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t n = n0 + tx;
  const float tensor_scale = mode == kTensor ? scale_from(s[0], fp8_max, from_amax) : 0.f;
  const float col_scale = mode == kPerCol && n < N ? scale_from(s[n], fp8_max, from_amax) : 0.f;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kTile; i += kRowsPerPass) {
    const int64_t m = m0 + ty + i;
    if (m >= M || n >= N) continue;
    const float sc = mode == kTensor ? tensor_scale
                     : mode == kPerRow ? scale_from(s[m], fp8_max, from_amax) : col_scale;
    const float v = static_cast<float>(x[m * N + n]);
    amax = nan_max(amax, fabsf(v));
    const F8 q(clamp_fp8(v * sc, fp8_max));
    if (row != nullptr) row[m * N + n] = q;
    if (col != nullptr) tile[ty + i][tx] = q;
  }
  if (amax_out != nullptr) record_amax(amax_out, amax);
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
    store_scale(scale_out, scale_inv_out, 0, tensor_scale);
  } else if (mode == kPerCol && blockIdx.y == 0 && ty == 0 && n < N) {
    store_scale(scale_out, scale_inv_out, n, col_scale);
  } else if (mode == kPerRow && blockIdx.x == 0 && tx == 0) {
    for (int i = ty; i < kTile; i += kRowsPerPass) {
      const int64_t m = m0 + i;
      if (m < M) store_scale(scale_out, scale_inv_out, m, scale_from(s[m], fp8_max, from_amax));
    }
  }
}

// q's byte for v (already clamped to +-fp8_max, or NaN), and a pair of them.
template <typename F8>
__device__ __forceinline__ uint16_t fp8_pair(float a, float b) {
  constexpr __nv_fp8_interpretation_t kind = std::is_same<F8, c10::Float8_e5m2>::value ? __NV_E5M2 : __NV_E4M3;
  if (a != a || b != b) return static_cast<uint16_t>(F8(a).x) | static_cast<uint16_t>(F8(b).x) << 8;
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);  // a in the low byte
}

constexpr int kVecTile = 64, kVecThreads = 256;

template <typename T, typename F8>
__global__ void __launch_bounds__(kVecThreads)
    fp8_cast_vec_kernel(const T* __restrict__ x, const float* __restrict__ s, uint8_t* __restrict__ row,
                        uint8_t* __restrict__ col, float* __restrict__ scale_out, float* __restrict__ scale_inv_out,
                        float* __restrict__ amax_out, int64_t M, int64_t N, int mode, bool from_amax,
                        float fp8_max) {
  // +4 bytes a row: the transposed reads below hit 2 banks' worth of rows instead of one
  __shared__ __align__(16) uint8_t tile[kVecTile][kVecTile + 4];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kVecTile, n0 = static_cast<int64_t>(blockIdx.x) * kVecTile;
  const int t = threadIdx.x, c = (t & 7) * 8;  // this thread's 8 columns of the tile
  const float tensor_scale = mode == kTensor ? scale_from(s[0], fp8_max, from_amax) : 0.f;
  float col_scale[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) col_scale[j] = mode == kPerCol ? scale_from(s[n0 + c + j], fp8_max, from_amax) : 0.f;
  float amax = 0.f;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r = (t >> 3) + 32 * pass;
    const int64_t m = m0 + r;
    const Pack<T, 8> in = load_pack<T, 8>(x + m * N + n0 + c);
    const float row_scale = mode == kPerRow ? scale_from(s[m], fp8_max, from_amax) : tensor_scale;
    uint32_t q[2];
    if (amax_out != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = nan_max(amax, fabsf(static_cast<float>(in.v[j])));
    }
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const float a = clamp_fp8(static_cast<float>(in.v[j]) * (mode == kPerCol ? col_scale[j] : row_scale), fp8_max);
      const float b =
          clamp_fp8(static_cast<float>(in.v[j + 1]) * (mode == kPerCol ? col_scale[j + 1] : row_scale), fp8_max);
      const uint32_t pair = fp8_pair<F8>(a, b);
      if (j % 4 == 0) q[j / 4] = pair; else q[j / 4] |= pair << 16;
    }
    if (row != nullptr) *reinterpret_cast<uint2*>(row + m * N + n0 + c) = make_uint2(q[0], q[1]);
    if (col != nullptr) {
      *reinterpret_cast<uint32_t*>(&tile[r][c]) = q[0];
      *reinterpret_cast<uint32_t*>(&tile[r][c + 4]) = q[1];
    }
  }
  if (amax_out != nullptr) record_amax(amax_out, amax);
  if (col != nullptr) {
    __syncthreads();
    const int n = t >> 2, mc = (t & 3) * 16;  // col[n0 + n, m0 + mc .. + 16] = q[m0 + mc .. + 16, n0 + n]
    uint32_t out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[k] = static_cast<uint32_t>(tile[mc + 4 * k][n]) | static_cast<uint32_t>(tile[mc + 4 * k + 1][n]) << 8 |
               static_cast<uint32_t>(tile[mc + 4 * k + 2][n]) << 16 |
               static_cast<uint32_t>(tile[mc + 4 * k + 3][n]) << 24;
    }
    *reinterpret_cast<uint4*>(col + (n0 + n) * M + m0 + mc) = make_uint4(out[0], out[1], out[2], out[3]);
  }
  // The scales (scale_out only where made here), one thread per value: the first tile row or
  // column of blocks writes them.
  if (mode == kTensor && blockIdx.x == 0 && blockIdx.y == 0 && t == 0) {
    store_scale(scale_out, scale_inv_out, 0, tensor_scale);
  } else if (mode == kPerCol && blockIdx.y == 0 && t < kVecTile) {
    store_scale(scale_out, scale_inv_out, n0 + t, scale_from(s[n0 + t], fp8_max, from_amax));
  } else if (mode == kPerRow && blockIdx.x == 0 && t < kVecTile) {
    store_scale(scale_out, scale_inv_out, m0 + t, scale_from(s[m0 + t], fp8_max, from_amax));
  }
}

}  // namespace

std::vector<at::Tensor> fp8_cast(const at::Tensor& x, const at::Tensor& s, int64_t mode, bool from_amax, bool e5m2,
                                 bool row, bool col, const std::optional<at::Tensor>& amax_out) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "fp8_cast: x must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(s.is_cuda() && s.scalar_type() == at::kFloat && s.is_contiguous(), "fp8_cast: s must be contiguous fp32");
  TORCH_CHECK(!amax_out.has_value() || (amax_out->is_cuda() && amax_out->scalar_type() == at::kFloat &&
                                        amax_out->numel() == 1 && amax_out->device() == x.device()),
              "fp8_cast: amax_out must be one fp32 value on x's device");
  float* amax_ptr = amax_out.has_value() ? amax_out->data_ptr<float>() : nullptr;
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
  // the vectorised kernel: whole 64 x 64 tiles, and x aligned for 8-element reads (32 bytes in fp32)
  const bool vec = M % kVecTile == 0 && N % kVecTile == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 32 == 0;
  const dim3 grid(static_cast<unsigned>((N + kTile - 1) / kTile), static_cast<unsigned>((M + kTile - 1) / kTile));
  const dim3 block(kTile, kRowsPerPass);
  const dim3 vec_grid(static_cast<unsigned>(N / kVecTile), static_cast<unsigned>(M / kVecTile));
  P3D_DISPATCH_FLOATING(x.scalar_type(), "fp8_cast", [&] {
    using T = scalar_t;
    auto launch = [&](auto f8_tag) {
      using F8 = decltype(f8_tag);
      if (vec) {
        launch_kernel(fp8_cast_vec_kernel<T, F8>, vec_grid, dim3(kVecThreads), 0, x.data_ptr<T>(), s.data_ptr<float>(),
                      row ? static_cast<uint8_t*>(out_row.data_ptr()) : nullptr,
                      col ? static_cast<uint8_t*>(out_col.data_ptr()) : nullptr,
                      from_amax ? scale.data_ptr<float>() : nullptr, scale_inv.data_ptr<float>(), amax_ptr, M, N,
                      static_cast<int>(mode), from_amax, fp8_max);
        return;
      }
      launch_kernel(fp8_cast_kernel<T, F8>, grid, block, 0, x.data_ptr<T>(), s.data_ptr<float>(),
                    row ? static_cast<F8*>(out_row.data_ptr()) : nullptr,
                    col ? static_cast<F8*>(out_col.data_ptr()) : nullptr,
                    from_amax ? scale.data_ptr<float>() : nullptr, scale_inv.data_ptr<float>(), amax_ptr, M, N,
                    static_cast<int>(mode), from_amax, fp8_max);
    };
    if (e5m2) launch(c10::Float8_e5m2()); else launch(c10::Float8_e4m3fn());
  });
  return {out_row, out_col, scale, scale_inv};
}

}  // namespace p3d
