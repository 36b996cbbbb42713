"""Small helpers shared by the tensor-parallel layers."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from parallel3d import parallel_state
from parallel3d.distributed_timeout import group_peers, waiting_for


def eager(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, made at ``fn``'s first call: that call imports Dynamo, seconds of
    every process's start (each rank of a job, each gloo rank of the tests), which a run that compiles
    nothing never needs. Inside a compiled model the result is the same: ``fn`` runs eagerly."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = call.__dict__.get("_disabled")
        if disabled is None:
            disabled = call._disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact division with an error that names the numbers."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


def resolve_tp_group(group: Optional[dist.ProcessGroup], who: str = "a tensor-parallel layer",
                     instead: str = "pass the layer its group (tp_group= or group=)") -> Optional[dist.ProcessGroup]:
    """The explicit group if given, else the default TP group, else None (one process, no TP) where this process
    is alone: without torch.distributed, or in a job of one process. In a job of several processes without
    model-parallel groups an error, as DDP gives: ``who`` (a layer, the RNG seeding) would act on each rank as if
    alone. ``instead``: the error's other fix."""
    if group is not None:
        return group
    if not parallel_state.model_parallel_is_initialized() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"{who} in a job of {dist.get_world_size()} processes, but model parallel groups are "
            "not initialised: call parallel_state.initialize_model_parallel(...) first (tensor_model_parallel_size=1 "
            f"for a model of one process per rank), or {instead}")
    return parallel_state.resolve_parallel_state().tensor_model_parallel_group


def tp_collective(what: str, group: dist.ProcessGroup) -> waiting_for:
    """The ``waiting_for`` block of a tensor-parallel collective: a timeout names it and the TP group's ranks."""
    return waiting_for(f"a tensor-parallel {what} (a TP layer's forward or backward)", group_peers(group))


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[first, last) vocabulary ids held by ``rank`` when the vocab is split evenly."""
    per_rank = divide(global_vocab_size, world_size, "padded vocabulary size")
    return rank * per_rank, (rank + 1) * per_rank


def split_tensor_for_rank(full: torch.Tensor, partition_dim: int, stride: int, rank: int,
                          world_size: int, padded_size: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of a full (TP=1) tensor, as the TP layers lay it out.

    The partition dim is seen as ``stride`` blocks (e.g. SwiGLU's [gate; up]) and
    rank r holds its slice of every block. ``padded_size`` zero-pads the dim first
    (a vocabulary padded for TP).
    """
    if padded_size is not None and full.size(partition_dim) < padded_size:
        pad_shape = list(full.shape)
        pad_shape[partition_dim] = padded_size - full.size(partition_dim)
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=partition_dim)
    if world_size == 1:
        return full
    block = divide(full.size(partition_dim), stride * world_size, "partitioned dimension")
    pieces = torch.split(full, block, dim=partition_dim)
    return torch.cat(pieces[rank::world_size], dim=partition_dim)


def merge_tensor_shards(shards: list[torch.Tensor], partition_dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`split_tensor_for_rank`: the full tensor from every rank's shard."""
    if len(shards) == 1:
        return shards[0]
    blocks = [s.chunk(stride, dim=partition_dim) for s in shards]
    return torch.cat([blk[i] for i in range(stride) for blk in blocks], dim=partition_dim)
