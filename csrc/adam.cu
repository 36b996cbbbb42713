// AdamW over fp32 master parameters in one pass, the clip folded in and the model's half-precision copy
// written beside the master:
//
//   g = grad * grad_scale                       (grad_scale: the clip coefficient, or 1)
//   p -= lr * weight_decay * p                  (decoupled weight decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
//   model = p, rounded to bf16/fp16             (when given)
//
// torch's fused AdamW computes the same update (fused_adam_utils.cuh, ADAMW mode); run alone it leaves the
// clip's multiply (a read and a write of every gradient) and the master -> model copy (a read of every
// master, a write of every model parameter) to separate passes.
//
// Launch: the tensors in batches of up to kTensors, their kChunk-element chunks one block each, at most
// kBlocks blocks a launch; the pointers travel in the kernel's parameter block (no device-side tables).

#include <cmath>
#include <vector>

#include "common.cuh"
#include "ops.h"

namespace p3d {
namespace {

constexpr int kTensors = 24;
constexpr int kBlocks = 320;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

struct AdamBatch {
  float* p[kTensors];
  const float* g[kTensors];
  float* m[kTensors];
  float* v[kTensors];
  void* model[kTensors];  // nullptr: no half copy
  int64_t n[kTensors];
  unsigned char tensor_of[kBlocks];
  int chunk_of[kBlocks];
};

struct AdamScalars {
  float lr, beta1, beta2, eps, decay, step_size, bc2_sqrt, grad_scale;
};

template <typename M>
__global__ void __launch_bounds__(kThreads) adamw_master_kernel(AdamBatch batch, AdamScalars s) {
  const int t = batch.tensor_of[blockIdx.x];
  const int64_t n = batch.n[t];
  const int64_t start = static_cast<int64_t>(batch.chunk_of[blockIdx.x]) * kChunk;
  const int64_t end = start + kChunk < n ? start + kChunk : n;
  float* __restrict__ p = batch.p[t];
  const float* __restrict__ g = batch.g[t];
  float* __restrict__ m = batch.m[t];
  float* __restrict__ v = batch.v[t];
  M* __restrict__ model = static_cast<M*>(batch.model[t]);
#pragma unroll 4
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) {
    const float gi = g[i] * s.grad_scale;
    float pi = p[i];
    pi -= s.lr * s.decay * pi;
    const float mi = s.beta1 * m[i] + (1.f - s.beta1) * gi;
    const float vi = s.beta2 * v[i] + (1.f - s.beta2) * gi * gi;
    pi -= s.step_size * mi / (sqrtf(vi) / s.bc2_sqrt + s.eps);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (model != nullptr) model[i] = static_cast<M>(pi);
  }
}

void check_fp32(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == like.numel() &&
                  t.device() == like.device(),
              "adamw_master_step: ", what, " must be a contiguous float32 CUDA tensor of its master's size, got ",
              t.scalar_type(), " ", t.sizes());
}

}  // namespace

void adamw_master_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& model_params, double lr, double beta1, double beta2,
                       double eps, double weight_decay, int64_t step, double grad_scale) {
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count &&
                  (model_params.empty() || model_params.size() == count),
              "adamw_master_step: the lists must have one entry per master parameter");
  TORCH_CHECK(step >= 1, "adamw_master_step: step counts from 1, got ", step);
  if (count == 0) return;
  at::ScalarType half = at::kBFloat16;
  for (size_t i = 0; i < count; ++i) {
    check_fp32(params[i], params[i], "a master parameter");
    check_fp32(grads[i], params[i], "a gradient");
    check_fp32(exp_avgs[i], params[i], "exp_avg");
    check_fp32(exp_avg_sqs[i], params[i], "exp_avg_sq");
    if (!model_params.empty()) {
      const at::Tensor& mp = model_params[i];
      TORCH_CHECK(mp.is_cuda() && mp.is_contiguous() && mp.numel() == params[i].numel() &&
                      (mp.scalar_type() == at::kBFloat16 || mp.scalar_type() == at::kHalf) &&
                      mp.scalar_type() == model_params[0].scalar_type(),
                  "adamw_master_step: model parameters must be contiguous bf16 or fp16 CUDA tensors of one dtype");
      half = mp.scalar_type();
    }
  }
  c10::cuda::CUDAGuard guard(params[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const AdamScalars s{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                      static_cast<float>(eps), static_cast<float>(weight_decay), static_cast<float>(lr / bc1),
                      static_cast<float>(std::sqrt(bc2)), static_cast<float>(grad_scale)};
  auto launch = [&](const AdamBatch& b, int blocks) {
    if (blocks == 0) return;
    if (half == at::kHalf)
      adamw_master_kernel<at::Half><<<blocks, kThreads, 0, stream>>>(b, s);
    else
      adamw_master_kernel<at::BFloat16><<<blocks, kThreads, 0, stream>>>(b, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  AdamBatch b{};
  int tensors = 0, blocks = 0;
  for (size_t i = 0; i < count; ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    b.p[tensors] = params[i].data_ptr<float>();
    b.g[tensors] = grads[i].data_ptr<float>();
    b.m[tensors] = exp_avgs[i].data_ptr<float>();
    b.v[tensors] = exp_avg_sqs[i].data_ptr<float>();
    b.model[tensors] = model_params.empty() ? nullptr : model_params[i].data_ptr();
    b.n[tensors] = n;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      b.tensor_of[blocks] = static_cast<unsigned char>(tensors);
      b.chunk_of[blocks] = static_cast<int>(c);
      if (++blocks == kBlocks) {  // launch what is full; a tensor cut here goes on in the next batch
        launch(b, blocks);
        blocks = 0;
        if (c + 1 < chunks) {  // the same tensor keeps slot 0 of the next batch
          b.p[0] = b.p[tensors], b.g[0] = b.g[tensors], b.m[0] = b.m[tensors], b.v[0] = b.v[tensors];
          b.model[0] = b.model[tensors], b.n[0] = n;
          tensors = 0;
        } else {
          tensors = -1;  // the next tensor starts at slot 0
        }
      }
    }
    if (++tensors == kTensors) {  // every slot used: launch the chunks queued so far
      launch(b, blocks);
      blocks = 0;
      tensors = 0;
    }
  }
  launch(b, blocks);
}

}  // namespace p3d
