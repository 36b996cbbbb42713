"""A bias's gradient: the output gradient summed over every dimension but the last (the tokens), in fp32.

What a linear with a bias and bias-dropout-add without dropout return for the bias. PyTorch's ``sum(0)``
over the token dimension of a ``[tokens, features]`` gradient reads it at a fraction of the memory's speed;
the kernel reads it in 16-byte packs down the columns and adds the blocks' fp32 partial rows in a second,
small pass (csrc/reduce_partials.cu), the two-stage reduction the fused backward kernels use for theirs.
"""
from __future__ import annotations

import torch

from parallel3d.fused import _ext


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """``dy`` summed over all dimensions but the last, accumulated in fp32, in ``dy``'s dtype."""
    if dy.dim() < 1:
        raise ValueError("bias_grad: dy must have at least one dimension")
    if dy.is_contiguous() and _ext.use_kernel(dy):
        return _ext.get_ext().column_sum(dy)
    return bias_grad_reference(dy)


def bias_grad_reference(dy: torch.Tensor) -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU (its one reference)."""
    return dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(dy.dtype)
