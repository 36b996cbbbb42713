"""Cross-entropy over logits that hold the whole vocabulary (tensor parallelism 1; above it,
``tensor_parallel.vocab_parallel_cross_entropy``'s algorithm runs): ``loss = lse - x[target]``, with
fp32 arithmetic and the vocabulary padding columns left out. ``label_smoothing`` here is the weight of
the uniform term, ``(1 - a) * nll + a * mean(-log p)`` (torch's formula); ``vocab_parallel_cross_entropy``
turns Megatron's alpha into it (``a = alpha * K / (K - 1)``) before calling this.

The kernel (csrc/cross_entropy.cu) reads the logits once forward and once backward and writes the
gradient once, keeping the logits themselves (bf16: 2 bytes each) for the backward. With
``inplace_backward`` it writes the gradient over the logits, as Megatron's loss reuses its input's
memory: the backward then holds one logits-sized tensor instead of two (a caller whose logits are its
own, as the GPT model's are). Their version is bumped, so autograd refuses a second backward through
them or any other use of them saved for a backward. The PyTorch
fallback runs one log_softmax and keeps its fp32 log-probabilities (4 bytes each); the logits of
LLaMA-1B's 8192 tokens x 128,256 vocabulary are 1 G elements, so that is 2 GB more and several
passes more per microbatch.
"""
from __future__ import annotations

from typing import Optional

import torch

from parallel3d.fused import _ext


class _CrossEntropyKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size, inplace_backward):
        x2d = logits.reshape(-1, logits.size(-1))
        t = target.reshape(-1)
        loss, lse = _ext.get_ext().cross_entropy_fwd(x2d, t, vocab_size, label_smoothing)
        ctx.save_for_backward(x2d, t, lse)
        ctx.label_smoothing, ctx.vocab_size, ctx.shape = label_smoothing, vocab_size, logits.shape
        ctx.inplace = inplace_backward
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x2d, t, lse = ctx.saved_tensors
        g = grad_loss.reshape(-1).float().contiguous()
        dx = _ext.get_ext().cross_entropy_bwd(x2d, t, lse, g, ctx.vocab_size, ctx.label_smoothing, ctx.inplace)
        if ctx.inplace:  # the kernel wrote over the saved logits: autograd must know they changed
            torch.autograd.graph.increment_version(x2d)
        return dx.view(ctx.shape), None, None, None, None


class _CrossEntropyPyTorch(torch.autograd.Function):
    """The fallback: one log_softmax forward, whose fp32 log-probabilities the backward turns into the gradient."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size):
        padded = logits.size(-1)
        # Padding columns take no part in the softmax: they are left out, not masked.
        real = logits[..., :vocab_size] if vocab_size < padded else logits
        log_probs = torch.log_softmax(real, dim=-1, dtype=torch.float32)
        loss = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if label_smoothing > 0.0:
            loss = (1.0 - label_smoothing) * loss - label_smoothing * log_probs.mean(dim=-1)
        ctx.save_for_backward(log_probs, target)
        ctx.label_smoothing, ctx.logits_dtype, ctx.padded = label_smoothing, logits.dtype, padded
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        log_probs, target = ctx.saved_tensors
        e, vocab_size = ctx.label_smoothing, log_probs.size(-1)
        grad = log_probs.exp_()  # softmax, in place (a second backward through it raises, not misleads)
        index = target.unsqueeze(-1)
        grad.scatter_add_(-1, index, torch.full(index.shape, e - 1.0, dtype=grad.dtype, device=grad.device))
        if e > 0.0:
            grad -= e / vocab_size
        out = torch.zeros(*grad.shape[:-1], ctx.padded, dtype=ctx.logits_dtype, device=grad.device) \
            if vocab_size < ctx.padded else torch.empty(grad.shape, dtype=ctx.logits_dtype, device=grad.device)
        torch.mul(grad, grad_loss.unsqueeze(-1), out=out[..., :vocab_size])  # scale and cast in one pass
        return out, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                  vocab_size: Optional[int] = None, inplace_backward: bool = False) -> torch.Tensor:
    """Per-token loss [target's shape] from logits [..., padded vocab] whose first ``vocab_size``
    columns are real (None: all).  Label smoothing as F.cross_entropy defines it.
    ``inplace_backward``: the kernel's backward may write the gradient over ``logits`` (module docstring)."""
    if inplace_backward and logits.is_leaf and logits.requires_grad:
        raise ValueError("cross_entropy(inplace_backward=True) would write the gradient over a leaf tensor's own "
                         "values (and make it its .grad): pass logits computed from it, or inplace_backward=False")
    padded = logits.size(-1)
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be in 1..{padded} (the padded logits' width)")
    if _ext.use_kernel(logits, target) and target.dtype == torch.int64:
        return _CrossEntropyKernel.apply(logits.contiguous(), target.contiguous(), float(label_smoothing), vocab_size,
                                         bool(inplace_backward))
    return _CrossEntropyPyTorch.apply(logits, target, float(label_smoothing), vocab_size)
