"""Fused CUDA kernels with PyTorch fallbacks.

Each op runs its CUDA kernel when the extension (parallel3d._C, or a JIT build on
first use where nvcc exists; PARALLEL3D_JIT=0 turns that off) is available, its tensors
are on CUDA and fusion is on; otherwise it runs plain PyTorch.  Nothing is compiled or
loaded at import time; ``describe()`` says what a process runs.

One rule decides what computes an op of a model: the model's config flag (Megatron's per-op
``*_fusion`` flags) chooses, per model, between this package's op and the model's own unfused
composition (``models/ops.py``'s ``plain_*``, Megatron's numerics, or this package's ``*_reference``
where they agree); inside this package's ops, ``set_fusion_enabled(False)`` or
``PARALLEL3D_DISABLE_FUSION=1`` is the process-wide override that runs the PyTorch fallback instead
of the CUDA kernel (A/B timing, debugging). The fallbacks compute as the kernels do (fp32 statistics
and math for bf16/fp16 inputs); the ``plain_*`` compositions differ on purpose where Megatron's
unfused path does (see models/ops.py).
"""
from parallel3d.fused._ext import describe, fusion_enabled, set_fusion_enabled
from parallel3d.fused.bias_dropout_add import bias_dropout_add
from parallel3d.fused.bias_gelu import bias_gelu, bias_gelu_reference
from parallel3d.fused.bias_swiglu import bias_swiglu, bias_swiglu_reference
from parallel3d.fused.cross_entropy import cross_entropy
from parallel3d.fused.grad_accum import wgrad_accumulate
from parallel3d.fused.layer_norm import layer_norm
from parallel3d.fused.rms_norm import rms_norm
from parallel3d.fused.rope import apply_rotary_pos_emb, apply_rotary_pos_emb_qk
from parallel3d.fused.softmax import scaled_upper_triang_masked_softmax

__all__ = [
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_qk",
    "bias_dropout_add",
    "bias_gelu",
    "bias_gelu_reference",
    "bias_swiglu",
    "bias_swiglu_reference",
    "cross_entropy",
    "describe",
    "fusion_enabled",
    "layer_norm",
    "rms_norm",
    "scaled_upper_triang_masked_softmax",
    "set_fusion_enabled",
    "wgrad_accumulate",
]
