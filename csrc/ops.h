// Host entry points of the parallel3d CUDA kernels, one group per .cu file.
// bindings.cpp exposes them to Python as parallel3d._C; the Python wrappers in
// parallel3d/fused/ validate arguments first and own the autograd logic.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/Generator.h>

#include <optional>
#include <vector>

namespace p3d {

// grad_accum.cu: main_grad[out, in] += grad_output[N, out]^T @ input[N, in] (fp32 C).
void wgrad_gemm_accum_fp32(const at::Tensor& input, const at::Tensor& grad_output,
                           at::Tensor& main_grad);
// grad_accum.cu, FP8: main_grad[out, in] += a[out, K] @ b[in, K]^T * a_scale_inv * b_scale_inv.
void wgrad_gemm_accum_fp8(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                          const at::Tensor& b_scale_inv, at::Tensor& main_grad);

// adam.cu: AdamW over fp32 masters in one pass: gradients scaled by grad_scale (the clip), the moments
// and masters updated in place, the bf16/fp16 model copies written (model_params may be empty).
void adamw_master_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& model_params, double lr, double beta1, double beta2,
                       double eps, double weight_decay, int64_t step, double grad_scale);

// reduce_partials.cu: x summed over every dimension but the last, accumulated in fp32, in x's dtype
// (a bias gradient)
at::Tensor column_sum(const at::Tensor& x);
// dq [s, b, groups, q heads a group, d], dk and dv [s, b, groups, d] (any strides, last dim contiguous) ->
// {their concatenation [s, b, groups, (q heads a group + 2) d] (linear_qkv's output layout), and with_sum its
// column sum (linear_qkv's bias gradient)}
std::vector<at::Tensor> qkv_grad_merge(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                                       bool with_sum);

// bias_gelu.cu
at::Tensor bias_gelu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                         bool approximate_tanh);
std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                      const std::optional<at::Tensor>& bias,
                                      bool approximate_tanh);

// bias_swiglu.cu: x [..., 2f] -> y [..., f]
at::Tensor bias_swiglu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias);
std::vector<at::Tensor> bias_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                        const std::optional<at::Tensor>& bias);

// bias_dropout_add.cu: returns {out, seed_offset (int64[2] on the device)}
std::vector<at::Tensor> bias_dropout_add_fwd(const at::Tensor& x,
                                             const std::optional<at::Tensor>& bias,
                                             const at::Tensor& residual, double prob,
                                             std::optional<at::Generator> generator);
// returns {dx, dbias (only when has_bias)}
std::vector<at::Tensor> bias_dropout_add_bwd(const at::Tensor& dy, const at::Tensor& seed_offset,
                                             double prob, bool has_bias);

// layer_norm.cu: x [rows, h]; returns {y, mean, rstd}
std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, double eps);
// returns {dx, dweight, dbias (only when has_bias)}; with dresidual, dx includes it (added in fp32)
std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& mean, const at::Tensor& rstd,
                                       const at::Tensor& weight, bool has_bias,
                                       const std::optional<at::Tensor>& dresidual);

// rms_norm.cu: x [rows, h]; returns {y, rstd}
std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight, double eps);
// returns {dx, dweight}; with dresidual, dx includes it (added in fp32)
std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& rstd, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& dresidual);

// rope.cu: each of ts (1 or 2 tensors, e.g. q and k) and outs is an [s, b, h, d]
// or [s, b, groups, h, d] view (any strides, last dim contiguous; the heads may
// differ between the two; an out has its t's sizes); cos and
// sin are float32 [s, 1 or b, rot_dim] of the angles; backward applies the
// transposed rotation. copy_last: ts has one more tensor, copied into its out unrotated.
void rope_apply(const std::vector<at::Tensor>& ts, const at::Tensor& cos, const at::Tensor& sin,
                const std::vector<at::Tensor>& outs, bool backward, bool copy_last = false);

// softmax.cu: x [attn_batches, sq, sk] with sq == sk, causal mask.
at::Tensor scaled_upper_triang_masked_softmax_fwd(const at::Tensor& x, double scale);
at::Tensor scaled_upper_triang_masked_softmax_bwd(const at::Tensor& dy, const at::Tensor& y,
                                                  double scale);

// cross_entropy.cu: logits [rows, padded] (the first vocab columns real), target int64 [rows];
// forward returns {loss, lse} (float32 [rows]); backward returns dlogits in the logits' dtype (inplace:
// written over x and returned as x).
std::vector<at::Tensor> cross_entropy_fwd(const at::Tensor& x, const at::Tensor& target, int64_t vocab,
                                          double smoothing);
at::Tensor cross_entropy_bwd(const at::Tensor& x, const at::Tensor& target, const at::Tensor& lse,
                             const at::Tensor& grad_loss, int64_t vocab, double smoothing, bool inplace);

// fp8_cast.cu: x [M, N] -> {q [M, N] or undefined, q^T [N, M] or undefined, scale, 1 / scale};
// s: the scale, or (from_amax) the amax, one value (mode 0), per row [M, 1] (1) or per column [1, N] (2);
// amax_out (one fp32 value): also amax_out = max(amax_out, max |x|).
std::vector<at::Tensor> fp8_cast(const at::Tensor& x, const at::Tensor& s, int64_t mode, bool from_amax, bool e5m2,
                                 bool row, bool col, const std::optional<at::Tensor>& amax_out);

}  // namespace p3d
