"""Measure this GPU machine for the planner and write a cluster file (tools/plan.py --cluster-file).

    python3 bench/calibrate_planner.py --base h100-sxm --out planner_cluster.json [--nproc 2]

One process measures the GEMM curve (bf16, CUDA events) over transformer-like shapes, the
weight-gradient GEMM accumulated into fp32, the device copy bandwidth and SDPA flash attention;
then, with --nproc >= 2, torchrun (under a timeout) measures NCCL all-reduce, all-gather,
reduce-scatter bus bandwidth and point-to-point bandwidth between two GPUs; and one GPU's training step
gives the host's launch time per layer (``measure_host_layer_us``).  Fields it cannot measure (GPUs per
node, InfiniBand) are kept from --base.  About 2 minutes on an H100.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from launch import OURS, bounded  # noqa: E402
from parallel3d.planning.hardware import get_cluster  # noqa: E402

GEMM_SHAPES = [  # (m, n, k): tokens x out x in of GPT layers at mbs 1-4, seq 2048, plus squares
    (8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048), (1024, 1024, 1024),
    (8192, 6144, 2048), (8192, 2048, 2048), (8192, 8192, 2048), (8192, 2048, 8192),
    (16384, 4096, 4096), (4096, 16384, 4096), (2048, 50304, 2048), (16384, 1024, 4096),
    # GPT-1.3B's own shapes at TP=2 (qkv, proj, proj's weight gradient, fc1) and its output layer
    (8192, 3072, 2048), (8192, 2048, 1024), (2048, 1024, 8192), (8192, 4096, 2048), (8192, 50304, 2048),
]
COLLECTIVE_MIB = 1024  # message size of the bandwidth measurement
LAYER_MIB = 32  # ... and of one GPT-1.3B activation (8192 tokens x 2048 x bf16): what a TP all-reduce moves
ADAM_PARAMS = 2 ** 27  # fp32 elements of the fused-AdamW measurement (2 GiB of param, grad, m, v)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: algorithm bandwidth x factor = bus bandwidth."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # p2p


def cluster_json(base: str, m: dict) -> dict:
    """The cluster file: --base with every measured field replaced (GEMM curve as its points)."""
    d = dataclasses.asdict(get_cluster(base))
    d["name"] = f"{base}-calibrated"
    d["gemm"] = {"peak_tflops": d["gemm"]["peak_tflops"], "points": m["gemm_points"],
                 "wgrad_factor": m.get("wgrad_factor", d["gemm"]["wgrad_factor"])}
    for key in ("copy_gbs", "attention_fwd_efficiency", "attention_bwd_efficiency", "intra_busbw_gbs",
                "intra_p2p_gbs", "memory_gib", "optimizer_gbs", "intra_latency_us", "host_layer_us"):
        if key in m:
            d[key] = m[key]
    d["notes"] = f"calibrated on {m.get('gpu', '?')} by bench/calibrate_planner.py; " + json.dumps(m.get("raw", {}))
    return d


def _time(fn, reps: int = 20, min_window_s: float = 0.0, inner: int = 1) -> float:
    """Median seconds of one fn() over reps, CUDA events, after 3 warm-up calls.

    Events around ONE call on an idle GPU also time the host's dispatch (~25 us in torch: the
    1024^3 GEMM read 69 TFLOP/s that way); with ``min_window_s`` each timed window runs fn back to
    back often enough to last that long, so the device time dominates.  Collectives pass a fixed
    ``inner`` instead: every rank must make the same number of calls.
    """
    import torch
    for _ in range(3):
        fn()
    if min_window_s > 0:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        inner = max(1, min(100, round(min_window_s / max(a.elapsed_time(b) / 1e3, 1e-6))))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(times)


def measure_adam() -> float:
    """Fused AdamW (what parallel3d's optimizer runs on CUDA) in GB/s, counting 28 B per parameter."""
    import torch
    p = torch.zeros(ADAM_PARAMS, device="cuda", dtype=torch.float32, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    t = _time(opt.step, reps=10)
    del opt, p
    return 28 * ADAM_PARAMS / t / 1e9


def measure_local(peak_tflops: float) -> dict:
    import torch
    import torch.nn.functional as F
    dev = torch.device("cuda")
    out: dict = {"gpu": torch.cuda.get_device_name(), "raw": {},
                 "memory_gib": torch.cuda.get_device_properties(dev).total_memory / 2 ** 30}
    points = []
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        t = _time(lambda: a @ b, min_window_s=2e-3)
        points.append([m, n, k, 2 * m * n * k / t / 1e12])
        del a, b
    out["gemm_points"] = points
    # Weight gradient into an fp32 main_grad as training runs it (parallel3d.fused.wgrad_accumulate: the
    # fused kernel where built, else the GEMM and an add).
    from parallel3d.fused import wgrad_accumulate
    x = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    main = torch.zeros(4096, 4096, device=dev, dtype=torch.float32)
    plain = _time(lambda: g.t() @ x, min_window_s=2e-3)
    accum = _time(lambda: wgrad_accumulate(x, g, main), min_window_s=2e-3)
    out["wgrad_factor"] = min(1.0, plain / accum)
    src = torch.empty(2 ** 29, device=dev, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    out["copy_gbs"] = 2 * src.numel() * 2 / _time(lambda: dst.copy_(src)) / 1e9
    del src, dst, x, g, main
    b, h, s, d = 4, 16, 2048, 128
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    # Back to back (min_window_s), as the GEMMs: one timed call would also time the host's dispatch,
    # autograd's above all, and priced attention 1.5x what training's kernels took (BENCHMARKS.md).
    fwd = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), min_window_s=2e-3)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dy = torch.randn_like(o)
    bwd = _time(lambda: torch.autograd.grad(o, (q, k, v), dy, retain_graph=True), min_window_s=2e-3)
    flops = 4 * b * h * s * s * d / 2
    out["attention_fwd_efficiency"] = flops / fwd / (peak_tflops * 1e12)
    out["attention_bwd_efficiency"] = 2.5 * flops / bwd / (peak_tflops * 1e12)
    out["optimizer_gbs"] = measure_adam()
    out["raw"].update({"sdpa_fwd_ms": fwd * 1e3, "sdpa_bwd_ms": bwd * 1e3, "wgrad_plain_ms": plain * 1e3,
                       "wgrad_accumulate_ms": accum * 1e3})
    return out


def measure_collectives(path: str) -> None:
    """Run under torchrun: every rank takes part; rank 0 writes {op: bus GB/s} to ``path``."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    numel = COLLECTIVE_MIB * 2 ** 20 // 2
    buf = torch.ones(numel, device="cuda", dtype=torch.bfloat16)
    shard = torch.empty(numel // n, device="cuda", dtype=torch.bfloat16)
    ops = {"all_reduce": lambda: dist.all_reduce(buf),
           "all_gather": lambda: dist.all_gather_into_tensor(buf, shard),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, buf)}
    result = {}
    for name, fn in ops.items():
        dist.barrier()
        result[name] = buf.numel() * 2 / _time(fn, reps=10) * bus_factor(name, n) / 1e9
    # At one activation's size the ring's per-step cost shows (latency, protocol, fewer channels):
    # fitted as the per-step latency that makes the ring formula match, bandwidth from above.
    small = buf[: LAYER_MIB * 2 ** 20 // 2]
    t_small = _time(lambda: dist.all_reduce(small), reps=10, inner=10)
    bw_term = bus_factor("all_reduce", n) * small.numel() * 2 / (result["all_reduce"] * 1e9)
    result["all_reduce_layer_ms"] = t_small * 1e3
    result["latency_us"] = max(1.0, (t_small - bw_term) / (2 * (n - 1)) * 1e6)
    if n >= 2 and rank < 2:  # one direction, rank 0 -> rank 1, as the pipeline sends
        peer = 1 - rank
        fn = (lambda: dist.send(buf, peer)) if rank == 0 else (lambda: dist.recv(buf, peer))
        result["p2p"] = buf.numel() * 2 / _time(fn, reps=10) / 1e9
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# The host's share is a count of launches, not of FLOPs: a short sequence and micro-batch 1 keep the GPU ahead
# of the host, so the host's time to return from forward and backward is its launch time alone
HOST_MODEL = ("--preset", "gpt-1.3b", "--seq-length", "512", "--micro-batch-size", "1", "--global-batch-size", "4")
HOST_LAYERS = (2, 6)


def host_fwd_bwd_ms(layers: int, timeout: int, model: tuple[str, ...] = HOST_MODEL) -> tuple[float, int]:
    """(the host's milliseconds to return from one step's forward and backward, micro-batches per step) of a
    one-GPU ``gpt_bench.py --host-time`` run of ``model`` with ``layers`` layers."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "host.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", OURS, *model,
               "--num-layers", str(layers), "--host-time", "--iters", "2", "--warmup", "2", "--json-out", out]
        code = bounded(cmd, timeout)
        if code != 0:
            raise subprocess.SubprocessError("timed out" if code is None else f"exit code {code}")
        with open(out) as f:
            result = json.loads(f.read().splitlines()[-1])
    return result["host_fwd_bwd_ms"], result["num_microbatches"]


