"""Fused bias + SwiGLU with Megatron-Core's bias_swiglu_impl semantics.

x is [..., 2f]: the first half is the gate a, the second the up projection g,
and the result is ``silu(a + bias[:f]) * (g + bias[f:])`` of shape [..., f].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel3d.fused import _ext


class _BiasSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        return _ext.get_ext().bias_swiglu_fwd(x, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, bias = ctx.saved_tensors
        grads = _ext.get_ext().bias_swiglu_bwd(dy.contiguous(), x, bias)
        return grads[0], (grads[1] if bias is not None else None)


def _check(x: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"bias_swiglu: the last dimension of x holds the gate and up halves and must be even, got shape {tuple(x.shape)}"
        )
    _ext.check_bias("bias_swiglu", x, bias)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(z[..., :f]) * z[..., f:]`` with ``z = x + bias`` (bias optional); returns [..., f]."""
    _check(x, bias)
    if _ext.use_kernel(x, bias):
        return _BiasSwiGLUFunction.apply(x.contiguous(), bias.contiguous() if bias is not None else None)
    return bias_swiglu_reference(x, bias)


def bias_swiglu_reference(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU and the model's unfused path (its one reference)."""
    gate, up = torch.chunk(x if bias is None else x + bias, 2, dim=-1)
    return F.silu(gate) * up
