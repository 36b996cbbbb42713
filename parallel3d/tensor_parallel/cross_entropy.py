"""Cross-entropy over logits whose vocabulary is split across TP ranks.

The full [s, b, vocab] logits are never gathered: each rank keeps its vocab
slice and three small all-reduces over [s, b] (max, target logit, sum of exps)
give the exact loss. Computed in fp32 whatever the logits' dtype.

Without tensor parallelism (one rank holds the whole vocabulary, the 1-GPU and
pipeline-only case) the loss is ``parallel3d.fused.cross_entropy``: a kernel that
reads the logits once forward and once backward, or its PyTorch fallback.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel3d import fused

from .mappings import all_reduce
from .utils import group_rank_and_size, resolve_tp_group, tp_collective


def loss_memory_per_logit(tensor_parallel: bool) -> tuple[float, float]:
    """Bytes per logit element the loss holds, (at its peak, from its forward to its backward), as the GPT
    model calls it (``inplace_backward``).

    - TP > 1: the bf16 logits (2) and the loss's own fp32 copy of them (4), which every later step
      overwrites in place (masked, shifted, exponentiated, normalised into the softmax, which is held);
      in the backward the held softmax becomes the gradient in place, then its bf16 cast (2).
    - TP = 1, the fused kernel: the logits it keeps (2, held), which the backward overwrites with their
      gradient.
    """
    return (6.0, 4.0) if tensor_parallel else (2.0, 2.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size, group):
        rank, world = group_rank_and_size(group)
        ctx.logits_dtype = logits.dtype
        # The loss's own fp32 copy (a copy even of fp32 logits): every step below overwrites it in place,
        # so the forward holds one fp32 logits-sized tensor, and the backward turns it into the gradient.
        logits = logits.to(torch.float32, copy=True)
        part = logits.size(-1)
        start = rank * part
        global_vocab = part * world
        vocab_size = global_vocab if vocab_size is None else vocab_size
        if not 0 < vocab_size <= global_vocab:
            raise ValueError(f"vocab_size {vocab_size} must be in 1..{global_vocab} (the padded logits' width)")

        # Padding columns (global id >= vocab_size) take no part in the softmax. They are the last columns
        # of the global vocabulary, so the real ones are a prefix of this rank's slice.
        real = max(0, min(part, vocab_size - start))
        logits[..., real:] = float("-inf")

        logits_max = logits.max(dim=-1)[0]
        if world > 1:
            with tp_collective("all-reduce of the logits' maximum (vocab-parallel cross entropy)", group):
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(logits_max.unsqueeze(-1))

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = all_reduce(predicted, group)

        if label_smoothing > 0.0:  # the real columns' sum, before the exponentials overwrite them
            sum_logits = all_reduce(logits[..., :real].sum(-1), group)
        exp_logits = logits.exp_()
        sum_exp = all_reduce(exp_logits.sum(dim=-1), group)
        log_z = sum_exp.log()
        loss = log_z - predicted

        if label_smoothing > 0.0:
            # (1 - e) * nll + e * mean over the vocab of -log p (e: vocab_parallel_cross_entropy's weight).
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_logits / vocab_size)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # in place: the held softmax becomes the gradient (a second backward raises, not misleads)
        on_rank = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - ctx.label_smoothing) * on_rank.unsqueeze(-1))
        if ctx.label_smoothing > 0.0:
            grad[..., :ctx.real] -= ctx.label_smoothing / ctx.vocab_size
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    vocab_size: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Per-token loss [same shape as target] from TP-split logits [..., vocab/tp].

    The logits are left as they are, except with ``inplace_backward`` at TP = 1, where the fused kernel's
    backward writes their gradient over them (``fused.cross_entropy``): for a caller that owns them.

    ``vocab_size`` is the real (unpadded) vocabulary: logits of padding ids are
    excluded, so the loss does not depend on how much padding TP needed.

    ``label_smoothing`` alpha is Megatron-Core's (NeMo's): mass alpha spread over the K - 1 wrong
    classes, i.e. ``(1 - a) * nll + a * mean_k(-log p_k)`` with ``a = alpha * K / (K - 1)``
    (torch's ``F.cross_entropy(label_smoothing=e)`` is the same with ``a = e``). K is the whole
    vocabulary (``vocab_size``, else the padded width): Megatron-Core takes K and the mean over each
    TP rank's vocabulary slice, which agrees at TP = 1 only.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(vocab_parallel_logits.shape)} and target {tuple(target.shape)} disagree "
            "(expected logits [..., vocab/tp] and target [...])"
        )
    group = resolve_tp_group(group)
    world = group_rank_and_size(group)[1]
    if label_smoothing > 0.0:
        classes = vocab_size if vocab_size is not None else vocab_parallel_logits.size(-1) * world
        if classes < 2:
            raise ValueError(f"label_smoothing needs at least 2 classes, got a vocabulary of {classes}")
        label_smoothing = label_smoothing * classes / (classes - 1)  # the weight of the uniform term
    if world == 1:
        return fused.cross_entropy(vocab_parallel_logits, target, label_smoothing, vocab_size, inplace_backward)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, vocab_size, group)
