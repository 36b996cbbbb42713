"""Data-parallel wrapper with bucketed gradient reduction overlapped with backward (Megatron's DDP).

Usage per iteration (what the pipeline executor and the training loop do)::

    model.zero_grad_buffer()                  # or optimizer.zero_grad()
    for i, mb in enumerate(microbatches):
        ctx = model.no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = forward(mb) / len(microbatches)
            optimizer.scale_loss(loss).backward()
    finalize_model_grads([model])             # waits for the reductions, TP/PP fix-ups
    optimizer.step()

During the last microbatch's backward (outside ``no_sync``), a bucket's
all-reduce (or reduce-scatter, for ZeRO-1) starts as soon as every parameter of
the bucket has its gradient, while backward goes on with earlier layers.

Why ``register_post_accumulate_grad_hook``: it is public API (torch >= 2.1, so all
of 2.3..2.13), fires exactly once per parameter per backward after autograd has
summed all uses of the parameter into ``.grad``, and needs no handle on autograd
internals. Megatron's older trick (``param.expand_as(param).grad_fn.next_functions[0][0]``)
reaches into the graph's AccumulateGrad node, must keep that node alive by hand
and breaks under compiled autograd.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel3d import parallel_state
from parallel3d.model_chunk import is_first_stage_chunk, is_last_stage_chunk, set_input, shared_weight

from ..collectives import reduce_scatter_tensor
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer, backend_is_nccl


def _weak_method(method: Callable) -> Callable:
    """``method`` (a bound method) called through a weak reference to its object: a no-op once that is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


