"""Contiguous gradient buffers (and, for ZeRO-1, parameter buffers) split into buckets.

One buffer per (param dtype, grad dtype) pair. Parameters are laid out in
REVERSE order of ``module.parameters()``: backward produces gradients roughly
from the last layer to the first, so the first bucket fills up first and its
collective can start while backward still runs (Megatron's layout).

Each parameter's ``main_grad`` is a view into the gradient buffer. With the
distributed optimizer each bucket is padded to a multiple of
``dp_size * _SHARD_ALIGNMENT`` elements, so the bucket splits into DP equal
shards (one per rank, reduce-scattered in backward and all-gathered after the
step), and each parameter's ``data`` also becomes a view into a contiguous
parameter buffer so the all-gather writes straight into the model.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


# Each ZeRO shard starts at a multiple of 64 elements (256 bytes in fp32): aligned
# memory for the collectives and the optimizer's vectorised kernels.
_SHARD_ALIGNMENT = 64


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class Bucket:
    """A contiguous slice of a buffer whose gradients travel in one collective.

    ``param_ranges[p] = (start, end)`` is where ``p`` lives inside the bucket
    (bucket-local element offsets). Communication state (``launched``, ``handle``,
    which params delivered a gradient) is owned by the DDP wrapper.
    """

    def __init__(self, index: int, params: list[torch.nn.Parameter], param_ranges: dict,
                 grad_data: torch.Tensor, param_data: Optional[torch.Tensor], offset: int,
                 numel_unpadded: int, dp_size: int, dp_rank: int):
        self.index = index
        self.params = params
        self.param_ranges = param_ranges
        self.grad_data = grad_data
        self.param_data = param_data
        self.offset = offset  # start of the bucket inside its buffer
        self.numel = grad_data.numel()
        self.numel_unpadded = numel_unpadded
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.reset()

    def reset(self) -> None:
        self.params_with_grad: set = set()  # delivered a gradient during the last (synced) microbatch
        self.params_seen: set = set()  # delivered a gradient in any microbatch since zero_grad_buffer()
        self.launched = False
        self.handle = None
        self.pending_output: Optional[torch.Tensor] = None  # out-of-place reduce-scatter result
        self.post_divide: Optional[int] = None  # emulated ReduceOp.AVG: divide after the SUM

    def shard_range(self, rank: Optional[int] = None) -> tuple[int, int]:
        """[start, end) of DP rank ``rank``'s shard, bucket-local (ZeRO-1 layout)."""
        rank = self.dp_rank if rank is None else rank
        size = self.numel // self.dp_size
        return rank * size, (rank + 1) * size

    def local_grad_shard(self) -> torch.Tensor:
        start, end = self.shard_range()
        return self.grad_data[start:end]

    def local_param_shard(self) -> torch.Tensor:
        if self.param_data is None:
            raise RuntimeError("this bucket has no parameter buffer (use_distributed_optimizer=False)")
        start, end = self.shard_range()
        return self.param_data[start:end]


class ParamAndGradBuffer:
    """Gradient buffer (and optional parameter buffer) for parameters of one dtype pair.

    ``params`` come in module order; ``separate_bucket_params`` (the shared word
    embedding under the distributed optimizer) get a bucket of their own, so the
    first and last pipeline stage shard that parameter identically and the
    embedding all-reduce after the reduce-scatter stays correct.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        bucket_size: Optional[int],
        dp_size: int,
        dp_rank: int,
        use_distributed_optimizer: bool,
        separate_bucket_params: frozenset = frozenset(),
        first_bucket_index: int = 0,
    ):
        if not params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters of a buffer must live on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self.params = list(params)
        pad_to = dp_size * _SHARD_ALIGNMENT if use_distributed_optimizer else 1

        # Layout: (start, end) of each param in the buffer, and bucket boundaries.
        self.param_index_map: dict[torch.nn.Parameter, tuple[int, int]] = {}
        bucket_meta: list[tuple[int, int, int, list]] = []  # (start, padded end, unpadded numel, params)
        offset, bucket_start, current = 0, 0, []

        def close_bucket() -> None:
            nonlocal offset, bucket_start, current
            end = bucket_start + _round_up(offset - bucket_start, pad_to)
            bucket_meta.append((bucket_start, end, offset - bucket_start, current))
            offset = bucket_start = end
            current = []

        for p in reversed(self.params):
            n = p.numel()
            too_big = bucket_size is not None and offset - bucket_start + n > bucket_size
            if current and (too_big or p in separate_bucket_params):
                close_bucket()
            self.param_index_map[p] = (offset, offset + n)
            offset += n
            current.append(p)
            if p in separate_bucket_params:
                close_bucket()
        if current:
            close_bucket()
        self.numel = offset
        self.numel_unpadded = sum(p.numel() for p in self.params)

        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        self.param_data = (torch.zeros(self.numel, dtype=param_dtype, device=self.device)
                           if use_distributed_optimizer else None)
        for p in self.params:
            start, end = self.param_index_map[p]
            p.main_grad = self.grad_data[start:end].view(p.shape)
            if self.param_data is not None:
                # The model's parameter now lives in the buffer; the old storage is freed.
                self.param_data[start:end].copy_(p.data.reshape(-1))
                p.data = self.param_data[start:end].view(p.shape)

        self.buckets: list[Bucket] = []
        for i, (start, end, unpadded, bucket_params) in enumerate(bucket_meta):
            ranges = {p: (self.param_index_map[p][0] - start, self.param_index_map[p][1] - start)
                      for p in bucket_params}
            self.buckets.append(Bucket(
                first_bucket_index + i, bucket_params, ranges, self.grad_data[start:end],
                None if self.param_data is None else self.param_data[start:end], start, unpadded,
                dp_size, dp_rank,
            ))

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()

    def scale_gradients(self, scaling_factor: float) -> None:
        self.grad_data.mul_(scaling_factor)


def backend_is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"
