// Bias + dropout + residual add, forward and backward.
//
//   forward:  out = residual + mask * (x + bias) / (1 - p)
//   backward: dx = dy * mask / (1 - p),  dresidual = dy (done in Python),
//             dbias = sum over rows of dx
//
// Randomness contract.  The mask is a pure function of (seed, offset, element
// index): element e keeps its value iff u(e) >= t, where u(e) is a 16-bit
// uniform, half e % 2 (low half first) of word (e % 8) / 2 of Philox4x32-10
// with key = seed and counter = (e / 8, offset), and t = round(p * 65536).  So
// the keep probability is 1 - p rounded to a multiple of 2^-16 (FlashAttention
// rounds it to 2^-8), while the scale stays exactly 1 / (1 - p).  Sixteen bits
// per element halve the Philox work against one 32-bit word per element; at
// bf16 sizes that work, not memory, bounded the backward pass.
// (seed, offset) come from the CUDA generator passed in (the device's default
// generator when none is), through philox_cuda_state(), exactly as PyTorch's
// own dropout draws them; each call advances the generator's offset by 4.  So
// restoring the generator state (torch.cuda.set_rng_state, Generator.set_state,
// or an RNG tracker fork) and re-running gives the same mask, which is what
// activation recomputation needs, and it works under CUDA-graph capture.
// The forward kernel writes (seed, offset) to a 2-element int64 device tensor;
// the backward kernel regenerates the mask from it, so no mask is stored.
// The mask does not depend on the launch geometry or the vector width.
//
// Launch geometry: block (32, 8) over (column packs, rows), see row_col_grid;
// one pass over memory each way, bias-gradient partials in registers.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>

#include <cmath>
#include <mutex>

#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

// Philox4x32-10 (Salmon et al., SC'11), the generator behind curand's Philox.
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(M0, ctr.x), lo0 = M0 * ctr.x;
    const uint32_t hi1 = __umulhi(M1, ctr.z), lo1 = M1 * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    key.x += W0;
    key.y += W1;
  }
  return ctr;
}

__device__ __forceinline__ uint4 philox_block(uint64_t seed, uint64_t offset, uint64_t block) {
  return philox4x32_10(make_uint4(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                  static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)),
                       make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
}

// Keep flags for the VEC consecutive elements starting at flat index e0.
// VEC is 1, or 4 or 8 with e0 % VEC == 0 (the vectorised paths); a Philox
// block of 128 bits covers 8 elements.
template <int VEC>
__device__ __forceinline__ void keep_flags(uint64_t seed, uint64_t offset, int64_t e0,
                                           uint32_t threshold, bool (&keep)[VEC]) {
  static_assert(VEC == 1 || VEC == 4 || VEC == 8, "keep_flags: VEC must be 1, 4 or 8");
  const uint4 r = philox_block(seed, offset, static_cast<uint64_t>(e0) >> 3);
  // Position of the first element in its block of 8: 0 for VEC == 8; selects,
  // not an indexed array, so that nothing spills to local memory.
  const int first = VEC == 8 ? 0 : static_cast<int>(e0 & 7);
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const int e = first + v;
    const uint32_t word = e < 2 ? r.x : e < 4 ? r.y : e < 6 ? r.z : r.w;
    const uint32_t u16 = (e & 1) ? word >> 16 : word & 0xFFFFu;
    keep[v] = u16 >= threshold;
  }
}

template <typename T, int VEC, bool DROP>
__global__ void bias_dropout_add_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                            const T* __restrict__ residual, T* __restrict__ out,
                                            int64_t rows, int64_t cols, uint32_t threshold,
                                            float scale, at::PhiloxCudaState philox,
                                            int64_t* __restrict__ seed_offset) {
  uint64_t seed = 0, offset = 0;
  if (DROP) {
    const auto so = at::cuda::philox::unpack(philox);
    seed = std::get<0>(so);
    offset = std::get<1>(so);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
      seed_offset[0] = static_cast<int64_t>(seed);
      seed_offset[1] = static_cast<int64_t>(offset);
    }
  }
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  if (col >= cols) return;
  float b[VEC];
  load_bias<T, VEC>(bias, col, b);
  const int64_t step = static_cast<int64_t>(gridDim.y) * 8;
#pragma unroll 2
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < rows; r += step) {
    const int64_t e0 = r * cols + col;
    const Pack<T, VEC> xp = load_pack<T, VEC>(x + e0);
    const Pack<T, VEC> rp = load_pack<T, VEC>(residual + e0);
    bool keep[VEC];
    if (DROP) {
      keep_flags<VEC>(seed, offset, e0, threshold, keep);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) keep[v] = true;
    }
    Pack<T, VEC> op;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float h = keep[v] ? (static_cast<float>(xp.v[v]) + b[v]) * scale : 0.f;
      op.v[v] = static_cast<T>(static_cast<float>(rp.v[v]) + h);
    }
    store_pack<T, VEC>(out + e0, op);
  }
}

