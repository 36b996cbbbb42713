// Python bindings of the parallel3d CUDA kernels (module parallel3d._C, or
// parallel3d_C when built just-in-time).  Argument checking that needs no
// device lives in the Python wrappers (parallel3d/fused/); the C++ entry points
// re-check what the kernels rely on.
#include <torch/extension.h>

#include <atomic>

#include "ops.h"

namespace p3d {

namespace {
std::atomic<bool> g_poison_outputs{false};
}

bool poison_outputs() { return g_poison_outputs.load(std::memory_order_relaxed); }

}  // namespace p3d

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "parallel3d fused CUDA kernels";
  m.def("set_poison_outputs", [](bool on) { p3d::g_poison_outputs = on; },
        "Test hook: fill every output the kernels allocate with NaN before writing it.");
  m.def("poison_outputs", &p3d::poison_outputs);

  m.def("wgrad_gemm_accum_fp32", &p3d::wgrad_gemm_accum_fp32, "main_grad += grad_output^T @ input",
        py::arg("input"), py::arg("grad_output"), py::arg("main_grad"));
  m.def("wgrad_gemm_accum_fp8", &p3d::wgrad_gemm_accum_fp8, "main_grad += a @ b^T (FP8 operands, scales)",
        py::arg("a"), py::arg("a_scale_inv"), py::arg("b"), py::arg("b_scale_inv"), py::arg("main_grad"));

  m.def("adamw_master_step", &p3d::adamw_master_step, "AdamW over fp32 masters, clip folded in, model copy written",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("model_params"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("grad_scale"));

  m.def("fp8_cast", &p3d::fp8_cast, "FP8 operand cast, row and/or transposed layout, and its scales",
        py::arg("x"), py::arg("s"), py::arg("mode"), py::arg("from_amax"), py::arg("e5m2"), py::arg("row"),
        py::arg("col"), py::arg("amax_out") = py::none());

  m.def("column_sum", &p3d::column_sum, "x summed over all but its last dimension (fp32 accumulation)", py::arg("x"));
  m.def("qkv_grad_merge", &p3d::qkv_grad_merge, "q/k/v gradients into linear_qkv's layout (+ its bias gradient)",
        py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("with_sum"));
  m.def("bias_gelu_fwd", &p3d::bias_gelu_fwd, py::arg("x"), py::arg("bias"), py::arg("approximate_tanh"));
  m.def("bias_gelu_bwd", &p3d::bias_gelu_bwd, py::arg("dy"), py::arg("x"), py::arg("bias"),
        py::arg("approximate_tanh"));

  m.def("bias_swiglu_fwd", &p3d::bias_swiglu_fwd, py::arg("x"), py::arg("bias"));
  m.def("bias_swiglu_bwd", &p3d::bias_swiglu_bwd, py::arg("dy"), py::arg("x"), py::arg("bias"));

  m.def("bias_dropout_add_fwd", &p3d::bias_dropout_add_fwd, py::arg("x"), py::arg("bias"),
        py::arg("residual"), py::arg("prob"), py::arg("generator"));
  m.def("bias_dropout_add_bwd", &p3d::bias_dropout_add_bwd, py::arg("dy"), py::arg("seed_offset"),
        py::arg("prob"), py::arg("has_bias"));

  m.def("layer_norm_fwd", &p3d::layer_norm_fwd, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"));
  m.def("layer_norm_bwd", &p3d::layer_norm_bwd, py::arg("dy"), py::arg("x"), py::arg("mean"),
        py::arg("rstd"), py::arg("weight"), py::arg("has_bias"), py::arg("dresidual") = py::none());
  m.def("rms_norm_fwd", &p3d::rms_norm_fwd, py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("rms_norm_bwd", &p3d::rms_norm_bwd, py::arg("dy"), py::arg("x"), py::arg("rstd"),
        py::arg("weight"), py::arg("dresidual") = py::none());

  m.def("rope_apply", &p3d::rope_apply, py::arg("ts"), py::arg("cos"), py::arg("sin"), py::arg("outs"),
        py::arg("backward"), py::arg("copy_last") = false);

  m.def("scaled_upper_triang_masked_softmax_fwd", &p3d::scaled_upper_triang_masked_softmax_fwd,
        py::arg("x"), py::arg("scale"));
  m.def("scaled_upper_triang_masked_softmax_bwd", &p3d::scaled_upper_triang_masked_softmax_bwd,
        py::arg("dy"), py::arg("y"), py::arg("scale"));

  m.def("cross_entropy_fwd", &p3d::cross_entropy_fwd, py::arg("x"), py::arg("target"), py::arg("vocab"),
        py::arg("smoothing"));
  m.def("cross_entropy_bwd", &p3d::cross_entropy_bwd, py::arg("x"), py::arg("target"), py::arg("lse"),
        py::arg("grad_loss"), py::arg("vocab"), py::arg("smoothing"), py::arg("inplace"));
}
