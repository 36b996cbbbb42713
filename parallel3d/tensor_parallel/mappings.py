"""Autograd-aware communication for the tensor-parallel region.

Each function is an identity-or-collective in forward paired with its adjoint in
backward (Megatron's mappings). Activations are [s, b, h]: the TP split is along
the last (hidden) dim, the sequence-parallel split along the first (sequence) dim.
``group=None`` means the default TP group; with no group (a single process) every
mapping is the identity.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import parallel_state
from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from .utils import group_rank_and_size, resolve_tp_group, tp_collective


def _all_reduce(x: torch.Tensor, group, copy: bool = False) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place; with ``copy``, in a contiguous copy, so the caller's tensor keeps
    its value. One rank sums nothing and copies nothing."""
    if group_rank_and_size(group)[1] == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format) if copy else x.contiguous()
    with tp_collective("all-reduce", group):
        dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, size = group_rank_and_size(group)
    if size == 1:
        return x
    if x.size(dim) % size != 0:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} is not divisible by the TP size {size}")
    return x.chunk(size, dim=dim)[rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    _, size = group_rank_and_size(group)
    if size == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0; move the dim there and back.
    moved = x.movedim(dim, 0).contiguous()
    with tp_collective("all-gather", group):
        out, _ = gather_first_dim(moved, group, keep=True)
    return out.movedim(0, dim).contiguous()


def gather_first_dim(x: torch.Tensor, group, keep: bool, async_op: bool = False, buffers=None):
    """``x`` gathered along dim 0 over ``group``: (total_x, handle or None).

    Into the TP group's symmetric-window buffer where the run has them (parallel_state.tp_symmetric_buffers;
    NCCL may then copy on the copy engines), in place: this rank's shard copied into its slot first. ``keep``:
    the caller holds total_x beyond this layer's backward (a deferred or FP8 weight gradient), so it gets a
    tensor of its own."""
    rank, size = group_rank_and_size(group)
    shape = (size * x.size(0),) + tuple(x.shape[1:])
    if buffers is None and not keep:
        buffers = parallel_state.tp_symmetric_buffers(group)
    if buffers is None:
        total_x = torch.empty(shape, dtype=x.dtype, device=x.device)
        shard = x.contiguous()
    else:
        total_x = buffers.get(shape, x.dtype, x.device)
        shard = total_x[rank * x.size(0):(rank + 1) * x.size(0)]
        shard.copy_(x)
    handle = all_gather_into_tensor(total_x, shard, group=group, async_op=async_op)
    return total_x, handle


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    _, size = group_rank_and_size(group)
    if size == 1:
        return x
    if x.size(0) % size != 0:
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {size}")
    x = x.contiguous()
    out = torch.empty((x.size(0) // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    with tp_collective("reduce-scatter", group):
        reduce_scatter_tensor(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, copy=True)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of ``dim`` (-1: the hidden dim, 0: the sequence); all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.tp_output_grad = group, tensor_parallel_output_grad
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        # If the consumer is TP-parallel each rank holds a partial gradient: reduce-scatter.
        # If it is replicated (e.g. a gathered LayerNorm output), each rank holds the full one: split.
        if ctx.tp_output_grad:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return _CopyToRegion.apply(x, resolve_tp_group(group))


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-reduce forward; identity backward."""
    return _ReduceFromRegion.apply(x, resolve_tp_group(group))


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; all-gather the gradient."""
    return _ScatterToRegion.apply(x, resolve_tp_group(group), -1)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather along the last dim; split the gradient."""
    return _GatherFromRegion.apply(x, resolve_tp_group(group))


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's slice of the sequence (first) dim; all-gather the gradient."""
    return _ScatterToRegion.apply(x, resolve_tp_group(group), 0)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, tensor_parallel_output_grad: bool = True, group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """All-gather along the sequence dim; reduce-scatter (or split) the gradient."""
    return _GatherFromSequenceRegion.apply(x, resolve_tp_group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Reduce-scatter along the sequence dim; all-gather the gradient."""
    return _ReduceScatterToSequenceRegion.apply(x, resolve_tp_group(group))


# The raw collectives, for the linear layers' own autograd function.
all_reduce = _all_reduce
