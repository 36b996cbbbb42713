"""Fused LayerNorm: fp32 statistics for bf16/fp16/fp32 inputs, hidden sizes up to 16384.

Works on any leading shape (a sequence-parallel shard is just fewer rows);
non-contiguous inputs are copied to contiguous rows first.  The kernel takes a
weight/bias of x's dtype; other cases (a weight of another dtype, hidden sizes
above the kernel's limit, CPU tensors, fusion switched off) run PyTorch, in
fp32 when the dtypes differ, with the output in x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel3d.fused import _ext

MAX_FUSED_HIDDEN = 16384


class _LayerNormFunction(torch.autograd.Function):
    """y = layer_norm(x); with ``residual``, also x itself (the layer's residual branch), whose gradient the
    backward kernel adds to the norm's input gradient (see ``layer_norm_with_residual``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, residual: bool):
        h = x.shape[-1]
        x2d = x.reshape(-1, h)
        y, mean, rstd = _ext.get_ext().layer_norm_fwd(x2d, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return (y.view(x.shape), x) if residual else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, dres: torch.Tensor | None = None):
        x2d, weight, mean, rstd = ctx.saved_tensors
        grads = _ext.get_ext().layer_norm_bwd(dy.contiguous().view(x2d.shape), x2d, mean, rstd, weight, ctx.has_bias,
                                              residual_grad_2d(dres, x2d))
        dbias = grads[2] if ctx.has_bias else None
        return grads[0].view(dy.shape), grads[1], dbias, None, None


def residual_grad_2d(dres: torch.Tensor | None, x2d: torch.Tensor) -> torch.Tensor | None:
    """The residual branch's gradient as the backward kernels take it: [rows, hidden] contiguous, or None."""
    return None if dres is None else dres.contiguous().view(x2d.shape)


def check_norm_args(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> None:
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name}: x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    h = x.shape[-1]
    for what, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.shape != (h,):
            raise ValueError(f"{name}: {what} must have shape ({h},), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {what} must be a floating-point tensor, got {t.dtype}")
    if not eps > 0.0:
        raise ValueError(f"{name}: eps must be positive, got {eps}")


def kernel_ok(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether the fused norm kernel takes these tensors."""
    return (all(p is None or p.dtype == x.dtype for p in params) and x.shape[-1] <= MAX_FUSED_HIDDEN
            and _ext.use_kernel(x, *params))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias`` (bias may be None)."""
    return _layer_norm(x, weight, bias, eps, residual=False)


def layer_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x), x) for a pre-norm layer, whose residual branch reads x beside the norm. x's gradient
    is then the sum of the two branches'; the kernel adds the residual's inside the norm's backward pass
    instead of autograd adding the two afterwards (one pass over three [rows, hidden] tensors fewer)."""
    return _layer_norm(x, weight, bias, eps, residual=True)


def _layer_norm(x, weight, bias, eps, residual: bool):
    check_norm_args("layer_norm", x, weight, bias, eps)
    if kernel_ok(x, weight, bias):
        return _LayerNormFunction.apply(
            x.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None, float(eps), residual
        )
    y = layer_norm_reference(x, weight, bias, eps)
    return (y, x) if residual else y


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU and the model's unfused path (its one reference).
    torch's kernel keeps the statistics in fp32; weights of another dtype than x's: computed in fp32."""
    if weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    compute = torch.promote_types(x.dtype, torch.float32)
    b = bias.to(compute) if bias is not None else None
    return F.layer_norm(x.to(compute), (x.shape[-1],), weight.to(compute), b, eps).to(x.dtype)
