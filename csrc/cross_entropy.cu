// Cross-entropy over a row of logits that holds the whole vocabulary (tensor parallelism 1), forward
// and backward, for rows of bf16 / fp16 / fp32 logits [rows, padded] whose first `vocab` columns are
// real (the rest, vocabulary padding, take no part):
//
//   forward:  lse = log sum_{j < vocab} exp(x_j)                      (fp32, kept for the backward)
//             loss = (1 - e) (lse - x_t) + e (lse - mean_{j < vocab} x_j)   (e: label smoothing)
//   backward: dx_j = g (exp(x_j - lse) - (1 - e) [j == t] - e / vocab) for j < vocab, 0 beyond
//
// The forward reads each logit once (an online max and sum of exponentials per thread, merged across
// the block) and writes two floats per row; the backward reads each logit once and writes its
// gradient once, in the logits' dtype.  So the loss keeps the logits themselves for the backward
// rather than fp32 log-probabilities (half the bytes for bf16), and makes 3 passes over them instead
// of the ~10 of log_softmax + gather + exp + scatter + scale.  A target outside [0, vocab) gives a
// NaN loss (and a NaN gradient row), which the training step's NaN check reports.
#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

constexpr int kThreads = 512;

// A thread's running (max, sum of exp(x - max)) merged with another's.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  s = (m == -INFINITY ? 0.f : s * __expf(m - mm)) + (m2 == -INFINITY ? 0.f : s2 * __expf(m2 - mm));
  m = mm;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) cross_entropy_fwd_kernel(
    const T* __restrict__ x, const int64_t* __restrict__ target, float* __restrict__ loss,
    float* __restrict__ lse_out, int64_t rows, int64_t padded, int64_t vocab, float smoothing) {
  __shared__ float red[64];
  const int tid = threadIdx.x;
  const int64_t npack = (vocab + VEC - 1) / VEC;  // packs holding real columns (the last may be partial)
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * padded;
    float m = -INFINITY, s = 0.f, sum_x = 0.f;
    for (int64_t i = tid; i < npack; i += kThreads) {
      const Pack<T, VEC> p = load_pack<T, VEC>(xr + i * VEC);
      float v[VEC];
      float pm = -INFINITY;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        v[k] = i * VEC + k < vocab ? static_cast<float>(p.v[k]) : -INFINITY;
        pm = fmaxf(pm, v[k]);
      }
      float ps = 0.f;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        ps += __expf(v[k] - pm);  // exp(-inf) = 0 for padding lanes
        sum_x += v[k] == -INFINITY ? 0.f : v[k];
      }
      merge(m, s, pm, ps);
    }
    // The block's max, then every thread's sum rescaled to it.
    const float row_max = block_max(m, red);
    const float2 sums = block_sum2(m == -INFINITY ? 0.f : s * __expf(m - row_max), sum_x, red);
    if (tid == 0) {
      const float lse = row_max + __logf(sums.x);
      const int64_t t = target[r];
      const bool ok = t >= 0 && t < vocab;
      const float nll = ok ? lse - static_cast<float>(xr[ok ? t : 0]) : NAN;
      loss[r] = (1.f - smoothing) * nll + smoothing * (lse - sums.y / static_cast<float>(vocab));
      lse_out[r] = lse;
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) cross_entropy_bwd_kernel(
    const T* x, const int64_t* __restrict__ target, const float* __restrict__ lse,
    const float* __restrict__ grad_loss, T* dx, int64_t rows, int64_t padded, int64_t vocab,
    float smoothing) {
  const int64_t nvec = padded / VEC;
  const float uniform = smoothing / static_cast<float>(vocab);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * padded;
    T* dr = dx + r * padded;
    const float g = grad_loss[r], l = lse[r];
    const int64_t t = target[r];
    const float bad = t >= 0 && t < vocab ? 0.f : NAN;
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
      const Pack<T, VEC> p = load_pack<T, VEC>(xr + i * VEC);
      Pack<T, VEC> o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t j = i * VEC + k;
        float d = 0.f;
        if (j < vocab) {
          d = __expf(static_cast<float>(p.v[k]) - l) - uniform - (j == t ? 1.f - smoothing : 0.f);
          d = d * g + bad;
        }
        o.v[k] = static_cast<T>(d);
      }
      store_pack<T, VEC>(dr + i * VEC, o);
    }
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& target, int64_t vocab, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), name, ": logits must be a contiguous CUDA [rows, padded]");
  TORCH_CHECK(target.is_cuda() && target.scalar_type() == at::kLong && target.dim() == 1 &&
                  target.size(0) == x.size(0) && target.is_contiguous(),
              name, ": target must be a contiguous int64 CUDA [rows]");
  TORCH_CHECK(vocab >= 1 && vocab <= x.size(1), name, ": vocab must be in 1..", x.size(1), ", got ", vocab);
}

