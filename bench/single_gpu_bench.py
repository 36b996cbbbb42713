"""One GPU, one preset: Megatron-Core against parallel3d with and without the fused kernels.

    python3 bench/single_gpu_bench.py [--preset llama-1b] [--out DIR]

Each run is ``gpt_bench.py`` (or the Megatron-Core anchor) under torchrun with the same arguments:
micro-batch 4, 4 microbatches per step. The unfused run sets PARALLEL3D_DISABLE_FUSION=1, so the
difference between the two parallel3d runs is what csrc/ is worth end to end.
"""
from __future__ import annotations

import argparse
import json
import os

from launch import MEGATRON, OURS, iteration_time, run, tokens_per_gpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    a = p.parse_args()
    common = ["--preset", a.preset, "--iters", str(a.iters), "--warmup", str(a.warmup), "--global-batch-size", "16"]
    logs = os.path.join(a.out, "logs")
    r = {
        "megatron": run(f"megatron_{a.preset}", 1, MEGATRON, common, logs),
        "parallel3d fused": run(f"p3d_{a.preset}_fused", 1, OURS, common, logs),
    }
    os.environ["PARALLEL3D_DISABLE_FUSION"] = "1"  # inherited by the next torchrun
    r["parallel3d unfused"] = run(f"p3d_{a.preset}_unfused", 1, OURS, common, logs)
    base = tokens_per_gpu(r["megatron"])
    print(f"\n| {a.preset} run | step time | tokens/s/GPU | vs Megatron-Core |\n|---|---|---|---|")
    for name, res in r.items():
        print(f"| {name} | {iteration_time(res):.3f} s | {tokens_per_gpu(res):,.0f} | {tokens_per_gpu(res) / base:.3f}x |")
    with open(os.path.join(a.out, f"single_gpu_{a.preset}.json"), "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
