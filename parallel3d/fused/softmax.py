"""Fused scaled upper-triangular (causal) masked softmax, as Megatron's
``ScaledUpperTriangMaskedSoftmax``: x [attn_batches, sq, sk] with sq == sk,
``softmax(scale * x)`` over the last dim with columns j > i masked (their output
is 0), fp32 accumulation, output in x's dtype.  sk up to 16384 on the kernel.
"""
from __future__ import annotations

import torch

from parallel3d.fused import _ext

MAX_FUSED_SK = 16384


class _CausalSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        y = _ext.get_ext().scaled_upper_triang_masked_softmax_fwd(x, scale)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        return _ext.get_ext().scaled_upper_triang_masked_softmax_bwd(dy.contiguous(), y, ctx.scale), None


def scaled_upper_triang_masked_softmax_reference(x: torch.Tensor, scale: float, in_fp32: bool = True) -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU and the model's unfused path (its one reference).
    ``in_fp32``: computed in fp32 (at least) and rounded once, as the kernel; False: in x's dtype, Megatron's
    unfused softmax."""
    sq, sk = x.shape[-2], x.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32) if in_fp32 else x.dtype
    mask = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=x.device), diagonal=1)
    scores = (x.to(compute) * scale).masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(x.dtype)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal-masked ``softmax(scale * x)`` over the last dim of x [attn_batches, sq, sk], sq == sk."""
    if x.dim() != 3:
        raise ValueError(f"scaled_upper_triang_masked_softmax: x must be [attn_batches, sq, sk], got {tuple(x.shape)}")
    if x.shape[1] != x.shape[2]:
        raise ValueError(
            f"scaled_upper_triang_masked_softmax: the causal mask needs sq == sk, got sq={x.shape[1]}, sk={x.shape[2]}"
        )
    scale = float(scale)
    if _ext.use_kernel(x) and x.shape[2] <= MAX_FUSED_SK:
        return _CausalSoftmaxFunction.apply(x.contiguous(), scale)
    return scaled_upper_triang_masked_softmax_reference(x, scale)