@dataclass
class DistributedDataParallelConfig:
    """Megatron's DDP options (same names, defaults and meanings where Megatron has them)."""

    grad_reduce_in_fp32: bool = False
    """Keep gradients (and reduce them) in fp32 even for bf16/fp16 parameters."""
    overlap_grad_reduce: bool = False
    """Launch each bucket's collective from the backward hooks; else all at once in start_grad_sync()."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: reduce-scatter gradients (padded buckets) and keep a parameter buffer for the all-gather."""
    bucket_size: Optional[int] = None
    """Elements per bucket; None (Megatron's meaning): max(40M, 1M x DP size) with overlap_grad_reduce,
    else one bucket per buffer. A parameter is never split across buckets."""
    average_in_collective: bool = False
    """Average in the collective (ReduceOp.AVG) instead of pre-scaling gradients by 1/DP before a SUM."""
    check_for_nan_in_grad: bool = False
    """Raise before launching a bucket whose gradients hold a NaN or Inf (costs a device sync per bucket)."""

    def __post_init__(self) -> None:
        if self.bucket_size is not None:
            if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
                raise ValueError(f"bucket_size must be a positive int (elements) or None, got {self.bucket_size!r}")


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so its gradients land in contiguous buffers reduced over the DP group.

    ``module.config.calculate_per_token_loss`` (Megatron's model-config flag), when
    true, turns off the 1/DP scaling: ``finalize_model_grads(num_tokens=...)`` then
    divides by the global token count instead.

    Set ``ddp.comm_events = []`` to record ``("bucket_launch", bucket_index, perf_counter_ns)``
    and ``("bucket_wait", bucket_index, perf_counter_ns)`` tuples (off by default).
    """

    def __init__(self, module: nn.Module, ddp_config: DistributedDataParallelConfig,
                 dp_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            raise TypeError(f"ddp_config must be a DistributedDataParallelConfig, got {type(ddp_config).__name__}")
        self.module = module
        self.ddp_config = ddp_config
        if dp_group is None and not parallel_state.model_parallel_is_initialized() and dist.is_initialized():
            # Never a guessed group: plain data parallelism over every rank passes dp_group=dist.group.WORLD.
            raise RuntimeError("DistributedDataParallel under torch.distributed needs dp_group=, or the groups of "
                               "parallel_state.initialize_model_parallel(): model parallel groups are not initialised")
        self.dp_group = dp_group if dp_group is not None else parallel_state.resolve_parallel_state().data_parallel_group
        self.dp_size, self.dp_rank = ((1, 0) if self.dp_group is None
                                      else (dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)))
        self.calculate_per_token_loss = bool(getattr(getattr(module, "config", None), "calculate_per_token_loss",
                                                     False))
        if self.calculate_per_token_loss and ddp_config.average_in_collective:
            raise ValueError("average_in_collective=True cannot be combined with calculate_per_token_loss=True: "
                             "per-token losses are summed over DP and divided by the global token count")
        # Megatron's gradient_scaling_factor: average over DP unless the collective or num_tokens does it.
        self.gradient_scaling_factor = (1.0 if self.calculate_per_token_loss or ddp_config.average_in_collective
                                        else 1.0 / self.dp_size)
        self._avg_in_collective_natively = (ddp_config.average_in_collective and self.dp_group is not None
                                            and backend_is_nccl(self.dp_group))

        self.param_names: dict[nn.Parameter, str] = {}
        for name, p in module.named_parameters():
            self.param_names.setdefault(p, name)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DistributedDataParallel: the module has no parameter that requires a gradient")

        separate = frozenset()
        if ddp_config.use_distributed_optimizer:
            shared = [p for p in params if getattr(p, "shared_embedding", False)]
            w = shared_weight(module)
            separate = frozenset(shared + ([w] if w is not None else []))

        bucket_size = ddp_config.bucket_size
        if bucket_size is None and ddp_config.overlap_grad_reduce:  # Megatron's default for overlapped buckets
            bucket_size = max(40_000_000, 1_000_000 * self.dp_size)
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else p.dtype
            by_dtype.setdefault((p.dtype, grad_dtype), []).append(p)
        self.param_and_grad_buffers: list[ParamAndGradBuffer] = []
        self.buckets: list[Bucket] = []
        for (param_dtype, grad_dtype), group_params in by_dtype.items():
            buf = ParamAndGradBuffer(group_params, param_dtype, grad_dtype, bucket_size, self.dp_size,
                                     self.dp_rank, ddp_config.use_distributed_optimizer, separate,
                                     first_bucket_index=len(self.buckets))
            self.param_and_grad_buffers.append(buf)
            self.buckets.extend(buf.buckets)
        self.param_to_bucket: dict[nn.Parameter, Bucket] = {p: b for b in self.buckets for p in b.params}

        self.is_last_microbatch = True
        self.comm_events: Optional[list] = None
        self._synced = False  # finish_grad_sync() ran; zero_grad_buffer() re-arms
        self._hook_handles = []
        # The parameters reach this object through a weak reference. A strong one (a bound method in a tensor's
        # hooks) is a cycle through the C++ tensor that the garbage collector cannot see: it kept the model, and
        # with it the process groups and their gloo worker threads, alive into interpreter shutdown, where a
        # worker releasing a tensor needs the GIL and the process aborted ("terminate called without an active
        # exception", about 1 run in 20 of the 8-process demo, after its last line).
        on_grad_ready = _weak_method(self._on_grad_ready)
        for p in params:
            p.grad_added_to_main_grad = False
            self._hook_handles.append(p.register_post_accumulate_grad_hook(on_grad_ready))
            # A zero-bubble W step calls this once a weight's deferred GEMMs have all run
            # (parallel3d.tensor_parallel.wgrad_store): that, not its B, makes the weight ready.
            p.deferred_grad_ready = on_grad_ready

    # ------------------------------------------------------------------ hooks and communication
    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self.param_to_bucket[param]
        if self._synced or bucket.launched:
            raise RuntimeError(
                f"gradient of {self.param_names.get(param, '?')!r} arrived after its bucket {bucket.index} was "
                "already reduced: run every microbatch's backward but the last inside no_sync(), and call "
                "zero_grad_buffer() before the next iteration's first backward"
            )
        # zero_out_wgrad: a fused wgrad wrote into main_grad AND other uses of the weight (a tied
        # embedding) left their gradients in param.grad on top of zeros: add those.
        if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(param.grad)
        param.grad = None
        if getattr(param, "wgrad_pending", 0):
            return  # banked; ready when the W step has added the deferred rest
        # Judged per backward: a fused wgrad kernel sets it again if it wrote into main_grad.
        param.grad_added_to_main_grad = False
        bucket.params_seen.add(param)
        if self.is_last_microbatch:
            bucket.params_with_grad.add(param)
            if self.ddp_config.overlap_grad_reduce and len(bucket.params_with_grad) == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.ddp_config.check_for_nan_in_grad and not bool(torch.isfinite(bucket.grad_data).all()):
            names = [self.param_names.get(p, "?") for p in bucket.params
                     if not bool(torch.isfinite(p.main_grad).all())]
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RuntimeError(f"rank {rank}: NaN or Inf in the gradients of bucket {bucket.index} "
                               f"(parameters {names}) before its data-parallel reduction")
        if self.comm_events is not None:
            self.comm_events.append(("bucket_launch", bucket.index, time.perf_counter_ns()))
        bucket.launched = True
        if self.gradient_scaling_factor != 1.0:
            bucket.grad_data.mul_(self.gradient_scaling_factor)
        if self.dp_size == 1:
            return
        op = dist.ReduceOp.SUM
        if self.ddp_config.average_in_collective:
            if self._avg_in_collective_natively:
                op = dist.ReduceOp.AVG
            else:  # gloo and friends: the same arithmetic, the division after the SUM
                bucket.post_divide = self.dp_size
        if self.ddp_config.use_distributed_optimizer:
            shard = bucket.local_grad_shard()
            # NCCL reduces in place when the output is the rank's slice of the input; others need a copy.
            out = shard if backend_is_nccl(self.dp_group) else torch.empty_like(shard)
            bucket.handle = reduce_scatter_tensor(out, bucket.grad_data, op=op, group=self.dp_group, async_op=True)
            bucket.pending_output = None if out is shard else out
        else:
            bucket.handle = dist.all_reduce(bucket.grad_data, op=op, group=self.dp_group, async_op=True)

    def _wait(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        target = bucket.local_grad_shard() if self.ddp_config.use_distributed_optimizer else bucket.grad_data
        if bucket.pending_output is not None:
            target.copy_(bucket.pending_output)
            bucket.pending_output = None
        if bucket.post_divide is not None:
            target.div_(bucket.post_divide)
            bucket.post_divide = None
        if self.comm_events is not None:
            self.comm_events.append(("bucket_wait", bucket.index, time.perf_counter_ns()))

    def _check_bucket_complete(self, bucket: Bucket) -> None:
        if bucket.params_seen and len(bucket.params_seen) != len(bucket.params):
            missing = [self.param_names.get(p, "?") for p in bucket.params if p not in bucket.params_seen]
            raise RuntimeError(
                f"gradient bucket {bucket.index}: {len(bucket.params_seen)} of {len(bucket.params)} parameters got "
                f"a gradient; no gradient for {missing}. A parameter that requires grad but takes no part in the "
                "loss is a bug (set requires_grad=False on it or use it)"
            )

    @torch.no_grad()
    def start_grad_sync(self) -> None:
        """Launch the collective of every bucket not launched yet (all of them with overlap_grad_reduce=False)."""
        if self._synced:
            return
        pending = [b for b in self.buckets if not b.launched]
        for bucket in pending:  # check everything first: no half-launched state on error
            self._check_bucket_complete(bucket)
        for bucket in pending:
            self._launch(bucket)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch what is left and wait for every bucket; afterwards main_grad holds the reduced gradients
        (for ZeRO-1: this rank's shard of each bucket does)."""
        if self._synced:
            return
        self.start_grad_sync()
        for bucket in self.buckets:
            self._wait(bucket)
        self._synced = True

    @torch.no_grad()
    def zero_grad_buffer(self) -> None:
        """Zero every main_grad and re-arm the buckets for the next iteration."""
        for bucket in self.buckets:
            if bucket.handle is not None:  # never zero memory a collective is still writing
                bucket.handle.wait()
        for buf in self.param_and_grad_buffers:
            buf.zero_grad()
        for p in self.param_to_bucket:
            p.grad_added_to_main_grad = False
            p.grad = None
        self._synced = False

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float) -> None:
        for buf in self.param_and_grad_buffers:
            buf.scale_gradients(scaling_factor)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate into main_grad but communicate nothing."""
        previous = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copy DP rank 0's parameters to every DP rank (call once after building the model)."""
        if self.dp_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        in_buffers = set()
        for buf in self.param_and_grad_buffers:
            if buf.param_data is not None:
                dist.broadcast(buf.param_data, src=src, group=self.dp_group)
                in_buffers.update(buf.params)
        for p in self.module.parameters():
            if p not in in_buffers:
                dist.broadcast(p.data, src=src, group=self.dp_group)
        # Written in place unseen by autograd: the version tells caches keyed on it (the FP8 weights).
        for p in self.module.parameters():
            torch.autograd.graph.increment_version(p)  # one tensor a call: torch 2.3 takes no list

    # ------------------------------------------------------------------ module plumbing
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any):  # no "module." prefix: checkpoints stay wrapper-free
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs: Any):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)

    # ------------------------------------------------------------------ the model contract (model_chunk.py)
    @property
    def pre_process(self) -> bool:
        return is_first_stage_chunk(self.module)

    @property
    def post_process(self) -> bool:
        return is_last_stage_chunk(self.module)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return bool(getattr(self.module, "share_embeddings_and_output_weights", False))

    @property
    def config(self) -> Any:
        return getattr(self.module, "config", None)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        return shared_weight(self.module)

    def set_input_tensor(self, input_tensor: Any) -> None:
        set_input(self.module, input_tensor)


def ddp_chunks(model_chunks: Any, caller: str) -> list[DistributedDataParallel]:
    """The model chunks (one chunk alone is accepted) as a list, each a DistributedDataParallel."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise ValueError(f"{caller} needs at least one model chunk")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise TypeError(f"model chunk {i} is a {type(chunk).__name__}: wrap it in DistributedDataParallel "
                            f"({caller} reads main_grad from its buffers)")
    return chunks
