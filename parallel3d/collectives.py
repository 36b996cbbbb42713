"""The tensor collectives under their current names: torch 2.13 deprecates ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (a FutureWarning on every call) for ``all_gather_single`` / ``reduce_scatter_single``.
Older torch (>= 2.3, our floor) has only the old names; these wrappers pick whichever exists."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.device import default_device
from parallel3d.distributed_timeout import waiting_for


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                          group=None, async_op: bool = False):
    """``reduce_scatter_single`` where torch has it, else ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``all_gather_single`` where torch has it, else ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def all_reduce_over(t: torch.Tensor, op, groups) -> None:
    """All-reduce ``t`` over each of ``groups`` in turn (orthogonal groups), skipping None and one-rank groups."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=op, group=group)


def all_ranks_ok(ok: bool, what: str) -> bool:
    """Whether every rank reports ok: a sync point that, unlike a barrier, lets all ranks learn of one's
    failure (so each can say so and stop). ``what`` names the step in a timeout's message."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=default_device())
    with waiting_for(what, "every rank"):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())  # NCCL: the host waits here, inside the block
