"""Fused bias + dropout + residual add: ``residual + dropout(x + bias, prob)``.

Randomness contract (what activation recomputation relies on): the dropout mask
is a pure function of the generator's state at the call.

* CUDA kernel: draws a Philox (seed, offset) from ``generator`` (default: the
  current device's default CUDA generator, i.e. whatever state the RNG tracker
  has installed) exactly as torch's own dropout does, and advances its offset.
  Restoring the generator state (``torch.cuda.set_rng_state``,
  ``Generator.set_state`` or an RNG-tracker fork) and calling again reproduces
  the mask bit for bit.  The mask is not stored: backward regenerates it from
  the saved (seed, offset), a 16-byte device tensor.  Each element draws a
  16-bit uniform, so the keep probability is ``1 - prob`` rounded to a multiple
  of 2**-16; the scale is exactly ``1 / (1 - prob)``.
* PyTorch fallback: ``torch.nn.functional.dropout`` (default generator) or
  ``bernoulli_(generator=...)``, which honour the generator state the same way.
  The two paths draw different masks from the same state.

With ``training=False`` or ``prob == 0`` no random numbers are drawn.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel3d.fused import _ext
from parallel3d.fused.bias_grad import bias_grad


class _BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, prob: float, generator):
        out, seed_offset = _ext.get_ext().bias_dropout_add_fwd(x, bias, residual, prob, generator)
        ctx.save_for_backward(seed_offset)
        ctx.prob = prob
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (seed_offset,) = ctx.saved_tensors
        dy = dy.contiguous()
        if ctx.prob > 0.0:
            grads = _ext.get_ext().bias_dropout_add_bwd(dy, seed_offset, ctx.prob, ctx.has_bias)
            dx = grads[0]
            dbias = grads[1] if ctx.has_bias else None
        else:
            dx = dy
            dbias = bias_grad(dy) if ctx.has_bias else None
        # The residual's gradient is dy itself.
        return dx, dbias, dy, None, None


def _check(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float) -> None:
    if not 0.0 <= prob < 1.0:
        raise ValueError(f"bias_dropout_add: prob must be in [0, 1), got {prob}")
    if x.dim() < 1:
        raise ValueError("bias_dropout_add: x must have at least one dimension")
    if residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add: residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"bias_dropout_add: residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    _ext.check_bias("bias_dropout_add", x, bias)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    prob: float,
    training: bool,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``residual + dropout(x + bias, prob)`` (dropout only when training).

    bias may be None.  ``generator`` is the torch.Generator to draw the mask from
    (None: the default generator of x's device); see the module docstring for the
    reproducibility contract.
    """
    _check(x, bias, residual, prob)
    p = float(prob) if training else 0.0
    if _ext.use_kernel(x, bias, residual):
        return _BiasDropoutAddFunction.apply(
            x.contiguous(), bias.contiguous() if bias is not None else None, residual.contiguous(), p, generator
        )
    return bias_dropout_add_reference(x, bias, residual, p, True, generator)


def bias_dropout_add_reference(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
                               training: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU and the model's unfused path (its one reference)."""
    h = x + bias if bias is not None else x
    if prob == 0.0 or not training:
        return residual + h
    if generator is None:
        return residual + F.dropout(h, p=prob, training=True)
    mask = torch.empty_like(h).bernoulli_(1.0 - prob, generator=generator)
    return residual + h * mask / (1.0 - prob)
