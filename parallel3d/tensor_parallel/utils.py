"""Small helpers shared by the tensor-parallel layers."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from parallel3d import parallel_state


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact division with an error that names the numbers."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


def resolve_tp_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The explicit group if given, else the default TP group, else None (a single process)."""
    if group is not None:
        return group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[first, last) vocabulary ids held by ``rank`` when the vocab is split evenly."""
    per_rank = divide(global_vocab_size, world_size, "padded vocabulary size")
    return rank * per_rank, (rank + 1) * per_rank
