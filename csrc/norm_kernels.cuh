// LayerNorm / RMSNorm kernels shared by layer_norm.cu and rms_norm.cu
// (template flag RMS).  Statistics and arithmetic are fp32 for every dtype.
//
//   LayerNorm: xhat = (x - mean) * rstd,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
//   RMSNorm:   xhat = x * rstd,           rstd = 1 / sqrt(mean(x^2) + eps)
//   y = xhat * w (+ b)
//
// Forward launch geometry: one block per row (grid-stride over rows), with
// row_threads() threads, about 4 packs of VEC elements each.  The row is read
// from global memory once into a dynamic shared-memory cache (h elements of T,
// each thread touching only its own packs, so no barrier is needed around the
// cache), which gives an exact two-pass variance without a second read of x.
//
// Backward launch geometry: a persistent grid of as many blocks as fit on the
// GPU at once; each block walks rows r = blockIdx.x, += gridDim.x.  Per row:
// pass 1 reads x and dy, forms the two row sums that dx needs and adds
// dy * xhat (and dy) into this thread's own columns of a shared-memory
// accumulator; pass 2 re-reads x and dy (now in L1/L2) and writes dx.  At the
// end each block writes its accumulator as one partial row; sum_partials()
// reduces the partials into dweight/dbias (stage 2 of a two-stage reduction).
#pragma once

#include "common.cuh"

namespace p3d {

template <typename T, int VEC, bool RMS>
__global__ void norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                const T* __restrict__ b, T* __restrict__ y,
                                float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                int64_t rows, int64_t h, float eps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Pack<T, VEC>* cache = reinterpret_cast<Pack<T, VEC>*>(smem_raw);
  __shared__ float red[32];
  const int64_t nvec = h / VEC;
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * h;
    float sum = 0.f;
#pragma unroll 4
    for (int64_t i = tid; i < nvec; i += nt) {
      const Pack<T, VEC> p = load_pack<T, VEC>(xr + i * VEC);
      cache[i] = p;
#pragma unroll
      for (int v = 0; v < VEC; ++v) sum += static_cast<float>(p.v[v]);
    }
    float mean = 0.f;
    if (!RMS) mean = block_sum(sum, red) / static_cast<float>(h);
    float sq = 0.f;
#pragma unroll 4
    for (int64_t i = tid; i < nvec; i += nt) {
      const Pack<T, VEC> p = cache[i];
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float d = static_cast<float>(p.v[v]) - mean;
        sq += d * d;
      }
    }
    const float rstd = rsqrtf(block_sum(sq, red) / static_cast<float>(h) + eps);
    if (tid == 0) {
      if (!RMS) mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
    T* yr = y + r * h;
#pragma unroll 4
    for (int64_t i = tid; i < nvec; i += nt) {
      const Pack<T, VEC> p = cache[i];
      const Pack<T, VEC> wp = load_pack<T, VEC>(w + i * VEC);
      Pack<T, VEC> bp;
      if (!RMS && b != nullptr) bp = load_pack<T, VEC>(b + i * VEC);
      Pack<T, VEC> o;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float val = (static_cast<float>(p.v[v]) - mean) * rstd * static_cast<float>(wp.v[v]);
        if (!RMS && b != nullptr) val += static_cast<float>(bp.v[v]);
        o.v[v] = static_cast<T>(val);
      }
      store_pack<T, VEC>(yr + i * VEC, o);
    }
  }
}

template <typename T, int VEC, bool RMS>
__global__ void norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                const T* __restrict__ w, T* __restrict__ dx,
                                float* __restrict__ dw_part, float* __restrict__ db_part,
                                int64_t rows, int64_t h) {
  // Accumulators: dw over [0, h) then, for LayerNorm with bias, db over [h, 2h).
  // Column i * VEC + v lives at acc[v * nvec + i] so that the 32 lanes of a
  // warp (consecutive i) hit 32 consecutive words: no bank conflicts.
  extern __shared__ __align__(16) float acc[];
  __shared__ float red[64];
  const int64_t nvec = h / VEC;
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool with_db = db_part != nullptr;
  for (int64_t i = tid; i < nvec; i += nt) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      acc[v * nvec + i] = 0.f;
      if (with_db) acc[h + v * nvec + i] = 0.f;
    }
  }
  const float inv_h = 1.f / static_cast<float>(h);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * h;
    const T* dyr = dy + r * h;
    const float mean = RMS ? 0.f : mean_in[r];
    const float rstd = rstd_in[r];
    float s_g = 0.f, s_gx = 0.f;  // sum(dy * w), sum(dy * w * xhat)
#pragma unroll 2
    for (int64_t i = tid; i < nvec; i += nt) {
      const Pack<T, VEC> xp = load_pack<T, VEC>(xr + i * VEC);
      const Pack<T, VEC> gp = load_pack<T, VEC>(dyr + i * VEC);
      const Pack<T, VEC> wp = load_pack<T, VEC>(w + i * VEC);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float xh = (static_cast<float>(xp.v[v]) - mean) * rstd;
        const float d = static_cast<float>(gp.v[v]);
        const float g = d * static_cast<float>(wp.v[v]);
        s_g += g;
        s_gx += g * xh;
        acc[v * nvec + i] += d * xh;
        if (with_db) acc[h + v * nvec + i] += d;
      }
    }
    const float2 s = block_sum2(s_g, s_gx, red);
    const float c1 = RMS ? 0.f : s.x * inv_h;
    const float c2 = s.y * inv_h;
    T* dxr = dx + r * h;
