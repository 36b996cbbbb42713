"""GPT training throughput of parallel3d, comparable line by line with ../shared/anchors/megatron_gpt_bench.py.

    torchrun --standalone --nproc-per-node 2 bench/gpt_bench.py --preset gpt-1.3b --global-batch-size 32
    torchrun --standalone --nproc-per-node 2 bench/gpt_bench.py --preset gpt-1.3b --pp 2 --schedule-timing

Same presets, synthetic data, bf16 parameters with fp32 gradient buffers and fp32
master weights, Adam, and the same FLOPs formula (Megatron's: causal attention
counted as half) as the Megatron-Core anchor, so the RESULT_JSON lines compare
directly. The training step is parallel3d.training.train_step, the one the
pretraining script runs. Any other flag goes to the training arguments as it does in pretrain_gpt.py,
the FP8 ones included (``--fp8-format hybrid --fp8-recipe tensorwise``): the result names them.

Extras:
- ``--schedule-timing``: time every forward/backward of the pipeline schedule
  (CUDA events), then compare the measured step and bubble with the simulator's
  prediction from those per-stage times (the pipeline benchmark);
- ``--profile-overlap``: profile one iteration and report where the last rank's GPU time went
  (bench/profile_breakdown.py: GEMM, attention, other, communication and how much of it ran beside
  compute, idle); with ``--trace-out``, also collective by collective (bench/collective_profile.py);
- ``--host-time``: whether the step is bound by the host: the host's time to launch forward and backward
  against the GPU's time to finish them (equal: the GPU waited for the host);
- ``--stub-tp-comm``: a diagnosis, not a training run: every collective is replaced by a local copy of
  the right shape (numbers are wrong), so a TP-only step times its compute without communication, the
  ceiling that hiding the communication could reach.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

# CUDA_DEVICE_MAX_CONNECTIONS is left as the user's run has it (pretrain_gpt.py does not set it).
# Megatron-Core sets it to 1 for its own overlap's kernel order; parallel3d needs no such order, and
# with it TP=2 x DP=2 ran 25,413 tokens/s/GPU against 29,459 with 32 (BENCHMARKS.md, "second lease").

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from collective_profile import collective_table  # noqa: E402
from profile_breakdown import kernel_breakdown, write_op_table  # noqa: E402

from parallel3d import fused, parallel_state  # noqa: E402
from parallel3d.device import default_device  # noqa: E402
from parallel3d.training import gpt  # noqa: E402
from parallel3d.training.arguments import parse_args, validate_args  # noqa: E402
from parallel3d.distributed import get_megatron_optimizer  # noqa: E402
from parallel3d.pipeline import build_schedule, simulate  # noqa: E402
from parallel3d.pipeline.forward_backward import default_schedule_name  # noqa: E402
from parallel3d.training import (  # noqa: E402
    get_model,
    get_optimizer_param_scheduler,
    initialize_distributed,
    peak_tflops,
    train_step,
)
from parallel3d.training.training_config import TrainingConfig  # noqa: E402

PRESETS = {  # the Megatron anchor's presets
    "tiny": ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
             "--vocab-size", "50257", "--micro-batch-size", "4"],
    "gpt-1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length",
                 "2048", "--vocab-size", "50257", "--micro-batch-size", "4"],
    "llama-1b": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32",
                 "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "8192",
                 "--seq-length", "2048", "--vocab-size", "128256", "--micro-batch-size", "4",
                 "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                 "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
    # Llama-3.2-3B's shape (untied output, as llama-1b): the larger model where FP8's GEMMs pay more
    "llama-3b": ["--num-layers", "28", "--hidden-size", "3072", "--num-attention-heads", "24",
                 "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "8192",
                 "--seq-length", "2048", "--vocab-size", "128256", "--micro-batch-size", "1",
                 "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                 "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
    # Megatron-LM README's 7.1B row (the anchor's mlm-7.1b); run with fewer layers to fit a few GPUs.
    "mlm-7.1b": ["--num-layers", "30", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length",
                 "4096", "--vocab-size", "131072", "--micro-batch-size", "1",
                 "--untie-embeddings-and-output-weights"],
}

# Megatron's FP8 flags per recipe, as the benchmarks run them. The format follows torchao's recipe of the
# same name, so torchtitan's float8 run is the same arithmetic: tensorwise keeps e5m2 for gradients (hybrid),
# rowwise is e4m3 throughout. Delayed scaling with Megatron's example history (TE's recipe).
FP8_RECIPES = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
                "--fp8-amax-compute-algo", "max"],
}

# --fp8-disable NAME: the Fp8Scaling attribute that switches that speed-up (tensor_parallel/fp8.py).
FP8_SPEEDUPS = {"weight-cache": "cache_weights", "fused-cast": "fused_cast"}


def disable_fp8_speedups(model, names) -> None:
    """Set each named speed-up's attribute False on every FP8 linear of ``model`` (a list of chunks)."""
    from parallel3d.tensor_parallel.fp8 import Fp8Scaling

    for scaling in (m for chunk in model for m in chunk.modules() if isinstance(m, Fp8Scaling)):
        for name in names:
            setattr(scaling, FP8_SPEEDUPS[name], False)


