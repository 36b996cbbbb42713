"""Collectives started now and awaited later, for hiding TP communication behind other GEMMs.

A transformer layer split into independent pieces along the batch (DeepSpeed Domino's idea, Wang et
al. 2024) can start one piece's collective and compute another piece's GEMMs before it needs the
result. ``Pending`` is such a collective in flight: ``wait()`` orders the consumer after it (on NCCL
the compute stream waits on the collective's event, the host does not block; on gloo the host waits).
The tensor is not to be read before ``wait()``.

- :func:`start_input_gather`: the sequence-parallel all-gather a column-parallel layer's GEMM needs,
  outside autograd (the layer keeps the sequence shard and, as without overlap, gathers it again for
  its weight gradient and reduce-scatters its input gradient in backward).
- :func:`start_output_reduction`: a row-parallel layer's sum over TP (all-reduce, or reduce-scatter
  into sequence shards under sequence parallelism). Its backward is the usual adjoint: the identity, or
  an all-gather of the gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from .utils import group_rank_and_size


class Pending:
    """A tensor whose producing collective may still be running."""

    def __init__(self, tensor: torch.Tensor, work: Optional[dist.Work] = None):
        self._tensor, self._work = tensor, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            # Without grad mode: a backend may finish the collective with a copy into the tensor (gloo's
            # reduce-scatter does), which autograd would otherwise record as the tensor's new history.
            with torch.no_grad():
                self._work.wait()
            self._work = None
        return self._tensor


def start_input_gather(x: torch.Tensor, group, sequence_parallel: bool) -> Optional[Pending]:
    """Start gathering a sequence shard [s/tp, ...] into [s, ...]; None where there is nothing to gather."""
    _, size = group_rank_and_size(group)
    if not sequence_parallel or size == 1:
        return None
    shard = x.detach().contiguous()
    out = torch.empty((size * shard.size(0),) + tuple(shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    return Pending(out, all_gather_into_tensor(out, shard, group=group, async_op=True))


class _StartOutputReduction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sequence_parallel, holder):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        _, size = group_rank_and_size(group)
        x = x.contiguous()
        if sequence_parallel:
            if x.size(0) % size != 0:
                raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {size}")
            out = torch.empty((x.size(0) // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            holder.append(reduce_scatter_tensor(out, x, group=group, async_op=True))
            return out
        out = x.clone()
        holder.append(dist.all_reduce(out, group=group, async_op=True))
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.sequence_parallel:
            return grad, None, None, None
        _, size = group_rank_and_size(ctx.group)
        grad = grad.contiguous()
        full = torch.empty((size * grad.size(0),) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        all_gather_into_tensor(full, grad, group=ctx.group)
        return full, None, None, None


def start_output_reduction(x: torch.Tensor, group, sequence_parallel: bool) -> Pending:
    """Start summing a row-parallel layer's partial output over TP (reduce-scattered into sequence shards
    with ``sequence_parallel``)."""
    _, size = group_rank_and_size(group)
    if size == 1:
        return Pending(x)
    holder: list = []
    out = _StartOutputReduction.apply(x, group, sequence_parallel, holder)
    return Pending(out, holder[0])
