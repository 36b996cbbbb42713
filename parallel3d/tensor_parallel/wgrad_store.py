"""Weight gradients deferred from a backward (B) to a later W step (zero-bubble pipelines).

A zero-bubble schedule runs a microbatch's backward in two steps: B computes the input
gradient that the previous pipeline stage waits for, W computes the weight gradients that
nobody waits for.  Our linear layers' autograd Function computes its input gradient (and runs
its TP collective) in its backward as always; for a weight inside :func:`deferring` it hands its
weight-gradient GEMM to the given list as a closure over the tensors that GEMM reads, instead of
running it.  The schedule's W step then calls :func:`run_deferred`.  No graph surgery: the
Function is an ordinary node, so activation checkpointing's recomputed forward produces the very
tensors the closure captures.

How B reaches the list: through the weights.  The executor marks the parameters of the chunk it
runs B on (``defer_wgrad_into``, set before the backward and removed after it, see
:func:`deferring`); the linear's backward reads the mark on the weight autograd saved for it.
Not a module global or a thread-local: autograd runs CUDA backward functions on its own device
threads, outside the thread that called backward, and a global would also take the GEMMs of any
other backward running meanwhile (another model, another thread).  The weight is what the
backward holds anyway, and only the chunk the executor names defers.

Where a gradient lands: with ``main_grad`` (the DDP buffer) it is added there (fused with the
GEMM where the layer asks for gradient_accumulation_fusion), else summed into ``.grad``.

DDP: a bucket may only be reduced once every weight in it has its gradient.  A weight owes one
gradient per deferred GEMM (``wgrad_pending``); DDP's readiness hook leaves such a weight
un-ready (it still banks any ``.grad`` autograd gave it, e.g. a tied embedding's lookup part), and
the W step calls the weight's ``deferred_grad_ready`` hook (set by DDP) once it owes nothing.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional

import torch

Deferred = list[tuple[torch.Tensor, Callable[[], None]]]


@contextlib.contextmanager
def deferring(weights: Iterable[torch.Tensor], into: Deferred) -> Iterator[Deferred]:
    """Within this context, linear layers defer the weight-gradient GEMMs of ``weights`` into ``into``."""
    weights = list(dict.fromkeys(weights))
    if any(getattr(w, "defer_wgrad_into", None) is not None for w in weights):
        raise RuntimeError("a weight already defers its gradient into another W: deferring() contexts "
                           "over the same weights cannot nest")
    for weight in weights:
        weight.defer_wgrad_into = into
    try:
        yield into
    finally:
        for weight in weights:
            del weight.defer_wgrad_into


def defer(weight: torch.Tensor, compute: Callable[[], None]) -> bool:
    """Queue ``compute`` (which adds weight's gradient) where a B defers this weight; False to run it now."""
    into = getattr(weight, "defer_wgrad_into", None)
    if into is None:
        return False
    weight.wgrad_pending = getattr(weight, "wgrad_pending", 0) + 1
    into.append((weight, compute))
    return True


@torch.no_grad()
def run_deferred(items: Deferred) -> None:
    """Run (and drop) the GEMMs one B deferred, in the order that B queued them."""
    while items:
        weight, compute = items.pop(0)
        compute()
        weight.wgrad_pending -= 1
        ready = getattr(weight, "deferred_grad_ready", None)
        if weight.wgrad_pending == 0 and ready is not None:
            ready(weight)


def add_weight_grad(weight: torch.Tensor, total_x_2d: torch.Tensor, grad_output_2d: torch.Tensor,
                    fused: bool, gemm: Optional[Callable] = None) -> None:
    """weight's gradient += grad_output^T @ input, into main_grad where there is one. ``gemm``: the
    linear's FP8 weight-gradient GEMM (fp32 result, or accumulated into ``out=``), in place of matmul and the
    fused kernel."""
    main_grad = getattr(weight, "main_grad", None)
    if fused and main_grad is not None and gemm is None:
        from parallel3d.fused import wgrad_accumulate

        wgrad_accumulate(total_x_2d, grad_output_2d, main_grad)
        return
    if main_grad is not None and gemm is not None:
        gemm(grad_output_2d, total_x_2d, out=main_grad)
        return
    grad = grad_output_2d.t().matmul(total_x_2d) if gemm is None else gemm(grad_output_2d, total_x_2d)
    if main_grad is not None:
        main_grad.add_(grad)
    elif weight.grad is None:
        weight.grad = grad.to(weight.dtype)
    else:
        weight.grad.add_(grad)
