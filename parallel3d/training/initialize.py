"""Setting up a run (Megatron's ``initialize`` and ``get_model``): the process groups and seeds (a run
without a launcher as one process), this rank's model chunks wrapped in DDP, the LR schedule;
``print_rank_0`` / ``is_last_rank`` for messages.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from parallel3d import parallel_state, symmetric_memory
from parallel3d.device import default_backend, default_device
from parallel3d.distributed_timeout import prepare_process_groups, start_watchdog
from parallel3d.distributed import DistributedDataParallel, OptimizerParamScheduler
from parallel3d.pipeline.registry import placement_of
from parallel3d.pipeline.schedules import virtual_stage
from parallel3d.tensor_parallel import model_parallel_cuda_manual_seed
from parallel3d.training.training_config import TrainingConfig, as_training_config


def print_rank_0(*args: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def single_process_env() -> bool:
    """Without a launcher (no RANK set, as ``python3 examples/pretrain_gpt.py``): become rank 0 of 1 on a
    free local port, instead of torch's "environment variable RANK expected". True when it did so."""
    if "RANK" in os.environ or dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return True


def initialize_distributed(config: TrainingConfig | argparse.Namespace) -> None:
    """Process group (nccl with GPUs, gloo without), model-parallel groups, seeds."""
    config = as_training_config(config)
    loop, layout = config.loop, config.layout
    backend = loop.distributed_backend or default_backend()
    if single_process_env():
        print_rank_0("no launcher (torchrun) environment: running as a single process")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # Megatron's --distributed-timeout-minutes: gloo's 30 min default would stall every rank that long.
    # NCCL's groups get a longer timeout than ours: our watchdog names the hung operation first (distributed_timeout).
    timeout = prepare_process_groups(backend, datetime.timedelta(minutes=loop.distributed_timeout_minutes))
    symmetric = layout.tp_symmetric_gathers  # symmetric_memory.gathers_off_reason: SP with graphs, if not turned off
    if backend == "nccl" and symmetric:
        symmetric_memory.nccl_environment_defaults()  # the copy engines' policy, before NCCL's communicators
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    state = parallel_state.initialize_model_parallel(**layout.model_parallel_sizes, timeout=timeout,
                                                     tp_symmetric_gathers=None if symmetric else False)
    if layout.sequence_parallel:
        reason = state.tp_symmetric_off_reason if symmetric else layout.tp_symmetric_gathers_off
        print_rank_0(symmetric_memory.describe(state.tp_symmetric_buffers, reason))
    start_watchdog()
    # Megatron's _set_random_seed: one seed per pipeline stage for the CPU generator (weights are
    # initialised there) and the device's, TP streams inside the tracker.
    seed = loop.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def get_model(model_provider: Callable[..., torch.nn.Module], config: TrainingConfig
              ) -> list[DistributedDataParallel]:
    """Build this rank's model chunks (one per virtual stage) and wrap each in DDP."""
    state = parallel_state.resolve_parallel_state()
    chunks = []
    P = state.pipeline_model_parallel_size
    V = config.layout.model_parallel_sizes["virtual_pipeline_model_parallel_size"] or 1
    placement = placement_of(config.layout.pipeline_schedule, V)  # ZB-V / DualPipeV (auto over 2 chunks): a V
    for c in range(V):
        v = virtual_stage(state.pipeline_model_parallel_rank, c, P, placement)
        pre, post = v == 0, v == P * V - 1
        chunks.append(model_provider(pre_process=pre, post_process=post, vp_stage=c))
    wrapped = [DistributedDataParallel(chunk.to(default_device()), config.ddp) for chunk in chunks]
    for w in wrapped:
        w.broadcast_params()
    return wrapped


def get_optimizer_param_scheduler(optimizer: Any, config: TrainingConfig) -> OptimizerParamScheduler:
    """Megatron counts the schedule in samples: one step advances it by the global batch."""
    lr = config.lr_schedule  # its lengths: iterations x global batch, or --train-samples' own sample counts
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if lr.lr_warmup_steps else lr.lr, max_lr=lr.lr, min_lr=lr.min_lr,
        lr_decay_style=lr.lr_decay_style, start_wd=lr.weight_decay, end_wd=lr.weight_decay,
        wd_incr_style="constant", lr_wsd_decay_style=lr.lr_wsd_decay_style if lr.lr_decay_style == "WSD" else None,
        lr_warmup_steps=lr.lr_warmup_steps, lr_decay_steps=lr.lr_decay_steps, wd_incr_steps=lr.wd_incr_steps,
        wsd_decay_steps=lr.wsd_decay_steps,
    )
