"""Data parallelism: weak scaling DP=1 -> DP=2 with and without overlap, bucket sizes, vs Megatron-Core.

    python3 bench/ddp_bench.py [--preset gpt-1.3b] [--buckets 10000000 40000000 200000000] [--out DIR]

Each GPU does the same work in every run (micro-batch 4, 4 microbatches per step), so
weak-scaling efficiency = tokens/s/GPU at DP=2 over DP=1. The overlapped run is also
profiled: the fraction of NCCL kernel time that ran beside compute kernels.
"""
from __future__ import annotations

import argparse
import json
import os

from launch import MEGATRON, OURS, run, tokens_per_gpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--buckets", type=int, nargs="*", default=[10_000_000, 200_000_000])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    a = p.parse_args()
    common = ["--preset", a.preset, "--iters", str(a.iters), "--warmup", str(a.warmup)]
    logs = os.path.join(a.out, "logs")
    r = {
        "megatron DP=1": run("megatron_dp1", 1, MEGATRON, common + ["--global-batch-size", "16"], logs),
        "parallel3d DP=1": run("p3d_dp1", 1, OURS, common + ["--global-batch-size", "16"], logs),
        "megatron DP=2 overlap": run("megatron_dp2_overlap", 2, MEGATRON,
                                     common + ["--global-batch-size", "32", "--overlap-grad-reduce"], logs),
        "parallel3d DP=2 overlap": run("p3d_dp2_overlap", 2, OURS, common + [
            "--global-batch-size", "32", "--overlap-grad-reduce", "--profile-overlap"], logs),
        "parallel3d DP=2 no overlap": run("p3d_dp2_no_overlap", 2, OURS, common + [
            "--global-batch-size", "32", "--profile-overlap"], logs),
    }
    for b in a.buckets:
        r[f"parallel3d DP=2 overlap, bucket {b / 1e6:g}M"] = run(
            f"p3d_dp2_overlap_bucket{b}", 2, OURS,
            common + ["--global-batch-size", "32", "--overlap-grad-reduce", "--ddp-bucket-size", str(b)], logs)

    base_ours, base_meg = tokens_per_gpu(r["parallel3d DP=1"]), tokens_per_gpu(r["megatron DP=1"])
    print("\n| run | tokens/s/GPU | weak-scaling efficiency | vs Megatron-Core (same layout) | NCCL time beside compute |")
    print("|---|---|---|---|---|")
    for name, res in r.items():
        tok = tokens_per_gpu(res)
        base = base_meg if name.startswith("megatron") else base_ours
        peer = r.get(name.replace("parallel3d", "megatron").split(",")[0].replace(" no overlap", " overlap"))
        vs = f"{tok / tokens_per_gpu(peer):.3f}x" if name.startswith("parallel3d") and peer else ""
        overlap = res.get("nccl_overlap_fraction") if res else None
        print(f"| {name} | {tok:,.0f} | {tok / base:.1%} | {vs} | {'' if overlap is None else f'{overlap:.0%}'} |")
    with open(os.path.join(a.out, "ddp_bench.json"), "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
