"""The plain PyTorch compositions of the GPT layers' elementwise ops (the unfused path of each fused op)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4

# --- unfused compositions ----------------------------------------------------------------------
# The fusion rule (parallel3d/fused/__init__.py): the model calls parallel3d.fused's ops where the
# matching config flag is on (CUDA kernels; their PyTorch fallbacks off the GPU or under
# PARALLEL3D_DISABLE_FUSION=1) and these plain_* compositions where it is off. In fp32 both compute the
# same formulas. In bf16/fp16 these keep Megatron's unfused numerics on purpose where the fused
# fallbacks compute in fp32: LayerNorm in torch's kernel, RMSNorm cast before the weight (HF LLaMA),
# RoPE and the causal softmax in the input dtype. bias-dropout-add matches; bias-GeLU and bias-SwiGLU have one
# reference, parallel3d.fused's (bias_gelu_reference, bias_swiglu_reference).

def plain_bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                            prob: float, training: bool) -> torch.Tensor:
    """residual + dropout(x + bias)."""
    out = x if bias is None else x + bias
    return residual + F.dropout(out, p=prob, training=training)


def plain_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim; torch's kernels keep the statistics in fp32 for bf16/fp16 x."""
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalised in fp32, cast to x's dtype, times weight (HF LLaMA's order)."""
    if _HAS_RMS_NORM:  # the same formula, one kernel on recent CUDA builds
        return F.rms_norm(x, (x.size(-1),), weight, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def plain_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on t [s, b, n, d] with freqs [s, 1, 1, rot] (Megatron's / HF LLaMA's rotate-half).

    Only the first ``rot`` channels of each head rotate (rotary_percent < 1 leaves the rest).
    """
    rot = freqs.size(-1)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    out = t_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if t_pass.size(-1) == 0 else torch.cat((out, t_pass), dim=-1)


def plain_scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(scale * x) over the last dim of x [batches, sq, sk], in x's dtype."""
    sq, sk = x.shape[-2:]
    future = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x * scale).masked_fill(future, float("-inf")), dim=-1)
