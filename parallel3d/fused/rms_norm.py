"""Fused RMSNorm: fp32 statistics for bf16/fp16/fp32 inputs, hidden sizes up to 16384.

``y = x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 and rounded once
(as Megatron-Core / Transformer Engine do), output in x's dtype.  Any leading
shape; non-contiguous inputs are copied to contiguous rows first.  The kernel
takes a weight of x's dtype; otherwise PyTorch runs.
"""
from __future__ import annotations

import torch

from parallel3d.fused import _ext
from parallel3d.fused.layer_norm import check_norm_args, kernel_ok, residual_grad_2d


class _RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x); with ``residual``, also x itself, as _LayerNormFunction does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: bool):
        x2d = x.reshape(-1, x.shape[-1])
        y, rstd = _ext.get_ext().rms_norm_fwd(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return (y.view(x.shape), x) if residual else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, dres: torch.Tensor | None = None):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = _ext.get_ext().rms_norm_bwd(dy.contiguous().view(x2d.shape), x2d, rstd, weight,
                                             residual_grad_2d(dres, x2d))
        return dx.view(dy.shape), dw, None, None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU and the model's unfused path (its one reference).
    torch's F.rms_norm computes the same, to the bit on the CPU."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    return _rms_norm(x, weight, eps, residual=False)


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x), x): the residual's gradient added in the norm's backward kernel (layer_norm_with_residual)."""
    return _rms_norm(x, weight, eps, residual=True)


def _rms_norm(x, weight, eps, residual: bool):
    check_norm_args("rms_norm", x, weight, None, eps)
    if kernel_ok(x, weight):
        return _RMSNormFunction.apply(x.contiguous(), weight.contiguous(), float(eps), residual)
    y = rms_norm_reference(x, weight, eps)
    return (y, x) if residual else y