def measure_host_layer_us(timeout: int, run=host_fwd_bwd_ms) -> float:
    """ClusterSpec.host_layer_us on this machine: the host's time to launch one layer's forward and backward for
    one micro-batch. Runs of HOST_LAYERS layers; the difference per layer and micro-batch, so the embedding's,
    the loss's and the optimizer's launches cancel."""
    (few, microbatches), (many, _) = (run(layers, timeout) for layers in HOST_LAYERS)
    return (many - few) * 1e3 / ((HOST_LAYERS[1] - HOST_LAYERS[0]) * microbatches)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="h100-sxm", help="preset whose unmeasured fields are kept")
    p.add_argument("--out", default="planner_cluster.json")
    p.add_argument("--nproc", type=int, default=2, help="GPUs for the NCCL measurements (1: skip them)")
    p.add_argument("--timeout", type=int, default=240, help="seconds for the torchrun of the collectives")
    p.add_argument("--collectives-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.collectives_worker:
        from parallel3d.lifetime import exit_with_launcher

        exit_with_launcher()  # a worker must not outlive a killed torchrun (parallel3d/lifetime.py)
        measure_collectives(args.collectives_worker)
        return 0
    measured = measure_local(get_cluster(args.base).gemm.peak_tflops)
    if args.nproc >= 2:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "collectives.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   os.path.abspath(__file__), "--collectives-worker", path]
            try:
                code = bounded(cmd, args.timeout)
                if code != 0:
                    raise subprocess.SubprocessError("timed out" if code is None else f"exit code {code}")
                coll = json.load(open(path))
                measured["raw"]["collectives_gbs"] = coll
                measured["intra_busbw_gbs"] = coll["all_reduce"]
                measured["intra_latency_us"] = coll["latency_us"]
                if "p2p" in coll:
                    measured["intra_p2p_gbs"] = coll["p2p"]
            except (subprocess.SubprocessError, OSError, ValueError) as e:
                print(f"collectives not measured ({e}); keeping {args.base}'s link figures", file=sys.stderr)
    try:
        host_us = measure_host_layer_us(args.timeout)
        if host_us <= 0:
            raise ValueError(f"{host_us:.0f} us: more layers took no more host time")
        measured["host_layer_us"] = host_us
    except (subprocess.SubprocessError, OSError, ValueError, KeyError) as e:
        print(f"host time not measured ({e}); keeping {args.base}'s host_layer_us", file=sys.stderr)
    data = cluster_json(args.base, measured)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
    print(json.dumps({k: v for k, v in data.items() if k != "notes"}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
