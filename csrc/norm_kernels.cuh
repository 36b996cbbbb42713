// LayerNorm / RMSNorm kernels shared by layer_norm.cu and rms_norm.cu
// (template flag RMS).  Statistics and arithmetic are fp32 for every dtype.
//
//   LayerNorm: xhat = (x - mean) * rstd,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
//   RMSNorm:   xhat = x * rstd,           rstd = 1 / sqrt(mean(x^2) + eps)
//   y = xhat * w (+ b)
//   dx = rstd * (dy * w - c1 - xhat * c2),  c1 = mean(dy * w) (LayerNorm only),
//        c2 = mean(dy * w * xhat);  dw = sum over rows of dy * xhat,  db = sum of dy
//
// Both passes hold each row in registers (RowFrag, common.cuh): a row group of
// blockDim.x threads owns a row, P packs per thread, blockDim.y rows per block.
// So x (and dy) are read from memory exactly once and the exact two-pass
// variance costs no second read.
//
// Backward runs a persistent grid (as many blocks as fit on the GPU) walking
// rows r = blockIdx.x * R + threadIdx.y, += gridDim.x * R.  A thread always
// owns the same columns, so it accumulates dw (and db) for them across all its
// rows, in its own slots of shared memory (registers would not hold them for
// long rows).  At the end the block's row groups are summed (in a fixed order)
// into one partial row per block, and sum_partials() reduces the partials
// (stage 2 of a two-stage, deterministic reduction; dw and db in one pass).
// Each thread loads its next row (x, dy and the row's statistics) before it
// reduces the current one, so those loads overlap the block-wide reduction.
#pragma once

#include "common.cuh"

namespace p3d {

// Packs per thread at least (so threads per row at most): forward takes 4 so
// that a row group is small and many rows are in flight per SM; backward takes
// 1 where the row allows, which measured best with its shared-memory
// accumulators (bf16 on H100, hidden 2048..8192; BENCHMARKS.md).
constexpr int kNormFwdMinPacks = 4;
constexpr int kNormBwdMinPacks = 1;
// Backward block size: two rows of 256 threads a block (hidden 2048 in bf16) rather than one halves the
// partial rows that stage 2 reads back, at the same rows in flight per SM (BENCHMARKS.md).
constexpr int kNormBwdBlockThreads = 512;

template <typename T, int VEC, int P, bool RMS>
__global__ void __launch_bounds__(kMaxRowBlockThreads)
    norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                    T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                    int64_t rows, int64_t h, float eps) {
  __shared__ float red[kMaxRowsPerBlock][32];
  const int64_t nvec = h / VEC;
  const int64_t R = blockDim.y;
  const float inv_h = 1.f / static_cast<float>(h);
  // The loop bound is the same for the whole block: every thread reaches every barrier.
  for (int64_t r0 = blockIdx.x * R; r0 < rows; r0 += gridDim.x * R) {
    const int64_t r = r0 + threadIdx.y;
    const bool valid = r < rows;
    RowFrag<T, VEC, P> xf;
    xf.load(x + r * h, nvec, valid);
    float mean = 0.f;
    if (!RMS) {
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < P; ++k)
#pragma unroll
        for (int v = 0; v < VEC; ++v) sum += xf.f(k, v);
      mean = block_sum(sum, red[threadIdx.y]) * inv_h;
    }
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (frag_index(k) < nvec) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float d = xf.f(k, v) - mean;
          sq += d * d;
        }
      }
    }
    const float rstd = rsqrtf(block_sum(sq, red[threadIdx.y]) * inv_h + eps);
    if (!valid) continue;
    if (threadIdx.x == 0) {
      if (!RMS) mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int64_t i = frag_index(k);
      if (i >= nvec) continue;
      const Pack<T, VEC> wp = load_pack<T, VEC>(w + i * VEC);
      Pack<T, VEC> bp;
      if (!RMS && b != nullptr) bp = load_pack<T, VEC>(b + i * VEC);
      Pack<T, VEC> o;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float val = (xf.f(k, v) - mean) * rstd * static_cast<float>(wp.v[v]);
        if (!RMS && b != nullptr) val += static_cast<float>(bp.v[v]);
        o.v[v] = static_cast<T>(val);
      }
      store_pack<T, VEC>(y + r * h + i * VEC, o);
    }
  }
}

