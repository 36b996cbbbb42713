"""The autograd functions of the tensor-parallel linears: a GEMM with its TP communication.

- ``LinearWithGradAccumulationAndAsyncCommunication`` (Megatron's): the collectives run beside a GEMM
  only in backward, where the input gradient's reduce starts before the weight-gradient GEMM.
- ``AllGatherLinear`` / ``LinearReduceScatter`` (``tp_comm_overlap``, sequence parallelism only): the
  sequence all-gather before a column-parallel GEMM and the reduce-scatter after a row-parallel one
  are cut into one piece per TP rank and pipelined against the GEMM's pieces, in forward and in
  backward. On CUDA this is torch's symmetric-memory micro-pipelining (``torch.ops.symm_mem``
  ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``: peer-to-peer copies between the TP
  ranks, no NVLink multicast); on other devices the same functions run the collective and the GEMM one
  after the other, so CPU ranks check the autograd around them.

Every weight gradient goes through ``weight_gradient``: deferred to a zero-bubble W, fused into
``main_grad``, or returned to autograd.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from . import wgrad_store
from .mappings import gather_along_first_dim, reduce_scatter_along_first_dim
from .utils import group_rank_and_size, resolve_tp_group


def weight_gradient(weight: torch.Tensor, total_x_2d: torch.Tensor, grad_output_2d: torch.Tensor,
                    fused: bool) -> Optional[torch.Tensor]:
    """What backward returns for ``weight`` (grad_output^T @ input), or None where it went elsewhere.

    A zero-bubble B defers the GEMM to the schedule's W (the input gradient and its collective stay
    on the critical path). With ``fused`` and a DDP ``main_grad``, the GEMM accumulates into it."""
    if wgrad_store.defer(weight, functools.partial(wgrad_store.add_weight_grad, weight, total_x_2d,
                                                   grad_output_2d, fused)):
        return None
    if not (fused and hasattr(weight, "main_grad")):
        return grad_output_2d.t().matmul(total_x_2d)
    from parallel3d.fused import wgrad_accumulate

    wgrad_accumulate(total_x_2d, grad_output_2d, weight.main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # The DDP hook needs a gradient to fire on, and is told not to add it. A weight with other uses
    # (a tied embedding) gets zeros: autograd sums its other gradients into this tensor, and the hook
    # must then add them (Megatron's zero_out_wgrad).
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


def _2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.size(-1))


def _start_gather(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, Any]:
    """(the buffer, the handle) of an asynchronous all-gather of ``x`` along dim 0."""
    _, size = group_rank_and_size(group)
    total = torch.empty((size * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return total, all_gather_into_tensor(total, x.contiguous(), group=group, async_op=True)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """out = x W^T (+ b), with TP communication fused into forward/backward.

    - ``sequence_parallel``: x is a sequence shard; all-gather it in forward
      (and again in backward, rather than keeping the gathered copy alive, beside the
      input-gradient GEMM as Megatron does) and reduce-scatter the input gradient.
    - ``allreduce_dgrad``: the input is replicated across TP; all-reduce its gradient.
      The collective is started before the weight-gradient GEMM so they overlap.
    - ``gradient_accumulation_fusion``: with ``weight.main_grad`` present (the DDP
      buffer), the weight gradient GEMM accumulates straight into it.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, group):
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.group = group
        total_x = gather_along_first_dim(x, group) if sequence_parallel else x
        out = torch.matmul(total_x, weight.t())
        if bias is not None:
            out = out + bias
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        group = ctx.group
        _, size = group_rank_and_size(group)
        total_x, handle = x, None
        if ctx.sequence_parallel and size > 1:  # the input's gather (for wgrad) runs beside the dgrad GEMM
            total_x, handle = _start_gather(x, group)
        grad_input = grad_output.matmul(weight)
        if handle is not None:
            handle.wait()

        handle = None
        if size == 1:
            pass  # one TP rank: the input gradient is already complete
        elif ctx.sequence_parallel:
            sub_grad_input = torch.empty(
                (grad_input.size(0) // size,) + tuple(grad_input.shape[1:]), dtype=grad_input.dtype,
                device=grad_input.device,
            )
            handle = reduce_scatter_tensor(sub_grad_input, grad_input.contiguous(), group=group, async_op=True)
        elif ctx.allreduce_dgrad:
            grad_input = grad_input.contiguous()
            handle = dist.all_reduce(grad_input, group=group, async_op=True)

        grad_output_2d = _2d(grad_output)
        grad_weight = weight_gradient(weight, _2d(total_x), grad_output_2d, ctx.gradient_accumulation_fusion)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None

        if handle is not None:
            handle.wait()
        if ctx.sequence_parallel and size > 1:
            grad_input = sub_grad_input
        return grad_input, grad_weight, grad_bias, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Megatron's linear with the TP communication of its backward; ``group=None`` = the default
    TP group (a single process when none is initialised), as for every tensor-parallel function."""
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        x, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, resolve_tp_group(group)
    )


_SYMM_MEM_GROUPS: set[str] = set()


def _symm_mem_group(group: dist.ProcessGroup) -> str:
    """The group's name, with symmetric memory set up for it once (torch before 2.12 needs the call;
    later versions deprecate it and set up on first use)."""
    name = group.group_name
    if name not in _SYMM_MEM_GROUPS:
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
        _SYMM_MEM_GROUPS.add(name)
    return name


def all_gather_matmul(shard: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the all-gather of ``shard`` along dim 0, that @ b); on CUDA the gather is pipelined against
    the GEMM's per-rank pieces."""
    if shard.is_cuda:
        # return_A=True also keeps torch off its multicast (multimem) variant, which must not run here.
        name = _symm_mem_group(group)  # first: importing symmetric memory registers torch.ops.symm_mem
        total, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(shard.contiguous(), [b], 0, name, return_A=True)
        return total, out
    total = gather_along_first_dim(shard, group)
    return total, torch.matmul(total, b)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over the group of a @ b, scattered along dim 0; on CUDA each rank's piece is computed
    and sent while the next is computed."""
    if a.is_cuda:
        name = _symm_mem_group(group)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a.contiguous(), b, "sum", 0, name)
    return reduce_scatter_along_first_dim(torch.matmul(a, b), group)


class AllGatherLinear(torch.autograd.Function):
    """Column-parallel linear of a sequence shard, communication pipelined: out = all_gather(x) W^T (+ b).

    Backward pipelines the input gradient's reduce-scatter against its GEMM, while the input's
    all-gather (for the weight gradient) runs beside them. Only the shard is kept for backward, as
    ``LinearWithGradAccumulationAndAsyncCommunication`` keeps it."""

    @staticmethod
    def forward(ctx, x, weight, bias, gradient_accumulation_fusion, group):
        ctx.save_for_backward(x, weight)
        ctx.use_bias, ctx.fused, ctx.group = bias is not None, gradient_accumulation_fusion, group
        _, out = all_gather_matmul(x, weight.t(), group)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        total_x, handle = _start_gather(x, ctx.group)
        grad_input = matmul_reduce_scatter(grad_output, weight, ctx.group)
        handle.wait()
        grad_output_2d = _2d(grad_output)
        grad_weight = weight_gradient(weight, _2d(total_x), grad_output_2d, ctx.fused)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None


class LinearReduceScatter(torch.autograd.Function):
    """Row-parallel linear to a sequence shard, communication pipelined: out = reduce_scatter(x W^T).

    Backward gathers the output gradient pipelined against the input-gradient GEMM, and the weight
    gradient reuses that gathered gradient."""

    @staticmethod
    def forward(ctx, x, weight, gradient_accumulation_fusion, group):
        ctx.save_for_backward(x, weight)
        ctx.fused, ctx.group = gradient_accumulation_fusion, group
        return matmul_reduce_scatter(x, weight.t(), group)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        total_grad_output, grad_input = all_gather_matmul(grad_output, weight, ctx.group)
        grad_weight = weight_gradient(weight, _2d(x), _2d(total_grad_output), ctx.fused)
        return grad_input, grad_weight, None, None