#pragma unroll 2
    for (int64_t i = tid; i < nvec; i += nt) {
      const Pack<T, VEC> xp = load_pack<T, VEC>(xr + i * VEC);
      const Pack<T, VEC> gp = load_pack<T, VEC>(dyr + i * VEC);
      const Pack<T, VEC> wp = load_pack<T, VEC>(w + i * VEC);
      Pack<T, VEC> o;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float xh = (static_cast<float>(xp.v[v]) - mean) * rstd;
        const float g = static_cast<float>(gp.v[v]) * static_cast<float>(wp.v[v]);
        o.v[v] = static_cast<T>(rstd * (g - c1 - xh * c2));
      }
      store_pack<T, VEC>(dxr + i * VEC, o);
    }
  }
  // Each thread wrote only its own columns of acc, so no barrier is needed.
  for (int64_t i = tid; i < nvec; i += nt) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      dw_part[blockIdx.x * h + i * VEC + v] = acc[v * nvec + i];
      if (with_db) db_part[blockIdx.x * h + i * VEC + v] = acc[h + v * nvec + i];
    }
  }
}

// ---- host side ----

// Largest hidden size the kernels take (the shared-memory cache and the
// backward accumulators grow with it); the Python wrappers fall back to PyTorch
// beyond it.
constexpr int64_t kMaxNormHidden = 16384;

template <typename T>
inline bool norm_use_vec(int64_t h, std::initializer_list<const void*> ptrs) {
  if (h % vec16<T>() != 0) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

inline void norm_check(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                       const char* name) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, name,
              ": x must be a contiguous 2-D [rows, hidden] CUDA tensor, got ", x.sizes());
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= kMaxNormHidden, name, ": hidden size must be in [1, ",
              kMaxNormHidden, "], got ", x.size(1));
  TORCH_CHECK(w.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(1) &&
                  w.scalar_type() == x.scalar_type() && w.device() == x.device(),
              name, ": weight must be a contiguous vector of size ", x.size(1),
              " with x's dtype and device, got ", w.sizes(), " ", w.scalar_type());
  if (b) {
    TORCH_CHECK(b->is_contiguous() && b->dim() == 1 && b->size(0) == x.size(1) &&
                    b->scalar_type() == x.scalar_type() && b->device() == x.device(),
                name, ": bias must be a contiguous vector of size ", x.size(1),
                " with x's dtype and device, got ", b->sizes(), " ", b->scalar_type());
  }
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
        auto kernel = norm_fwd_kernel<T, VEC, RMS>;
        const int threads = row_threads(h / VEC, 4);
        const size_t smem = static_cast<size_t>(h) * sizeof(T);
        if (smem > 48 * 1024)
          C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
        const int64_t grid = rows < (int64_t{1} << 30) ? rows : (int64_t{1} << 30);
        kernel<<<static_cast<unsigned>(grid), threads, smem, stream>>>(
            x.data_ptr<T>(), w.data_ptr<T>(), bp, y.data_ptr<T>(),
            RMS ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, h,
            static_cast<float>(eps));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (norm_use_vec<T>(h, {x.data_ptr(), w.data_ptr(), bp, y.data_ptr()}))
        launch(std::integral_constant<int, vec16<T>()>{});
      else
        launch(std::integral_constant<int, 1>{});
    });
  }
  if (RMS) return {y, rstd};
  return {y, mean, rstd};
}

// Backward: returns {dx, dweight, dbias (if has_bias)}.
template <bool RMS>
std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                 const at::Tensor& rstd, const at::Tensor& w, bool has_bias,
                                 const char* name) {
  norm_check(x, w, std::nullopt, name);
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              name, ": grad must be contiguous with x's shape and dtype");
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
  at::Tensor dw_part, db_part;
  P3D_DISPATCH_FLOATING(x.scalar_type(), name, [&] {
    using T = scalar_t;
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      auto kernel = norm_bwd_kernel<T, VEC, RMS>;
      const int threads = row_threads(h / VEC, 4);
      const size_t smem = static_cast<size_t>(h) * sizeof(float) * (with_db ? 2 : 1);
      if (smem > 48 * 1024)
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
      int per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
      TORCH_CHECK(per_sm > 0, name, ": hidden size ", h, " needs ", smem,
                  " bytes of shared memory per block, more than this GPU offers");
      int64_t grid = static_cast<int64_t>(per_sm) * sm_count();
      grid = grid < rows ? grid : rows;
      dw_part = new_output({grid, h}, x.options().dtype(at::kFloat));
      if (with_db) db_part = new_output({grid, h}, x.options().dtype(at::kFloat));
      kernel<<<static_cast<unsigned>(grid), threads, smem, stream>>>(
          dy.data_ptr<T>(), x.data_ptr<T>(), RMS ? nullptr : mean.data_ptr<float>(),
          rstd.data_ptr<float>(), w.data_ptr<T>(), dx.data_ptr<T>(), dw_part.data_ptr<float>(),
          with_db ? db_part.data_ptr<float>() : nullptr, rows, h);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (norm_use_vec<T>(h, {dy.data_ptr(), x.data_ptr(), w.data_ptr(), dx.data_ptr()}))
      launch(std::integral_constant<int, vec16<T>()>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
  std::vector<at::Tensor> out{dx, sum_partials(dw_part, w.scalar_type())};
  if (with_db) out.push_back(sum_partials(db_part, w.scalar_type()));
  return out;
}

}  // namespace p3d