// Shared-memory slots of the backward's dw/db accumulators.  A thread's k-th
// pack, element v, lives at slot(k, v); for VEC a multiple of 4 the slots of 4
// consecutive elements form one float4 and lanes are 16 bytes apart, else lanes
// are 4 bytes apart: either way a warp's access is conflict-free.
template <int VEC>
struct AccSlots {
  static constexpr int W = VEC % 4 == 0 ? 4 : 1;  // floats per access
  __device__ __forceinline__ static int slot(int k, int v, int tx, int tid) {
    return ((k * (VEC / W) + v / W) * tx + tid) * W + v % W;
  }
  // Column (within the row) of slot e, the inverse of slot().
  __device__ __forceinline__ static int64_t column(int e, int tx) {
    const int q = e / W, lane_v = e % W;
    const int kv = q / tx, t = q % tx;  // kv = k * (VEC / W) + v / W
    const int k = kv / (VEC / W), v = (kv % (VEC / W)) * W + lane_v;
    return (static_cast<int64_t>(k) * tx + t) * VEC + v;
  }
  // acc[slot(k, v)] += add[v] for v < VEC.
  __device__ __forceinline__ static void add(float* acc, int k, int tx, int tid, const float (&a)[VEC]) {
    if constexpr (W == 4) {
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        float4* p = reinterpret_cast<float4*>(acc + slot(k, 4 * q, tx, tid));
        float4 c = *p;
        c.x += a[4 * q];
        c.y += a[4 * q + 1];
        c.z += a[4 * q + 2];
        c.w += a[4 * q + 3];
        *p = c;
      }
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[slot(k, v, tx, tid)] += a[v];
    }
  }
};

// part: [gridDim.x, ncols] with ncols = h (RMSNorm, or LayerNorm without a
// bias) or 2h (dw then db): this block's partial row.
template <typename T, int VEC, int P, bool RMS>
__global__ void __launch_bounds__(kMaxRowBlockThreads)
    norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                    const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                    const T* __restrict__ w, const T* __restrict__ dres, T* __restrict__ dx,
                    float* __restrict__ part, int64_t rows, int64_t h, bool with_db) {
  // Per row group: dw slots then (LayerNorm) db slots, P * VEC * blockDim.x
  // each (AccSlots).
  extern __shared__ __align__(16) float acc_all[];
  __shared__ float red[kMaxRowsPerBlock][64];
  const int64_t nvec = h / VEC;
  const int64_t R = blockDim.y, stride = gridDim.x * R;
  const int tx = blockDim.x, tid = threadIdx.x;
  const int slots = P * VEC * tx;  // >= h
  float* acc = acc_all + threadIdx.y * (RMS ? 1 : 2) * slots;
  const float inv_h = 1.f / static_cast<float>(h);
  RowFrag<T, VEC, P> wf;
  wf.load(w, nvec, true);
  using Slots = AccSlots<VEC>;
#pragma unroll
  for (int k = 0; k < P; ++k)
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      acc[Slots::slot(k, v, tx, tid)] = 0.f;
      if (!RMS) acc[slots + Slots::slot(k, v, tx, tid)] = 0.f;
    }

  int64_t r = blockIdx.x * R + threadIdx.y;
  RowFrag<T, VEC, P> xn, gn;  // the next row's x and dy
  xn.load(x + r * h, nvec, r < rows);
  gn.load(dy + r * h, nvec, r < rows);
  float mean_n = (RMS || r >= rows) ? 0.f : mean_in[r], rstd_n = r < rows ? rstd_in[r] : 0.f;
  // The loop bound is the same for the whole block: every thread reaches every barrier.
  for (int64_t r0 = blockIdx.x * R; r0 < rows; r0 += stride, r += stride) {
    const bool valid = r < rows;
    const RowFrag<T, VEC, P> xf = xn, gf = gn;
    const float mean = mean_n, rstd = rstd_n;
    const int64_t rn = r + stride;
    xn.load(x + rn * h, nvec, rn < rows);
    gn.load(dy + rn * h, nvec, rn < rows);
    mean_n = (RMS || rn >= rows) ? 0.f : mean_in[rn];
    rstd_n = rn < rows ? rstd_in[rn] : 0.f;
    // Padding and invalid rows hold dy = 0 and add nothing below.
    float s_g = 0.f, s_gx = 0.f;  // sum(dy * w), sum(dy * w * xhat)
#pragma unroll
    for (int k = 0; k < P; ++k) {
      float dwk[VEC], dbk[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float xh = (xf.f(k, v) - mean) * rstd;
        const float d = gf.f(k, v);
        const float g = d * wf.f(k, v);
        s_g += g;
        s_gx += g * xh;
        dwk[v] = d * xh;
        dbk[v] = d;
      }
      Slots::add(acc, k, tx, tid, dwk);
      if (!RMS) Slots::add(acc + slots, k, tx, tid, dbk);
    }
    const float2 s = block_sum2(s_g, s_gx, red[threadIdx.y]);
    if (!valid) continue;
    const float c1 = RMS ? 0.f : s.x * inv_h;
    const float c2 = s.y * inv_h;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int64_t i = frag_index(k);
      if (i >= nvec) continue;
      Pack<T, VEC> o, rp;
      if (dres != nullptr) rp = load_pack<T, VEC>(dres + r * h + i * VEC);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float xh = (xf.f(k, v) - mean) * rstd;
        const float g = rstd * (gf.f(k, v) * wf.f(k, v) - c1 - xh * c2);
        o.v[v] = static_cast<T>(dres != nullptr ? g + static_cast<float>(rp.v[v]) : g);
      }
      store_pack<T, VEC>(dx + r * h + i * VEC, o);
    }
  }

  // Sum the row groups' slots (group 0 first) into this block's partial row.
  __syncthreads();
  const int64_t ncols = with_db ? 2 * h : h;
  const int group_slots = (RMS ? 1 : 2) * slots;
  for (int e = threadIdx.y * tx + tid; e < (with_db ? 2 : 1) * slots; e += R * tx) {
    const int half = e / slots;  // 1: db
    const int64_t col = Slots::column(e - half * slots, tx);
    if (col >= h) continue;
    float sum = 0.f;
    for (int g = 0; g < R; ++g) sum += acc_all[g * group_slots + e];
    part[blockIdx.x * ncols + half * h + col] = sum;
  }
}

