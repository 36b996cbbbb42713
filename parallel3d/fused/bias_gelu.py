"""Fused bias + GeLU (Megatron's bias_gelu_impl), tanh approximation or exact erf."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel3d.fused import _ext

_APPROXIMATIONS = ("tanh", "none")


class _BiasGeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
        tanh = approximate == "tanh"
        y = _ext.get_ext().bias_gelu_fwd(x, bias, tanh)
        ctx.save_for_backward(x, bias)
        ctx.tanh = tanh
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, bias = ctx.saved_tensors
        grads = _ext.get_ext().bias_gelu_bwd(dy.contiguous(), x, bias, ctx.tanh)
        return grads[0], (grads[1] if bias is not None else None), None


def _check(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> None:
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"bias_gelu: approximate must be one of {_APPROXIMATIONS}, got {approximate!r}")
    if x.dim() < 1:
        raise ValueError("bias_gelu: x must have at least one dimension")
    _ext.check_bias("bias_gelu", x, bias)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x + bias)`` with the bias broadcast over the last dimension.

    approximate="tanh" is Megatron's bias_gelu (the tanh formula); "none" is exact
    erf GeLU.  bias may be None.  Differentiable in x and bias.
    """
    _check(x, bias, approximate)
    if _ext.use_kernel(x, bias):
        return _BiasGeLUFunction.apply(x.contiguous(), bias.contiguous() if bias is not None else None, approximate)
    return bias_gelu_reference(x, bias, approximate)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh") -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU and the model's unfused path (its one reference)."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)