template <typename T, int VEC>
__global__ void bias_dropout_add_bwd_kernel(const T* __restrict__ dy, T* __restrict__ dx,
                                            float* __restrict__ dbias_part, int64_t rows,
                                            int64_t cols, uint32_t threshold, float scale,
                                            const int64_t* __restrict__ seed_offset) {
  __shared__ float sm[8 * 32 * VEC];
  const uint64_t seed = static_cast<uint64_t>(seed_offset[0]);
  const uint64_t offset = static_cast<uint64_t>(seed_offset[1]);
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
  if (col < cols) {
    const int64_t step = static_cast<int64_t>(gridDim.y) * 8;
#pragma unroll 2
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; r < rows; r += step) {
      const int64_t e0 = r * cols + col;
      const Pack<T, VEC> gp = load_pack<T, VEC>(dy + e0);
      bool keep[VEC];
      keep_flags<VEC>(seed, offset, e0, threshold, keep);
      Pack<T, VEC> op;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float g = keep[v] ? static_cast<float>(gp.v[v]) * scale : 0.f;
        op.v[v] = static_cast<T>(g);
        acc[v] += g;
      }
      store_pack<T, VEC>(dx + e0, op);
    }
  }
  if (dbias_part != nullptr) write_block_partial<VEC>(acc, sm, dbias_part + blockIdx.y * cols, cols);
}

// Elements whose 16-bit uniform is below this are dropped: round(p * 2^16),
// at most 65535 since p < 1.
uint32_t dropout_threshold(double prob) {
  const double t = std::nearbyint(prob * 65536.0);
  return static_cast<uint32_t>(t < 0.0 ? 0.0 : (t > 65535.0 ? 65535.0 : t));
}

}  // namespace

std::vector<at::Tensor> bias_dropout_add_fwd(const at::Tensor& x,
                                             const std::optional<at::Tensor>& bias,
                                             const at::Tensor& residual, double prob,
                                             std::optional<at::Generator> generator) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "bias_dropout_add: x must be a contiguous CUDA tensor");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type() && residual.device() == x.device(),
              "bias_dropout_add: residual must be contiguous with x's shape, dtype and device; got ",
              residual.sizes(), " vs ", x.sizes());
  TORCH_CHECK(prob >= 0.0 && prob < 1.0, "bias_dropout_add: prob must be in [0, 1), got ", prob);
  TORCH_CHECK(x.dim() >= 1, "bias_dropout_add: x must have at least one dimension");
  if (bias) check_row_vector(*bias, x, "bias", "bias_dropout_add");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = new_output(x.sizes(), x.options());
  at::Tensor seed_offset = at::zeros({2}, x.options().dtype(at::kLong));
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (x.numel() == 0) return {out, seed_offset};
  const bool drop = prob > 0.0;
  at::PhiloxCudaState philox;
  if (drop) {
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        generator, at::cuda::detail::getDefaultCUDAGenerator(x.get_device()));
    TORCH_CHECK(gen->device().is_cuda() &&
                    (!gen->device().has_index() || gen->device().index() == x.get_device()),
                "bias_dropout_add: generator is on ", gen->device(), " but x is on ", x.device());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(4);
  }
  const uint32_t threshold = dropout_threshold(prob);
  const float scale = drop ? static_cast<float>(1.0 / (1.0 - prob)) : 1.f;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "bias_dropout_add", [&] {
    using T = scalar_t;
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    const bool vec = use_vec<T>(cols, {x.data_ptr(), bp, residual.data_ptr(), out.data_ptr()});
    dispatch_vec<T>(vec, drop, [&](auto vec_tag, auto drop_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const RowColGrid g = row_col_grid(rows, cols / VEC);
      launch_kernel(bias_dropout_add_fwd_kernel<T, VEC, decltype(drop_tag)::value>, g.grid, g.block, 0,
                    x.data_ptr<T>(), bp, residual.data_ptr<T>(), out.data_ptr<T>(), rows, cols, threshold, scale,
                    philox, seed_offset.data_ptr<int64_t>());
    });
  });
  return {out, seed_offset};
}

std::vector<at::Tensor> bias_dropout_add_bwd(const at::Tensor& dy, const at::Tensor& seed_offset,
                                             double prob, bool has_bias) {
  TORCH_CHECK(dy.is_cuda() && dy.is_contiguous() && dy.dim() >= 1,
              "bias_dropout_add backward: grad must be a contiguous CUDA tensor");
  TORCH_CHECK(seed_offset.scalar_type() == at::kLong && seed_offset.numel() == 2 &&
                  seed_offset.device() == dy.device(),
              "bias_dropout_add backward: seed_offset must be the int64[2] tensor from forward");
  TORCH_CHECK(prob > 0.0 && prob < 1.0, "bias_dropout_add backward: prob must be in (0, 1), got ", prob);
  c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dx = new_output(dy.sizes(), dy.options());
  const int64_t cols = dy.size(-1), rows = cols == 0 ? 0 : dy.numel() / cols;
  if (dy.numel() == 0) return dx_and_dbias(dx, has_bias, at::Tensor(), cols);
  const uint32_t threshold = dropout_threshold(prob);
  const float scale = static_cast<float>(1.0 / (1.0 - prob));
  at::Tensor part;
  P3D_DISPATCH_FLOATING(dy.scalar_type(), "bias_dropout_add backward", [&] {
    using T = scalar_t;
    dispatch_vec<T>(use_vec<T>(cols, {dy.data_ptr(), dx.data_ptr()}), [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const RowColGrid g = row_col_grid(rows, cols / VEC);
      launch_kernel(bias_dropout_add_bwd_kernel<T, VEC>, g.grid, g.block, 0, dy.data_ptr<T>(), dx.data_ptr<T>(),
                    new_partials(part, has_bias, g, cols, dy), rows, cols, threshold, scale,
                    seed_offset.data_ptr<int64_t>());
    });
  });
  return dx_and_dbias(dx, has_bias, part, cols);
}

}  // namespace p3d
