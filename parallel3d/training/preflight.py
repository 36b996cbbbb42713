"""Pre-flight: refuse, before the process group starts, a run whose memory cannot fit this machine.

Sizes that pass every range rule can still be absurd (``--hidden-size 65536``, ``--num-layers 100000``,
``--micro-batch-size 100000``, ``--train-iters 10000000000``, ``--sample-tokens 100000000``): they used to
fail after init, each rank with a raw allocator error. The planner's memory model (parallel3d.planning,
docs/planning.md) gives a lower bound of one process's peak: the weights, gradients and optimizer state
of its pipeline stage plus one microbatch's activations. A layout whose lower bound exceeds the device
(or, on CPUs, the host's memory shared by its processes) cannot run, and is refused naming the estimate
and what fits; so are a data index and a sampling KV cache larger than memory.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional

from parallel3d.device import default_backend
from parallel3d.planning import Layout, ModelSpec
from parallel3d.planning.memory import memory_breakdown
from parallel3d.training.argument_rules import raise_problems
from parallel3d.training.megatron_args import samples_consumed

GIB = 2.0 ** 30
# The data index of one dataset per sample: token positions, the sample index (two int64) and the shuffle index.
INDEX_BYTES_PER_SAMPLE = 32


def host_memory_per_process() -> float:
    """The host's memory over the processes torchrun started on it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def process_memory() -> tuple[float, str]:
    """(bytes one process may use, what they are): its GPU's memory, else its share of the host's."""
    if default_backend() != "nccl":
        host = host_memory_per_process()
        processes = os.environ.get("LOCAL_WORLD_SIZE", "1")
        return host, f"{host / GIB:.1f} GiB host memory per process ({processes} on this host)"
    import torch

    props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
    return float(props.total_memory), f"{props.total_memory / GIB:.1f} GiB of the {props.name}"


def _model_problem(args: argparse.Namespace, config: Any, capacity: float, what: str) -> Optional[str]:
    model = ModelSpec.from_config(config)
    layout = Layout.from_args(args, bf16=bool(args.bf16 or args.fp16))  # fp16 keeps bf16's byte counts
    stages = {0, args.pipeline_model_parallel_size - 1}
    est = max((memory_breakdown(model, layout, stage, inflight=1) for stage in stages), key=lambda m: m.peak)
    if est.peak <= capacity:
        return None
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if est.static >= capacity:
        fix = (f"the weights, gradients and optimizer state alone need {est.static / GIB:,.1f} GiB: spread them over "
               f"at least {math.ceil(mp * est.static / capacity):,} model-parallel ranks (--tensor-model-parallel-size "
               f"x --pipeline-model-parallel-size, now {mp}), or train a smaller model")
    else:
        per_sample = (est.activations + est.transient) / args.micro_batch_size
        fits = int((capacity - est.static) // per_sample)
        fix = (f"--micro-batch-size {fits} fits by the estimate" if fits >= 1 else
               "not even --micro-batch-size 1 fits: shorten --seq-length, add --recompute-granularity full "
               "--recompute-method uniform --recompute-num-layers 1, or use more model-parallel ranks")
    return (f"this layout needs at least {est.peak / GIB:,.1f} GiB per process by the planner's estimate "
            f"({est.static / GIB:,.1f} GiB weights, gradients and optimizer state, {(est.peak - est.static) / GIB:,.1f}"
            f" GiB for one microbatch of --micro-batch-size {args.micro_batch_size}), more than the {what}: {fix}")


def _data_problem(args: argparse.Namespace, host: float) -> Optional[str]:
    samples = max(args.train_samples or 0, samples_consumed(args, args.train_iters))
    need = samples * INDEX_BYTES_PER_SAMPLE
    if need <= host:
        return None
    fits = int(host // INDEX_BYTES_PER_SAMPLE // args.target_global_batch_size)
    return (f"--train-iters {args.train_iters} x global batch {args.target_global_batch_size} = {samples:,} samples: "
            f"their data index alone needs {need / GIB:,.1f} GiB ({INDEX_BYTES_PER_SAMPLE} bytes a sample), more "
            f"than the host's {host / GIB:,.1f} GiB per process; at most about {fits:,} iterations fit")


def _sampling_problem(args: argparse.Namespace, capacity: float, what: str) -> Optional[str]:
    """examples/pretrain_gpt.py's --sample-prompt continuation: its KV cache (2 x tokens x query groups x
    kv channels per layer of a pipeline stage, on one TP rank). A learned position table caps the tokens itself."""
    tokens = getattr(args, "sample_tokens", 0) if getattr(args, "sample_prompt", None) else 0
    if not tokens or args.position_embedding_type == "learned_absolute":
        return None
    kv = (args.kv_channels or args.hidden_size // args.num_attention_heads) * \
        (args.num_query_groups or args.num_attention_heads) // args.tensor_model_parallel_size
    per_token = 2 * kv * math.ceil(args.num_layers / args.pipeline_model_parallel_size) * (2 if args.bf16 or args.fp16
                                                                                              else 4)
    if tokens * per_token <= capacity:
        return None
    return (f"--sample-tokens {tokens} needs a KV cache of {tokens * per_token / GIB:,.1f} GiB for the --sample-prompt "
            f"continuation, more than the {what}; at most about {int(capacity // per_token):,} tokens fit")


def check_fits(args: argparse.Namespace, config: Any,
               capacity: Optional[tuple[float, str]] = None, host: Optional[float] = None) -> None:
    """Raise an ArgumentError (all problems) when the validated ``args`` (and the model ``config`` built from
    them, a TransformerConfig) cannot fit this machine's memory.

    ``capacity``: (bytes, description) of one process's device, default :func:`process_memory`;
    ``host``: one process's share of host memory (the data index lives there), default measured."""
    capacity = capacity or process_memory()
    host = host_memory_per_process() if host is None else host
    problems = (_model_problem(args, config, *capacity), _data_problem(args, host),
                _sampling_problem(args, *capacity))
    raise_problems([p for p in problems if p])

