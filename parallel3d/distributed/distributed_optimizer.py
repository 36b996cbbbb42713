"""ZeRO-1: optimizer state and fp32 masters sharded over data-parallel ranks (Megatron's DistributedOptimizer).

The DDP wrapper (``use_distributed_optimizer=True``) pads each bucket to a
multiple of DP, reduce-scatters its gradients so that DP rank r holds the summed
gradient of slice r, and keeps the parameters in a contiguous buffer laid out
like the gradients. Here, for each bucket, rank r keeps an fp32 master of its
slice only (for fp32 parameters the slice of the parameter buffer itself) and
the optimizer state of that slice. A step:

    reduce-scattered grads -> unscale / inf check -> norm (summed over DP too) -> clip
    -> optimizer step on the shard -> shard copied into the parameter buffer
    -> all-gather of each bucket's parameters over DP

The torch optimizer steps one "piece" per (parameter, shard) overlap: a view of
the flat master shard, so weight decay can still follow the parameter (no decay
for biases and norms) and the copy back to the parameters is one copy per bucket.

Memory per parameter (bf16 params, fp32 grads, Adam): 2 (param) + 4 (grad) +
(4 master + 8 state) / DP = 6 + 12/d bytes, as in Megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from parallel3d import parallel_state as ps

from .ddp import DistributedDataParallel, ddp_chunks
from .optimizer import FP32Optimizer, MegatronOptimizer, MixedPrecisionOptimizer, OptimizerConfig, no_weight_decay
from ..collectives import all_gather_into_tensor
from .param_and_grad_buffer import Bucket, backend_is_nccl


@dataclass
class _ShardPiece:
    """The part [param_start, param_end) (flattened) of ``param`` that this rank's shard holds."""

    param: nn.Parameter
    param_start: int
    param_end: int
    shard_start: int  # offset of the piece inside the shard
    main: torch.Tensor  # fp32 view of the master shard; what the torch optimizer steps
    grad: torch.Tensor  # view of the (reduce-scattered) gradient shard


@dataclass
class _BucketShard:
    chunk_index: int
    bucket: Bucket
    param_dtype: torch.dtype
    param_shard: torch.Tensor  # view of the parameter buffer
    main_shard: torch.Tensor  # fp32 master of the whole shard (== param_shard for fp32 params)
    pieces: list


