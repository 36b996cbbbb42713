"""Fused CUDA kernels with PyTorch fallbacks.

Each op runs its CUDA kernel when the extension (parallel3d._C, or a JIT build on
first use where nvcc exists; PARALLEL3D_JIT=0 turns that off) is available, its tensors
are on CUDA and fusion is on; otherwise it runs plain PyTorch.  Nothing is compiled or
loaded at import time; ``describe()`` says what a process runs.

Each op has one PyTorch reference beside its kernel wrapper, ``<op>_reference`` (cross-entropy's:
its autograd fallback): what runs off the GPU, and the model's unfused path. One rule decides what
computes an op of a model: the model's config flag (Megatron's per-op ``*_fusion`` flags) chooses,
per model, between the op and its reference; inside the ops, ``set_fusion_enabled(False)`` or
``PARALLEL3D_DISABLE_FUSION=1`` is the process-wide override that runs the reference instead of the
CUDA kernel (A/B timing, debugging).
The fallbacks compute as the kernels do (fp32 statistics and math for bf16/fp16 inputs); the model's
unfused softmax and RoPE pass ``in_fp32=False`` to keep Megatron's unfused numerics (the input's dtype).
"""
from parallel3d.fused._ext import describe, fusion_enabled, set_fusion_enabled
from parallel3d.fused.adam import adamw_master_step, adamw_master_step_reference
from parallel3d.fused.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from parallel3d.fused.bias_gelu import bias_gelu, bias_gelu_reference
from parallel3d.fused.bias_grad import bias_grad, bias_grad_reference
from parallel3d.fused.bias_swiglu import bias_swiglu, bias_swiglu_reference
from parallel3d.fused.cross_entropy import cross_entropy
from parallel3d.fused.fp8_cast import fp8_cast, fp8_cast_reference
from parallel3d.fused.grad_accum import wgrad_accumulate, wgrad_accumulate_fp8, wgrad_accumulate_fp8_reference
from parallel3d.fused.layer_norm import layer_norm, layer_norm_reference, layer_norm_with_residual
from parallel3d.fused.rms_norm import rms_norm, rms_norm_reference, rms_norm_with_residual
from parallel3d.fused.rope import (apply_rotary_pos_emb, apply_rotary_pos_emb_qk, apply_rotary_pos_emb_reference,
                                  split_qkv, split_qkv_rope)
from parallel3d.fused.softmax import scaled_upper_triang_masked_softmax, scaled_upper_triang_masked_softmax_reference

__all__ = [
    "adamw_master_step",
    "adamw_master_step_reference",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_qk",
    "apply_rotary_pos_emb_reference",
    "bias_dropout_add",
    "bias_dropout_add_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "bias_grad",
    "bias_grad_reference",
    "bias_swiglu",
    "bias_swiglu_reference",
    "cross_entropy",
    "describe",
    "fp8_cast",
    "fp8_cast_reference",
    "fusion_enabled",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_with_residual",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_with_residual",
    "scaled_upper_triang_masked_softmax",
    "scaled_upper_triang_masked_softmax_reference",
    "set_fusion_enabled",
    "split_qkv",
    "split_qkv_rope",
    "wgrad_accumulate",
    "wgrad_accumulate_fp8",
    "wgrad_accumulate_fp8_reference",
]
