"""The link's limit for tensor parallelism: all-gather, reduce-scatter and all-reduce at the sizes TP uses.

    torchrun --standalone --nproc-per-node 2 bench/nccl_bench.py [--sizes-mib 4 8 16 32 64] [--json-out F]

Each collective is timed alone (CUDA events, median of --iters after --warmup) and again while a bf16
GEMM runs on another stream of the same GPU ("beside a GEMM"): what a collective overlapped with compute
gets. Bus bandwidth as nccl-tests defines it, from the per-rank size S (the all-gather's output, the
reduce-scatter's input, the all-reduce's buffer) on n ranks: all-gather and reduce-scatter S (n-1)/n / t,
all-reduce 2 S (n-1)/n / t. BENCHMARKS.md prints these beside every TP figure as the physical column.

``--symmetric`` adds the all-gather and reduce-scatter with their buffers in NCCL symmetric windows (torch's
``symm_mem``, NCCL backend), alone, beside a GEMM, and replayed from a CUDA graph as training's graphs
would. With ``NCCL_CTA_POLICY=2`` (the zero-CTA policy, NCCL >= 2.28) NCCL runs such an all-gather on the
copy engines, which run beside a cuBLAS GEMM where no NCCL kernel can (issue 26):

    NCCL_CTA_POLICY=2 torchrun --standalone --nproc-per-node 2 bench/nccl_bench.py --symmetric --sizes-mib 16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from calibrate_planner import bus_factor  # noqa: E402
from parallel3d.collectives import all_gather_into_tensor, reduce_scatter_tensor  # noqa: E402


def time_ms(fn, iters: int, warmup: int, beside=None) -> float:
    """Median milliseconds of ``fn`` (on the current stream); ``beside`` runs on another stream meanwhile."""
    side = torch.cuda.Stream()
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if beside is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                beside()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def sm_carveout(count) -> None:
    """Leave ``count`` SMs free in every later GEMM (None: use them all). torch applies the carveout only on its
    cuBLASLt path: its default cuBLAS path ignores it (a kernel beside an 8192^3 GEMM "leaving 66 SMs free"
    still waited for the whole GEMM; BENCHMARKS.md, issue 26's third lease), so a carveout also routes every
    GEMM through cuBLASLt (``torch.backends.cuda.preferred_blas_library``), for the rest of the process."""
    if count is not None:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(count)


def graphed(fn):
    """``fn`` captured once in a CUDA graph (after one eager run, which sets NCCL up); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def emit_result(rows, json_out) -> None:
    """The results as the RESULT_JSON line the bench drivers read, and to ``json_out`` where given."""
    print("RESULT_JSON: " + json.dumps(rows))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rows, f, indent=1)


def collective_row(op: str, mib: float, where: str, ms: float, numel: int, n: int) -> dict:
    """One result: ``op`` ("all_gather ...") of ``numel`` bf16 elements (the per-rank size S) took ``ms``."""
    busbw = numel * 2 / (ms * 1e-3) * bus_factor(op.split()[0], n) / 1e9
    return {"op": op, "size_mib": mib, "where": where, "ms": ms, "busbw_gbs": busbw, "ranks": n}


