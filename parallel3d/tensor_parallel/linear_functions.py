"""The autograd function of the tensor-parallel linears (Megatron's): a GEMM with its TP communication,
which runs beside a GEMM in backward: the sequence-parallel input's all-gather beside the input-gradient
GEMM, the input gradient's reduce beside the weight-gradient GEMM.

Where the TP group has symmetric-window buffers (training's default under SP with CUDA graphs,
symmetric_memory.py), the sequence-parallel all-gathers go into them, on the copy engines, and the
forward's GEMM is split by source rank so that this rank's rows run while the all-gather brings the
others'. The row-parallel linear's reduce-scatter (``reduce_scatter_output``) is split the other way: the
rows the other ranks own are computed first and sent (an exchange in the windows, on the copy engines)
while this rank's own rows run; its backward gathers the output gradient beside the input-gradient GEMM
of this rank's rows, and the column-parallel linear's input-gradient reduce-scatter is split the same way,
beside this rank's rows and the weight gradient. (torch's symmetric-memory ``fused_matmul_reduce_scatter``, whose transfers are SM
kernels, measured 0.54-0.80x on 4 x H100: BENCHMARKS.md, "TP communication overlap".)

The weight gradient goes through ``weight_gradient``: deferred to a zero-bubble W, fused into
``main_grad``, or returned to autograd.

With ``fp8`` (a linear's :class:`~parallel3d.tensor_parallel.fp8.Fp8Scaling`) the three GEMMs run in
FP8 (fp8.py); the communication and the weight gradient's destinations are the same. Without it
(None) the code below is the bf16/fp32 path unchanged.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import parallel_state
from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from ..fused.bias_grad import bias_grad
from . import wgrad_store
from .fp8 import Fp8Scaling
from .mappings import _reduce_scatter_first_dim, gather_first_dim
from .utils import group_rank_and_size, resolve_tp_group, tp_collective


def weight_gradient(weight: torch.Tensor, total_x_2d: torch.Tensor, grad_output_2d: torch.Tensor,
                    fused: bool, gemm: Optional[Callable] = None) -> Optional[torch.Tensor]:
    """What backward returns for ``weight`` (grad_output^T @ input), or None where it went elsewhere.

    A zero-bubble B defers the GEMM to the schedule's W (the input gradient and its collective stay
    on the critical path). With ``fused`` and a DDP ``main_grad``, the GEMM accumulates into it.
    ``gemm(grad_output_2d, total_x_2d, out=None)``: the FP8 GEMM (fp32 result, or accumulated into ``out``)
    instead of matmul / the fused kernel."""
    if wgrad_store.defer(weight, functools.partial(wgrad_store.add_weight_grad, weight, total_x_2d,
                                                   grad_output_2d, fused, gemm)):
        return None
    if not (fused and hasattr(weight, "main_grad")):
        if gemm is not None:
            return gemm(grad_output_2d, total_x_2d).to(weight.dtype)
        return grad_output_2d.t().matmul(total_x_2d)
    if gemm is not None:
        gemm(grad_output_2d, total_x_2d, out=weight.main_grad)
    else:
        from parallel3d.fused import wgrad_accumulate

        wgrad_accumulate(total_x_2d, grad_output_2d, weight.main_grad)
    return _written_to_main_grad(weight)


def _written_to_main_grad(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """What backward returns for ``weight`` once its gradient went into ``main_grad``."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        # A weight with another use in the same backward (the tied embedding): that use's gradient alone
        # reaches autograd's sum, which fires the DDP hook, and the hook adds it (zero_out_wgrad). Megatron
        # returns zeros here, a [vocab, h] tensor held through the whole backward only to be summed.
        return None
    # The DDP hook needs a gradient to fire on, and is told not to add it.
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