class DistributedOptimizer(MegatronOptimizer):
    def __init__(self, config: OptimizerConfig, model_chunks: Sequence[DistributedDataParallel],
                 state: Optional[ps.ParallelState] = None):
        super().__init__(config, model_chunks, state)
        self.dp_size = self.model_chunks[0].dp_size
        for i, chunk in enumerate(self.model_chunks):
            if chunk.dp_size != self.dp_size:
                raise ValueError(f"model chunk {i} has DP size {chunk.dp_size}, chunk 0 has {self.dp_size}")
        self.names: dict[nn.Parameter, tuple[int, str]] = {}
        for ci, name, p in self._named_trainable_params():
            self.names.setdefault(p, (ci, name))

        self.shards: list[_BucketShard] = []
        decay, no_decay = [], []
        for ci, chunk in enumerate(self.model_chunks):
            for buf in chunk.param_and_grad_buffers:  # get_megatron_optimizer checked they hold a parameter buffer
                for bucket in buf.buckets:
                    start, end = bucket.shard_range()
                    param_shard, grad_shard = bucket.local_param_shard(), bucket.local_grad_shard()
                    main_shard = param_shard if buf.param_dtype == torch.float32 else param_shard.float()
                    pieces = []
                    for p in bucket.params:
                        p_start, p_end = bucket.param_ranges[p]
                        lo, hi = max(p_start, start), min(p_end, end)
                        if lo >= hi:
                            continue
                        main = self._make_main(main_shard[lo - start:hi - start], p)
                        pieces.append(_ShardPiece(p, lo - p_start, hi - p_start, lo - start, main,
                                                  grad_shard[lo - start:hi - start]))
                        (no_decay if no_weight_decay(self.names[p][1], p) else decay).append(main)
                    self.shards.append(_BucketShard(ci, bucket, buf.param_dtype, param_shard, main_shard, pieces))
        self._pieces = [piece for shard in self.shards for piece in shard.pieces]
        self._mains = [piece.main for piece in self._pieces]
        self.optimizer = self._build_torch_optimizer(decay, no_decay)

    def _main_params(self) -> list[torch.Tensor]:
        return self._mains

    def _copy_model_grads_to_main_grads(self) -> None:
        for piece in self._pieces:
            piece.main.grad = piece.grad if piece.grad.dtype == torch.float32 else piece.grad.float()

    def _grad_stats_groups(self) -> tuple:
        # Each DP rank holds different gradient elements: sum over DP as well.
        return (self.model_parallel_group, self.data_parallel_group)

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        handles = []
        for shard in self.shards:
            if shard.main_shard is not shard.param_shard:
                shard.param_shard.copy_(shard.main_shard)
            bucket = shard.bucket
            if self.dp_size > 1:
                group = self.data_parallel_group
                # NCCL gathers in place (input = this rank's slice of the output); others need a copy.
                src = shard.param_shard if backend_is_nccl(group) else shard.param_shard.clone()
                handles.append(all_gather_into_tensor(bucket.param_data, src, group=group, async_op=True))
        for h in handles:
            h.wait()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        for shard in self.shards:
            if shard.main_shard is not shard.param_shard:
                shard.main_shard.copy_(shard.param_shard)

    # ------------------------------------------------------------------ checkpoints
    def _gather_full(self, flat_shard: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        if self.dp_size == 1:
            return flat_shard
        full = torch.empty(bucket.numel, dtype=flat_shard.dtype, device=flat_shard.device)
        all_gather_into_tensor(full, flat_shard.contiguous(), group=self.data_parallel_group)
        return full

    @torch.no_grad()
    def _gather_named_state(self) -> dict:
        """Collective over DP: each bucket's shards are all-gathered, every DP rank returns the full state."""
        params: dict = {}
        for shard in self.shards:
            flats = {"main_param": shard.main_shard.detach().float()}
            for key in self._state_keys():
                flat = torch.zeros_like(shard.main_shard, dtype=torch.float32)
                for piece in shard.pieces:
                    state = self.optimizer.state.get(piece.main, {})
                    if key in state:
                        flat[piece.shard_start:piece.shard_start + piece.main.numel()] = state[key]
                flats[key] = flat
            fulls = {k: self._gather_full(v, shard.bucket) for k, v in flats.items()}
            for p in shard.bucket.params:
                ci, name = self.names[p]
                a, b = shard.bucket.param_ranges[p]
                params.setdefault(ci, {})[name] = {k: full[a:b].view(p.shape).clone() for k, full in fulls.items()}
        return params

    @torch.no_grad()
    def _load_named_state(self, params: dict) -> None:
        for shard in self.shards:
            bucket = shard.bucket
            start, end = bucket.shard_range()
            keys = ("main_param",) + self._state_keys()
            fulls = {k: torch.zeros(bucket.numel, dtype=torch.float32, device=shard.main_shard.device) for k in keys}
            for p in bucket.params:
                ci, name = self.names[p]
                entry = self._saved_entry(params, ci, name, p.shape)
                a, b = bucket.param_ranges[p]
                for k in keys:
                    fulls[k][a:b] = entry[k].reshape(-1)
            shard.main_shard.copy_(fulls["main_param"][start:end])
            for piece in shard.pieces:
                lo = start + piece.shard_start
                hi = lo + piece.main.numel()
                self._set_optimizer_state(piece.main, {k: fulls[k][lo:hi] for k in self._state_keys()},
                                          self.num_steps)


# The factory sits here, below every optimizer class, so optimizer.py never imports this module back.
def _check_chunks(config: OptimizerConfig, model_chunks) -> list[DistributedDataParallel]:
    chunks = ddp_chunks(model_chunks, "get_megatron_optimizer")
    for i, chunk in enumerate(chunks):
        if chunk.ddp_config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError(f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} but model "
                             f"chunk {i} was wrapped with use_distributed_optimizer="
                             f"{chunk.ddp_config.use_distributed_optimizer}")
        for name, p in chunk.module.named_parameters():
            if p.requires_grad and p.dtype not in (config.params_dtype, torch.float32):
                raise ValueError(f"chunk {i} parameter {name!r} is {p.dtype} but the OptimizerConfig trains "
                                 f"{config.params_dtype} (bf16={config.bf16}, fp16={config.fp16})")
    return chunks


def get_megatron_optimizer(config: OptimizerConfig, model_chunks, state: Optional[ps.ParallelState] = None
                           ) -> MegatronOptimizer:
    """The optimizer for ``config``: ZeRO-1, mixed precision with fp32 masters, or plain fp32."""
    chunks = _check_chunks(config, model_chunks)
    if config.use_distributed_optimizer:
        return DistributedOptimizer(config, chunks, state)
    if config.bf16 or config.fp16:
        return MixedPrecisionOptimizer(config, chunks, state)
    return FP32Optimizer(config, chunks, state)
