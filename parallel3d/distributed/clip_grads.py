"""Global gradient norm and clipping across TP, PP and (for ZeRO-1 shards) DP.

Every element of the model's gradient must enter the norm exactly once:
- a TP-replicated parameter (LayerNorm, row-parallel bias) is counted on TP rank 0
  only (``param_is_not_tensor_parallel_duplicate``);
- the tied word embedding has a copy on the last pipeline stage: only the first
  stage counts it. A parameter marked ``param.shared = True`` (Megatron's
  convention) is skipped; the optimizer marks its fp32 master of the copy that way
  by itself (the ``shared_embedding_or_output_weight()`` of a chunk with
  ``share_embeddings_and_output_weights`` and ``pre_process=False``);
- partial sums of squares are then added over the model-parallel (TP x PP)
  group, and over DP as well when each DP rank holds a different shard (ZeRO-1).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d import parallel_state
from parallel3d.collectives import all_reduce_over
from parallel3d.device import default_device
from parallel3d.tensor_parallel import param_is_not_tensor_parallel_duplicate


def param_is_counted_in_grad_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Megatron's ``is_not_shared and is_not_tp_duplicate`` filter."""
    return not getattr(param, "shared", False) and param_is_not_tensor_parallel_duplicate(param, tp_rank)


def _device_of(grads: Sequence[torch.Tensor], device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if grads:
        return grads[0].device
    return default_device()


def get_grad_norm_fp32(
    grads_for_norm: Sequence[torch.Tensor],
    norm_type: float = 2.0,
    reduce_groups: Sequence[Optional[dist.ProcessGroup]] = (),
    device: Optional[torch.device] = None,
) -> float:
    """Norm of the gradients of all ranks in ``reduce_groups`` (orthogonal groups, applied one after another).

    ``grads_for_norm`` must already exclude duplicates (see ``param_is_counted_in_grad_norm``).
    A rank with no gradients (an empty ZeRO shard) still takes part in the collectives.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    grads = [g for g in grads_for_norm if g.numel() > 0]
    total = torch.zeros((), dtype=torch.float32, device=_device_of(grads, device))
    if math.isinf(norm_type):
        if grads:
            total = torch.stack([g.detach().abs().max().float() for g in grads]).max()
        all_reduce_over(total, dist.ReduceOp.MAX, reduce_groups)
        return float(total.item())
    if grads:
        norms = torch._foreach_norm([g.detach().float() for g in grads], norm_type)
        total = torch.stack(norms).pow(norm_type).sum()
    all_reduce_over(total, dist.ReduceOp.SUM, reduce_groups)
    return float(total.item()) ** (1.0 / norm_type)


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """The factor clipping scales the gradients by: max_norm / total_norm (torch's formula) where the norm
    exceeds max_norm, else 1. ``max_norm`` 0: no clipping (Megatron's --clip-grad 0)."""
    if max_norm <= 0.0:
        return 1.0
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    return clip_coeff if clip_coeff < 1.0 else 1.0


@torch.no_grad()
def clip_grad_by_total_norm_fp32(grads: Sequence[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by ``clip_coefficient`` where it is below 1."""
    clip_coeff = clip_coefficient(max_norm, total_norm)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(list(grads), clip_coeff)


def count_zeros_fp32(grads_for_norm: Sequence[torch.Tensor],
                     reduce_groups: Sequence[Optional[dist.ProcessGroup]] = (),
                     device: Optional[torch.device] = None) -> int:
    dev = _device_of(grads_for_norm, device)
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for g in grads_for_norm:
        total += g.numel() - torch.count_nonzero(g)
    all_reduce_over(total, dist.ReduceOp.SUM, reduce_groups)
    return int(total.item())


def clip_grad_norm_fp32(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    reduce_groups: Optional[Sequence[Optional[dist.ProcessGroup]]] = None,
    tp_rank: Optional[int] = None,
) -> float:
    """Clip ``param.grad`` of ``parameters`` to a global norm of ``max_norm``; return the norm before clipping.

    ``reduce_groups`` defaults to the model-parallel group of the global parallel
    state (add the DP group when the parameters are ZeRO-1 shards).
    """
    params = [p for p in parameters if p.grad is not None]
    state = parallel_state.resolve_parallel_state()
    if reduce_groups is None:
        reduce_groups = tuple(g for g in (state.model_parallel_group,) if g is not None)
    if tp_rank is None:
        tp_rank = state.tensor_model_parallel_rank
    grads_for_norm = [p.grad for p in params if param_is_counted_in_grad_norm(p, tp_rank)]
    total = get_grad_norm_fp32(grads_for_norm, norm_type, reduce_groups)
    clip_grad_by_total_norm_fp32([p.grad for p in params], max_norm, total)
    return total