int grid_for(int64_t rows) {
  const int64_t most = static_cast<int64_t>(sm_count()) * 8;
  return static_cast<int>(rows < most ? rows : most);
}

}  // namespace

std::vector<at::Tensor> cross_entropy_fwd(const at::Tensor& x, const at::Tensor& target, int64_t vocab,
                                          double smoothing) {
  check_inputs(x, target, vocab, "cross_entropy_fwd");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), padded = x.size(1);
  const auto opts = x.options().dtype(at::kFloat);
  at::Tensor loss = new_output({rows}, opts), lse = new_output({rows}, opts);
  if (rows == 0) return {loss, lse};
  P3D_DISPATCH_FLOATING(x.scalar_type(), "cross_entropy_fwd", [&] {
    dispatch_vec<scalar_t>(use_vec<scalar_t>(padded, {x.data_ptr()}), [&](auto vec) {
      launch_kernel(cross_entropy_fwd_kernel<scalar_t, decltype(vec)::value>, dim3(grid_for(rows)),
                    dim3(kThreads), 0, x.data_ptr<scalar_t>(), target.data_ptr<int64_t>(),
                    loss.data_ptr<float>(), lse.data_ptr<float>(), rows, padded, vocab,
                    static_cast<float>(smoothing));
    });
  });
  return {loss, lse};
}

at::Tensor cross_entropy_bwd(const at::Tensor& x, const at::Tensor& target, const at::Tensor& lse,
                             const at::Tensor& grad_loss, int64_t vocab, double smoothing, bool inplace) {
  check_inputs(x, target, vocab, "cross_entropy_bwd");
  const int64_t rows = x.size(0), padded = x.size(1);
  for (const at::Tensor* t : {&lse, &grad_loss}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == rows &&
                    t->is_contiguous(),
                "cross_entropy_bwd: lse and grad_loss must be contiguous float32 CUDA [rows]");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  // In place, dx is x: each thread reads a pack of logits and writes its gradient over the same pack
  // (x and dx are not __restrict__ for that reason), so the logits' memory holds the gradient.
  at::Tensor dx = inplace ? x : new_output({rows, padded}, x.options());
  if (rows == 0) return dx;
  P3D_DISPATCH_FLOATING(x.scalar_type(), "cross_entropy_bwd", [&] {
    dispatch_vec<scalar_t>(use_vec<scalar_t>(padded, {x.data_ptr(), dx.data_ptr()}), [&](auto vec) {
      launch_kernel(cross_entropy_bwd_kernel<scalar_t, decltype(vec)::value>, dim3(grid_for(rows)),
                    dim3(kThreads), 0, x.data_ptr<scalar_t>(), target.data_ptr<int64_t>(),
                    lse.data_ptr<float>(), grad_loss.data_ptr<float>(), dx.data_ptr<scalar_t>(), rows,
                    padded, vocab, static_cast<float>(smoothing));
    });
  });
  return dx;
}

}  // namespace p3d