class EmbeddingWithGradAccumulation(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds the looked-up rows' gradients into the fp32
    ``weight.main_grad`` (gradient_accumulation_fusion, as the linears' wgrad GEMM does). nn.Embedding's
    backward writes a dense zero-initialised [vocab, h] gradient that the DDP hook then adds into main_grad:
    three passes over the whole table per micro-batch for a few thousand rows. ``index_put_`` with
    ``accumulate`` sorts the ids, so the sum is the same on every run. Not for a weight with another use in
    the same backward (zero_out_wgrad: the tied embedding), whose other gradient the hook must add."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows = grad_output.reshape(-1, grad_output.size(-1)).to(weight.main_grad.dtype)
        weight.main_grad.index_put_((ids.reshape(-1).long(),), rows, accumulate=True)
        return None, _written_to_main_grad(weight)


def embedding(ids: torch.Tensor, weight: torch.Tensor, gradient_accumulation_fusion: bool) -> torch.Tensor:
    """The lookup; with ``gradient_accumulation_fusion`` and a DDP ``main_grad`` (and no other use of the
    weight in the backward), its gradient goes into main_grad (:class:`EmbeddingWithGradAccumulation`)."""
    if (gradient_accumulation_fusion and hasattr(weight, "main_grad") and weight.requires_grad
            and torch.is_grad_enabled() and not getattr(weight, "zero_out_wgrad", False)):
        return EmbeddingWithGradAccumulation.apply(ids, weight)
    return F.embedding(ids, weight)


def _2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.size(-1))


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """out = x W^T (+ b), written into ``out`` (a contiguous block of rows), the bias in the GEMM's epilogue."""
    if bias is None:
        torch.mm(_2d(x), weight.t(), out=_2d(out))
    else:
        torch.addmm(bias, _2d(x), weight.t(), out=_2d(out))


def _linear_beside_gather(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                          buffers) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear of the gathered sequence-parallel input, the gathered input), the GEMM split by source rank:
    this rank's rows run while the others' rows arrive. A copy-engine all-gather needs no SMs, so it runs
    beside that GEMM; row by row the product is the unsplit one's."""
    rank, size = group_rank_and_size(group)
    n = x.size(0)
    with tp_collective("all-gather of the sequence-parallel input", group):
        total_x, handle = gather_first_dim(x, group, keep=False, async_op=True, buffers=buffers)
        out = torch.empty(total_x.shape[:-1] + (weight.size(0),), dtype=x.dtype, device=x.device)
        _linear_into(out[rank * n:(rank + 1) * n], x, weight, bias)
        handle.wait()
    for r in range(size):
        if r != rank:
            _linear_into(out[r * n:(r + 1) * n], total_x[r * n:(r + 1) * n], weight, bias)
    return out, total_x


def _reduce_scatter_beside_gemm(x: torch.Tensor, weight: torch.Tensor, group, buffers, tag: str = ""):
    """Start reduce_scatter(x W^T) along dim 0 with the GEMM split by destination rank: the rows the other
    ranks own first, straight into a symmetric window, then an exchange of those partial sums on the copy
    engines while this rank's own rows run. Returns (this rank's rows' product, the exchange's handle, the
    received partials), for ``_add_received`` once the caller has queued what else runs beside it. At TP=2
    the exchange is an all-gather of the one piece the peer needs (NCCL's copy-engine all-gather); above, an
    all-to-all. ``tag``: a window of its own (backward's, whose input gather holds the untagged one)."""
    rank, size = group_rank_and_size(group)
    if x.size(0) % size != 0:
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {size}")
    n = x.size(0) // size
    shape = (x.size(0),) + tuple(x.shape[1:-1]) + (weight.size(0),)
    rows = [slice(r * n, (r + 1) * n) for r in range(size)]
    if size == 2:
        peer = 1 - rank
        sent = buffers.get(shape, x.dtype, x.device, tag=tag)
        _linear_into(sent[rows[rank]], x[rows[peer]], weight, None)  # my partial of the peer's rows
        handle = all_gather_into_tensor(sent, sent[rows[rank]], group=group, async_op=True)
        received = [sent[rows[peer]]]
    else:
        sent = buffers.get(shape, x.dtype, x.device, tag=tag + "send")
        for r in range(size):
            if r != rank:
                _linear_into(sent[rows[r]], x[rows[r]], weight, None)
        recv = buffers.get(shape, x.dtype, x.device, tag=tag)
        handle = dist.all_to_all_single(recv, sent, group=group, async_op=True)
        received = [recv[rows[r]] for r in range(size) if r != rank]
    out = torch.empty((n,) + shape[1:], dtype=x.dtype, device=x.device)
    _linear_into(out, x[rows[rank]], weight, None)
    return out, handle, received


def _add_received(out: torch.Tensor, handle, received: list, what: str, group) -> torch.Tensor:
    """Finish ``_reduce_scatter_beside_gemm``: wait for the exchange, add the other ranks' partials."""
    with tp_collective(what, group):
        handle.wait()
    for part in received:
        out += part
    return out


