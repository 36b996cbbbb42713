"""AdamW over fp32 master parameters in one pass (csrc/adam.cu): the gradient clip folded in, the model's
bf16/fp16 copy written beside each master.

A mixed-precision step otherwise makes three passes over the parameters: the clip's multiply of every
gradient, torch's fused AdamW, and the copy of every master into the model. The update is torch's AdamW
(decoupled weight decay, bias-corrected moments), the gradient first multiplied by ``grad_scale``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from parallel3d.fused import _ext


@torch.no_grad()
def adamw_master_step_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                                exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                                model_params: Sequence[torch.Tensor], lr: float, beta1: float, beta2: float,
                                eps: float, weight_decay: float, step: int, grad_scale: float) -> None:
    """The kernel's update in PyTorch, in place (fp32 arithmetic, as the kernel's)."""
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        g = g * grad_scale
        p.mul_(1.0 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        p.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        if model_params:
            model_params[i].copy_(p)


def adamw_master_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                      model_params: Sequence[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, step: int, grad_scale: float = 1.0) -> None:
    """One AdamW step (``step`` counts from 1) of the fp32 ``params`` from ``grads * grad_scale``, moments in
    ``exp_avgs`` / ``exp_avg_sqs``; each updated master also written into ``model_params`` (bf16/fp16, or
    an empty list: none). The CUDA kernel where it applies, else the reference."""
    lists = (params, grads, exp_avgs, exp_avg_sqs) + ((model_params,) if model_params else ())
    if any(len(x) != len(params) for x in lists):
        raise ValueError("adamw_master_step: params, grads, exp_avgs, exp_avg_sqs (and model_params) must be "
                         "lists of the same length")
    if params and use_kernel((params, grads, exp_avgs, exp_avg_sqs), model_params):
        _ext.get_ext().adamw_master_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                                         list(model_params), float(lr), float(beta1), float(beta2), float(eps),
                                         float(weight_decay), int(step), float(grad_scale))
        return
    adamw_master_step_reference(params, grads, exp_avgs, exp_avg_sqs, model_params, lr, beta1, beta2, eps,
                                weight_decay, step, grad_scale)


def use_kernel(tensors: Sequence[Sequence[torch.Tensor]], model_params: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel takes these tensors: contiguous fp32 masters, gradients and moments on CUDA, and
    bf16/fp16 model copies of one dtype (or none)."""
    half = {p.dtype for p in model_params}
    fp32 = all(t.dtype == torch.float32 and t.is_cuda and t.is_contiguous() for ts in tensors for t in ts)
    return (fp32 and (half <= {torch.bfloat16} or half <= {torch.float16})
            and all(p.is_contiguous() for p in model_params) and _ext.use_kernel(tensors[0][0]))