def bench_args(argv=None, world: int | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(bench options, the validated training arguments) for ``world`` ranks (default: torchrun's)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt-1.3b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--schedule", default=None, help="override: gpipe, 1f1b, interleaved-1f1b (zero-bubble "
                   "ones, which need their chunk placement: pass --pipeline-schedule NAME)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--schedule-timing", action="store_true")
    p.add_argument("--profile-overlap", action="store_true")
    p.add_argument("--profile-table", default=None, help="with --profile-overlap: write the operators' GPU-time "
                   "table (by input shapes) to this file")
    p.add_argument("--trace-out", default=None, help="with --profile-overlap: export the last rank's chrome trace "
                   "here and add the per-collective table (bench/collective_profile.py) to the result")
    p.add_argument("--host-time", action="store_true", help="after the timed steps, time 4 more: how long the host "
                   "takes to launch forward and backward against when the GPU finishes them (a host-bound step: "
                   "the GPU ends right after the host's last launch)")
    p.add_argument("--stub-tp-comm", action="store_true", help="replace every collective by a local copy "
                   "(TP-only layouts; timing diagnosis, wrong numbers)")
    p.add_argument("--sm-carveout", type=int, default=None, help="SMs every GEMM leaves free "
                   "(nccl_bench.sm_carveout: every GEMM through cuBLASLt), so a collective beside it gets SMs at once")
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 (CPU smoke runs)")
    p.add_argument("--fp8-disable", nargs="+", default=[], choices=sorted(FP8_SPEEDUPS),
                   help="with --fp8-format: switch these speed-ups of tensor_parallel/fp8.py off (same numbers), "
                   "to measure each against the run without it")
    p.add_argument("--json-out", default=None)
    bench, rest = p.parse_known_args(argv)
    argv = PRESETS[bench.preset] + [
        "--tensor-model-parallel-size", str(bench.tp), "--pipeline-model-parallel-size", str(bench.pp),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4", "--train-iters", "1000",
        "--log-interval", "1000000", "--clip-grad", "1.0",
    ] + ([] if bench.fp32 else ["--bf16"]) \
      + (["--virtual-pipeline-model-parallel-size", str(bench.vpp)] if bench.vpp else []) + rest
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    args = validate_args(parse_args(argv, extra_args_provider=gpt.add_sampling_args), world)
    return bench, args


def fp8_settings(args: argparse.Namespace) -> dict:
    """The run's FP8 options as the training arguments hold them (Megatron's dest for --fp8-format is ``fp8``):
    all None for a bf16 run, the amax history's only under the delayed recipe (the one that reads them)."""
    fp8 = getattr(args, "fp8", None)
    recipe = getattr(args, "fp8_recipe", None) if fp8 else None
    delayed = {k: getattr(args, k, None) if recipe == "delayed" else None
               for k in ("fp8_amax_history_len", "fp8_amax_compute_algo")}
    return {"fp8_format": fp8, "fp8_recipe": recipe, **delayed}


def synthetic_iterator(args: argparse.Namespace):
    """Random tokens in the dataset's item format, generated on the device (no loader in the timing)."""
    g = torch.Generator(device=default_device()).manual_seed(1234 + parallel_state.resolve_parallel_state().data_parallel_rank)
    b, s = args.micro_batch_size, args.seq_length
    positions = torch.arange(s, device=default_device()).expand(b, s)
    mask = torch.ones(b, s, device=default_device())
    while True:
        t = torch.randint(0, args.vocab_size, (b, s + 1), device=default_device(), generator=g)
        yield {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask, "position_ids": positions}


def stub_collectives() -> None:
    """Every collective becomes a local copy of the right shape: the step's compute without its communication.
    Only for a layout whose every collective is TP (no DP or PP traffic)."""
    class Done:
        def wait(self):
            return True

    def gather(output, input, group=None, async_op=False):
        for piece in output.chunk(dist.get_world_size(group)):
            piece.copy_(input.reshape(piece.shape))
        return Done() if async_op else None

    def scatter(output, input, op=None, group=None, async_op=False):
        output.copy_(input.chunk(dist.get_world_size(group))[0].reshape(output.shape))
        return Done() if async_op else None

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return Done() if async_op else None

    def all_to_all(output, input, group=None, async_op=False):
        output.copy_(input)
        return Done() if async_op else None

    for name in ("all_gather_into_tensor", "all_gather_single"):
        setattr(dist, name, gather)
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        setattr(dist, name, scatter)
    dist.all_reduce, dist.all_to_all_single = all_reduce, all_to_all


def host_and_gpu_time(step, steps: int = 4) -> dict:
    """Milliseconds from the start of forward and backward (the GPU idle) to the host's return from them, and
    to the GPU's end of them, median of ``steps`` training steps. forward_backward is wrapped for the
    measurement only: the training step's own syncs come after it (loss, grad norm)."""
    import parallel3d.training.step as step_module

    inner, pairs = step_module.forward_backward, []

    def timed(*args, **kwargs):
        cuda = torch.cuda.is_available()  # on CPU the host does the work: both times are the host's
        sync()
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
        t0 = time.perf_counter()
        if cuda:
            start.record()
        out = inner(*args, **kwargs)
        host = (time.perf_counter() - t0) * 1e3
        if cuda:
            end.record()
        sync()
        pairs.append((host, start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3))
        return out

    step_module.forward_backward = timed
    try:
        for _ in range(steps):
            step()
    finally:
        step_module.forward_backward = inner
    return {"host_fwd_bwd_ms": statistics.median(h for h, _ in pairs),
            "gpu_fwd_bwd_ms": statistics.median(g for _, g in pairs),
            "host_gpu_fwd_bwd_ms": [[round(h, 1), round(g, 1)] for h, g in pairs]}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> None:
    bench, args = bench_args(argv)
    training_config = TrainingConfig.from_args(args)
    initialize_distributed(training_config)
    if bench.stub_tp_comm:
        if args.pipeline_model_parallel_size > 1 or args.data_parallel_size > 1:
            raise SystemExit("--stub-tp-comm: only for TP-only layouts (PP and DP traffic must stay real)")
        stub_collectives()
    if bench.sm_carveout is not None:
        from nccl_bench import sm_carveout  # bench/ is this script's directory

        sm_carveout(bench.sm_carveout)
    fused_kernels = fused.describe()
    config = gpt.transformer_config_from_args(args)
    partition = gpt.layer_partition(args, config)
    model = get_model(partial(gpt.model_provider, config, partition), training_config)
    disable_fp8_speedups(model, bench.fp8_disable)
    optimizer = get_megatron_optimizer(training_config.optimizer, model)
    scheduler = get_optimizer_param_scheduler(optimizer, training_config)
    iterators = [synthetic_iterator(args) for _ in model]
    forward_step = partial(gpt.forward_step, False)

    times = []
    if config.enable_cuda_graph:  # the warm-up steps count the forwards in flight: the capture's slots
        from parallel3d.training.cuda_graphs import count_in_flight

        count_in_flight(model)
    for i in range(bench.warmup + bench.iters):
        if i == bench.warmup and config.enable_cuda_graph:  # after the warm-up steps, whatever --cuda-graph-warmup-steps
            from parallel3d.training.cuda_graphs import capture_cuda_graphs

            capture_cuda_graphs(model, args.micro_batch_size)
        sync()
        t0 = time.perf_counter()
        train_step(forward_step, iterators, model, optimizer, scheduler, training_config, schedule=bench.schedule)
        sync()
        if i >= bench.warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    world = args.world_size
    tokens = args.global_batch_size * args.seq_length
    tflops = config.num_floating_point_operations(args.global_batch_size) / step / world / 1e12
    peak = peak_tflops(args)
    result = {
        "framework": "parallel3d", "fused_kernels": fused_kernels, "preset": bench.preset,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "world_size": world, "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
        "vpp": args.virtual_pipeline_model_parallel_size, "dp": args.data_parallel_size,
        "sequence_parallel": args.sequence_parallel, "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size, "num_microbatches": args.num_microbatches,
        "schedule": bench.schedule or args.pipeline_schedule or default_schedule_name(args.pipeline_model_parallel_size,
                                                            args.virtual_pipeline_model_parallel_size),
        "distributed_optimizer": args.use_distributed_optimizer, "overlap_grad_reduce": args.overlap_grad_reduce,
        "bucket_size": args.ddp_bucket_size, "iteration_time_s": step,
        "iteration_time_spread_s": [min(times), max(times)], "tokens_per_s_per_gpu": tokens / step / world,
        "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None,
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries") if torch.cuda.is_available() else None,
        "sm_carveout": bench.sm_carveout, "cuda_graph": config.enable_cuda_graph, **fp8_settings(args),
        "fp8_disabled": bench.fp8_disable,
    }

    if bench.schedule_timing and args.pipeline_model_parallel_size > 1:
        stats: list = []
        sync()
        t0 = time.perf_counter()
        train_step(forward_step, iterators, model, optimizer, scheduler, training_config, stats=stats,
                   schedule=bench.schedule)
        sync()
        timed_step = time.perf_counter() - t0
        mine = stats[0].action_times if stats else []
        costs: dict = {}
        for name, a, b in mine:
            kind, rest = name[0], name[1:]
            chunk = int(rest.split(".")[1])
            costs.setdefault((chunk, kind), []).append(b - a)
        gathered = [None] * dist.get_world_size(parallel_state.get_pipeline_model_parallel_group())
        summary = {k: statistics.median(v) for k, v in costs.items()}
        dist.all_gather_object(gathered, summary, group=parallel_state.get_pipeline_model_parallel_group())
        P = args.pipeline_model_parallel_size
        V = args.virtual_pipeline_model_parallel_size or 1
        # (F, B) or, where the schedule splits backward, (F, B, W) per (rank, chunk)
        stage_costs = {(r, c): tuple(gathered[r][(c, k)] for k in "FBW" if (c, k) in gathered[r])
                       for r in range(P) for c in range(V)}
        sched = build_schedule(result["schedule"], P, args.num_microbatches, V, hidden_size=args.hidden_size,
                               seq_length=args.seq_length)  # 'auto' picks as the training step did
        predicted = simulate(sched, stage_costs=stage_costs)
        # The same times if every comm batch also waited for its peer's send (a blocking transport).
        result["predicted_makespan_blocking_sends_s"] = simulate(sched, stage_costs=stage_costs,
                                                                 sends_block=True).makespan
        busy = sum(b - a for _, a, b in mine)
        schedule_span = max(b for _, _, b in mine) if mine else 0.0
        all_busy = [None] * P
        all_span = [None] * P
        dist.all_gather_object(all_busy, busy, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_gather_object(all_span, schedule_span, group=parallel_state.get_pipeline_model_parallel_group())
        makespan = max(all_span)
        result.update({
            "schedule_step_s": timed_step, "measured_schedule_makespan_s": makespan,
            "measured_bubble_overhead": (P * makespan - sum(all_busy)) / sum(all_busy),
            "predicted_makespan_s": predicted.makespan, "predicted_bubble_overhead": predicted.bubble_overhead,
            "formula_bubble_overhead": (P - 1) / (V * args.num_microbatches),
            "stage_costs_ms": {f"{r}.{c}": [round(1e3 * x, 2) for x in v] for (r, c), v in stage_costs.items()},
        })

    if bench.host_time:
        result.update(host_and_gpu_time(partial(train_step, forward_step, iterators, model, optimizer, scheduler,
                                                training_config, schedule=bench.schedule)))

    if bench.profile_overlap:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, record_shapes=bool(bench.profile_table)) as prof:
            train_step(forward_step, iterators, model, optimizer, scheduler, training_config, schedule=bench.schedule)
            sync()
        result.update(kernel_breakdown(prof))
        if bench.profile_table and dist.get_rank() == dist.get_world_size() - 1:
            write_op_table(prof, bench.profile_table)
        if bench.trace_out and dist.get_rank() == dist.get_world_size() - 1:
            prof.export_chrome_trace(bench.trace_out)
            with open(bench.trace_out) as f:
                result["collective_profile"] = collective_table(json.load(f))

    if dist.get_rank() == dist.get_world_size() - 1:
        print("RESULT_JSON: " + json.dumps(result), flush=True)
        if bench.json_out:
            with open(bench.json_out, "a") as f:
                f.write(json.dumps(result) + "\n")
    if config.enable_cuda_graph:  # live graphs keep NCCL's communicators: destroy_process_group would wait forever
        from parallel3d.training.cuda_graphs import release_cuda_graphs

        release_cuda_graphs(model)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel3d.lifetime import exit_with_launcher

    exit_with_launcher()  # a worker must not outlive a killed torchrun (parallel3d/lifetime.py)
    main()