// ---- host side ----

// Largest hidden size the kernels take (a row must fit in the registers of
// 1024 threads); the Python wrappers fall back to PyTorch beyond it.
constexpr int64_t kMaxNormHidden = 16384;

inline void norm_check(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                       const char* name) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, name,
              ": x must be a contiguous 2-D [rows, hidden] CUDA tensor, got ", x.sizes());
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= kMaxNormHidden, name, ": hidden size must be in [1, ",
              kMaxNormHidden, "], got ", x.size(1));
  check_row_vector(w, x, "weight", name);
  if (b) check_row_vector(*b, x, "bias", name);
}

// Forward: returns {y, mean (LayerNorm only; else undefined), rstd}.
template <bool RMS>
std::vector<at::Tensor> norm_fwd(const at::Tensor& x, const at::Tensor& w,
                                 const std::optional<at::Tensor>& b, double eps, const char* name) {
  norm_check(x, w, b, name);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), h = x.size(1);
  at::Tensor y = new_output(x.sizes(), x.options());
  at::Tensor mean = RMS ? at::Tensor() : new_output({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = new_output({rows}, x.options().dtype(at::kFloat));
  if (rows > 0) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    P3D_DISPATCH_FLOATING(x.scalar_type(), name, [&] {
      using T = scalar_t;
      const T* bp = b ? b->data_ptr<T>() : nullptr;
      auto launch = [&](auto vec_tag) {
        constexpr int VEC = decltype(vec_tag)::value;
        const RowGroups g = row_groups(h / VEC, kNormFwdMinPacks, max_packs_per_thread<VEC>());
        dispatch_packs_per_thread<VEC>(g.P, [&](auto p_tag) {
          constexpr int P = decltype(p_tag)::value;
          int64_t grid = (rows + g.block.y - 1) / g.block.y;
          grid = grid < (int64_t{1} << 30) ? grid : (int64_t{1} << 30);
          norm_fwd_kernel<T, VEC, P, RMS><<<static_cast<unsigned>(grid), g.block, 0, stream>>>(
              x.data_ptr<T>(), w.data_ptr<T>(), bp, y.data_ptr<T>(),
              RMS ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, h,
              static_cast<float>(eps));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      };
      dispatch_vec<T>(use_vec<T>(h, {x.data_ptr(), w.data_ptr(), bp, y.data_ptr()}), launch);
    });
  }
  if (RMS) return {y, rstd};
  return {y, mean, rstd};
}

// Backward: returns {dx, dweight, dbias (if has_bias)}. With `dres` (the gradient of the residual
// branch that reads the same x), dx is the norm's input gradient plus dres, added in fp32 and rounded
// once: autograd's separate add of the two (a read of two tensors and a write) does not run.
template <bool RMS>
std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                 const at::Tensor& rstd, const at::Tensor& w, bool has_bias,
                                 const std::optional<at::Tensor>& dres, const char* name) {
  norm_check(x, w, std::nullopt, name);
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              name, ": grad must be contiguous with x's shape and dtype");
  TORCH_CHECK(!dres || (dres->is_contiguous() && dres->sizes() == x.sizes() &&
                        dres->scalar_type() == x.scalar_type() && dres->device() == x.device()),
              name, ": the residual's gradient must be contiguous with x's shape, dtype and device");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows, name,
              ": rstd must be float32 with one entry per row");
  if (!RMS)
    TORCH_CHECK(mean.scalar_type() == at::kFloat && mean.numel() == rows, name,
                ": mean must be float32 with one entry per row");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = new_output(x.sizes(), x.options());
  if (rows == 0) {
    std::vector<at::Tensor> out{dx, at::zeros_like(w)};
    if (has_bias) out.push_back(at::zeros_like(w));
    return out;
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool with_db = !RMS && has_bias;
  at::Tensor part;
  P3D_DISPATCH_FLOATING(x.scalar_type(), name, [&] {
    using T = scalar_t;
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const RowGroups g =
          row_groups(h / VEC, kNormBwdMinPacks, max_packs_per_thread<VEC>(), kNormBwdBlockThreads);
      dispatch_packs_per_thread<VEC>(g.P, [&](auto p_tag) {
        constexpr int P = decltype(p_tag)::value;
        auto kernel = norm_bwd_kernel<T, VEC, P, RMS>;
        const int threads = static_cast<int>(g.block.x * g.block.y);
        const size_t smem = static_cast<size_t>(g.block.y) * (RMS ? 1 : 2) * P * VEC * g.block.x * sizeof(float);
        allow_dynamic_smem(kernel, smem);
        int per_sm = 0;
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
        TORCH_CHECK(per_sm > 0, name, ": hidden size ", h, " needs ", smem,
                    " bytes of shared memory per block, more than this GPU offers");
        int64_t grid = static_cast<int64_t>(per_sm) * sm_count();
        const int64_t needed = (rows + g.block.y - 1) / g.block.y;
        grid = grid < needed ? grid : needed;
        part = new_output({grid, with_db ? 2 * h : h}, x.options().dtype(at::kFloat));
        kernel<<<static_cast<unsigned>(grid), g.block, smem, stream>>>(
            dy.data_ptr<T>(), x.data_ptr<T>(), RMS ? nullptr : mean.data_ptr<float>(),
            rstd.data_ptr<float>(), w.data_ptr<T>(), dres ? dres->data_ptr<T>() : nullptr, dx.data_ptr<T>(),
            part.data_ptr<float>(), rows, h, with_db);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    };
    dispatch_vec<T>(use_vec<T>(h, {dy.data_ptr(), x.data_ptr(), w.data_ptr(), dx.data_ptr(),
                                   dres ? dres->data_ptr() : nullptr}), launch);
  });
  // One stage-2 pass for dw and db together; they come back as two halves of one tensor.
  at::Tensor sums = sum_partials(part, w.scalar_type());
  if (!with_db) return {dx, sums};
  return {dx, sums.narrow(0, 0, h), sums.narrow(0, h, h)};
}

}  // namespace p3d