def symmetric_rows(mib: float, numel: int, n: int, gemm, iters: int, warmup: int) -> list[dict]:
    """The all-gather and reduce-scatter of ``numel`` bf16 elements on symmetric-window buffers: alone, beside
    a GEMM, and (the all-gather) replayed from a CUDA graph; each all-gather checked against the plain one."""
    from parallel3d.symmetric_memory import SymmetricBuffers

    windows = SymmetricBuffers(dist.group.WORLD)  # the training's allocation and registration
    full = windows.get((numel,), torch.bfloat16, torch.device("cuda", torch.cuda.current_device())).normal_()
    shard = full[dist.get_rank() * (numel // n):(dist.get_rank() + 1) * (numel // n)]  # in place, as training
    own_window = windows.get((numel // n,), torch.bfloat16, full.device).normal_()
    reference = torch.empty_like(full)
    plain_shard = torch.empty_like(shard, memory_format=torch.contiguous_format).normal_()
    # Each on NCCL's stream, waited for, as training issues them: a synchronous collective runs on the
    # caller's stream (torch >= 2.8), the legacy default stream here, which the copy-engine path's
    # cuMemcpyBatchAsync rejects (the "invalid argument" of this bench's first runs, 2 x H200)
    ops = {
        "all_gather": lambda: all_gather_into_tensor(full, shard, async_op=True).wait(),
        # the input in a window of its own
        "all_gather 2win": lambda: all_gather_into_tensor(full, own_window, async_op=True).wait(),
        # the output alone in a window (the input an ordinary tensor)
        "all_gather out": lambda: all_gather_into_tensor(full, plain_shard, async_op=True).wait(),
        "reduce_scatter": lambda: reduce_scatter_tensor(plain_shard, full, async_op=True).wait(),
    }
    inputs = {"all_gather": shard, "all_gather 2win": own_window, "all_gather out": plain_shard}
    rows = []

    def measure(name, fn):
        for where, beside in (("symmetric, alone", None), ("symmetric, beside GEMM", gemm)):
            row = collective_row(name, mib, where, time_ms(fn, iters, warmup, beside), numel, n)
            if name.startswith("all_gather"):
                source = inputs[name.replace(" graph", "")]
                expected = source.clone()
                all_gather_into_tensor(reference, expected)
                full.zero_()
                source.copy_(expected)  # the in-place shard is part of the zeroed output
                fn()
                row["equal"] = bool(torch.equal(full, reference))
            rows.append(row)

    # each made when its turn comes, the graph last: a failed capture leaves the eager rows measured
    makers = [(name, lambda fn=fn: fn) for name, fn in ops.items()]
    makers.append(("all_gather graph", lambda: graphed(ops["all_gather"])))
    for name, make in makers:
        try:
            measure(name, make())
        except Exception as e:  # noqa: BLE001 - reported as the row's result
            rows.append({"op": name, "size_mib": mib, "where": "symmetric", "error": str(e)[:300]})
    windows.release()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json-out", default=None)
    p.add_argument("--carveouts", type=int, nargs="*", default=[],
                   help="also time each collective beside a GEMM that leaves this many SMs free "
                        "(sm_carveout: through cuBLASLt), and the GEMM alone with it")
    p.add_argument("--symmetric", action="store_true",
                   help="also the all-gather and reduce-scatter on buffers in NCCL symmetric windows, and the "
                        "all-gather replayed from a CUDA graph (the copy-engine path with NCCL_CTA_POLICY=2)")
    a = p.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, n = dist.get_rank(), dist.get_world_size()
    if a.symmetric:  # (SymmetricBuffers sets torch's NCCL backend for symmetric memory)
        dist.barrier()  # the communicator must exist before the first rendezvous (as in torch's FSDP)
    gemm_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    if a.carveouts:  # every GEMM on the path the carveouts need, the baseline included
        torch.backends.cuda.preferred_blas_library("cublaslt")

    def gemm():  # a few ms of tensor-core work, longer than any collective timed here
        for _ in range(4):
            gemm_a @ gemm_a

    rows = []
    for co in [None] + a.carveouts:  # the GEMM alone: what a carveout costs it
        sm_carveout(co)
        ms = time_ms(gemm, a.iters, a.warmup) / 4
        rows.append({"op": "gemm 8192^3", "size_mib": 0, "where": f"{co or 0} SMs free", "ms": ms,
                     "busbw_gbs": 2 * 8192 ** 3 / (ms * 1e-3) / 1e12, "ranks": n})
    sm_carveout(None)

    def beside_with(co):
        def run():
            sm_carveout(co)
            gemm()
            sm_carveout(None)
        return run

    for mib in a.sizes_mib:
        numel = int(mib * 2 ** 20) // 2 // n * n  # bf16 elements of S, divisible by n
        full = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        shard = torch.randn(numel // n, device="cuda", dtype=torch.bfloat16)
        ops = {
            "all_gather": lambda: all_gather_into_tensor(full, shard),
            "reduce_scatter": lambda: reduce_scatter_tensor(shard, full),
            "all_reduce": lambda: dist.all_reduce(full),
        }
        for name, fn in ops.items():
            besides = [("alone", None), ("beside a GEMM", gemm)]
            besides += [(f"beside, {co} SMs free", beside_with(co)) for co in a.carveouts]
            for where, beside in besides:
                rows.append(collective_row(name, mib, where, time_ms(fn, a.iters, a.warmup, beside), numel, n))
        if a.symmetric:
            rows += symmetric_rows(mib, numel, n, gemm, a.iters, a.warmup)
    if rank == 0:
        print(f"{'op':15s} {'MiB':>6s} {'where':22s} {'ms':>8s} {'busbw GB/s':>10s}   ({n} ranks, "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"NCCL_CTA_POLICY={os.environ.get('NCCL_CTA_POLICY', 'unset')})")
        for r in rows:
            if "error" in r:
                print(f"{r['op']:15s} {r['size_mib']:6.1f} {r['where']:22s} failed: {r['error']}")
                continue
            print(f"{r['op']:15s} {r['size_mib']:6.1f} {r['where']:22s} {r['ms']:8.3f} {r['busbw_gbs']:10.1f}"
                  + ("" if r.get("equal", True) else "   DIFFERS from the plain all-gather"))
        emit_result(rows, a.json_out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel3d.lifetime import exit_with_launcher

    exit_with_launcher()  # a worker must not outlive a killed torchrun (parallel3d/lifetime.py)
    main()