def _gather_output_grad(grad_shard: torch.Tensor, weight: torch.Tensor, group, fp8: bool
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the reduce-scattered output's gradient gathered, its input gradient where computed beside the gather,
    else None). Into a window, split beside this rank's rows' input gradient, unless the weight gradient
    reads the gathered tensor later (a zero-bubble W) or FP8 quantizes it: those get a tensor of their own."""
    buffers = parallel_state.tp_symmetric_buffers(group)
    if buffers is not None and not fp8 and getattr(weight, "defer_wgrad_into", None) is None:
        grad_input, total = _linear_beside_gather(grad_shard, weight.t(), None, group, buffers)
        return total, grad_input
    with tp_collective("all-gather of the output gradient", group):
        total, _ = gather_first_dim(grad_shard, group, keep=True)
    return total, None


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
    def forward(ctx, x, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, group,
                fp8=None, reduce_scatter_output=False):
        # FP8 with a tensor-scaled FP8 wgrad: fprop writes the input's wgrad operand too, and backward keeps
        # it (1 byte an element, gathered under SP) instead of the bf16 input (2 bytes, the shard under SP,
        # gathered again in backward and quantized again for wgrad). At TP > 2 under SP it would cost more
        # memory than the shard, so there the input stays.
        size = group_rank_and_size(group)[1]
        keep_x8 = (fp8 is not None and fp8.keeps_input_operand() and ctx.needs_input_grad[1]
                   and (not sequence_parallel or size <= 2))
        ctx.save_for_backward(None if keep_x8 else x, weight)
        ctx.fp8 = fp8
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.group = group
        ctx.reduce_scatter_output = reduce_scatter_output and size > 1
        # the windows serve the split paths (not FP8, which quantizes the whole tensor)
        buffers = parallel_state.tp_symmetric_buffers(group) if fp8 is None and size > 1 and (
            ctx.reduce_scatter_output or sequence_parallel) else None
        total_x = x
        if ctx.reduce_scatter_output:  # a row-parallel linear under SP: its output reduce-scattered here
            if bias is not None:
                raise ValueError("reduce_scatter_output: the bias is added after the reduce-scatter, by the caller")
            if buffers is not None:
                return _add_received(*_reduce_scatter_beside_gemm(x, weight, group, buffers),
                                     "reduce-scatter of the row-parallel output", group)
        elif sequence_parallel and size > 1:
            if buffers is not None:
                return _linear_beside_gather(x, weight, bias, group, buffers)[0]
            with tp_collective("all-gather of the sequence-parallel input", group):
                total_x, _ = gather_first_dim(x, group, keep=True)
        # F.linear, not matmul then "+ bias": cuBLAS adds the bias in the GEMM's epilogue. The separate
        # broadcast add was a 13 ms kernel of a GPT-1.3B step on one H100 (the QKV bias, 2.4%).
        if fp8 is None:
            out = F.linear(total_x, weight, bias)
        else:
            out, ctx.fp8_saved = fp8.fprop(_2d(total_x), weight, bias, keep_input=keep_x8)
            out = out.view(*total_x.shape[:-1], out.size(-1))
        return _reduce_scatter_first_dim(out, group) if ctx.reduce_scatter_output else out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        group = ctx.group
        _, size = group_rank_and_size(group)
        grad_input = None
        if ctx.reduce_scatter_output:  # the output gradient gathered first (beside this rank's rows' dgrad)
            grad_output, grad_input = _gather_output_grad(grad_output, weight, group, ctx.fp8 is not None)
        total_x, handle = x, None
        if x is not None and ctx.sequence_parallel and size > 1:  # the input's gather (for wgrad), beside dgrad
            # a zero-bubble W or the FP8 wgrad reads total_x later: never a reused buffer for them
            keep = ctx.fp8 is not None or getattr(weight, "defer_wgrad_into", None) is not None
            total_x, handle = gather_first_dim(x, group, keep, async_op=True)
        # under SP with windows the input gradient's reduce-scatter is split too: the other ranks' rows first,
        # exchanged on the copy engines beside this rank's rows and the weight gradient
        buffers = parallel_state.tp_symmetric_buffers(group) if ctx.sequence_parallel and size > 1 else None
        split_rs = buffers is not None and ctx.fp8 is None and grad_input is None
        if grad_input is not None:
            pass  # computed beside the output gradient's gather
        elif split_rs:
            sub_grad_input, *exchange = _reduce_scatter_beside_gemm(grad_output, weight.t(), group, buffers, "dgrad")
        elif ctx.fp8 is None:
            grad_input = grad_output.matmul(weight)
        else:
            grad_input, fp8_saved = ctx.fp8.dgrad(_2d(grad_output), weight, ctx.fp8_saved)
            grad_input = grad_input.view(*grad_output.shape[:-1], grad_input.size(-1))
        if handle is not None:
            with tp_collective("all-gather of the sequence-parallel input", group):
                handle.wait()

        handle = None
        if size == 1 or split_rs:
            pass  # one TP rank: the input gradient is already complete; split: its exchange runs already
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
        gemm = None
        if ctx.fp8 is not None and ctx.fp8.recipe.wgrad:  # else fp8_wgrad=False: the high-precision GEMM
            gemm = functools.partial(ctx.fp8.wgrad, saved=fp8_saved)
        grad_weight = weight_gradient(weight, None if total_x is None else _2d(total_x), grad_output_2d,
                                      ctx.gradient_accumulation_fusion, gemm)
        grad_bias = bias_grad(grad_output_2d) if ctx.use_bias and ctx.needs_input_grad[2] else None

        if handle is not None:
            with tp_collective("reduce of the input gradient", group):
                handle.wait()
        if split_rs:
            _add_received(sub_grad_input, *exchange, "reduce-scatter of the input gradient", group)
        if ctx.sequence_parallel and size > 1:
            grad_input = sub_grad_input
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    fp8: Optional[Fp8Scaling] = None,
    reduce_scatter_output: bool = False,
) -> torch.Tensor:
    """Megatron's linear with the TP communication of its backward; ``group=None`` = the default
    TP group (a single process when none is initialised), as for every tensor-parallel function.
    ``fp8``: the linear's FP8 recipe and state (None: no FP8). ``reduce_scatter_output`` (ours; a
    row-parallel linear under SP): the output reduce-scattered along dim 0, its gradient gathered, with the
    GEMMs split beside the collectives where the TP group has symmetric windows (``bias`` must be None)."""
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        x, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, resolve_tp_group(group),
        fp8, reduce_scatter_output,
    )
