"""Pipeline schedules on PP=2: step time, measured bubble vs the simulator's prediction, vs Megatron-Core.

    python3 bench/pipeline_bench.py [--preset gpt-1.3b] [--out DIR]

Every forward and backward of the schedule is timed with CUDA events; the
simulator is then given those per-stage times and predicts the step's makespan
and bubble, which are compared with what was measured.
"""
from __future__ import annotations

import argparse
import json
import os

from launch import MEGATRON, OURS, iteration_time, run, tokens_per_gpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--global-batch-size", default="32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    a = p.parse_args()
    common = ["--preset", a.preset, "--iters", str(a.iters), "--warmup", str(a.warmup), "--pp", "2",
              "--global-batch-size", a.global_batch_size]
    logs = os.path.join(a.out, "logs")
    r = {
        "gpipe": run("p3d_pp2_gpipe", 2, OURS, common + ["--schedule", "gpipe", "--schedule-timing"], logs),
        "1f1b": run("p3d_pp2_1f1b", 2, OURS, common + ["--schedule-timing"], logs),
        "interleaved-1f1b V=2": run("p3d_pp2_interleaved", 2, OURS, common + ["--vpp", "2", "--schedule-timing"],
                                    logs),
        "megatron 1f1b": run("megatron_pp2_1f1b", 2, MEGATRON, common, logs),
        "megatron interleaved V=2": run("megatron_pp2_interleaved", 2, MEGATRON, common + ["--vpp", "2"], logs),
    }
    print("\n| schedule | step (s) | tokens/s/GPU | vs Megatron-Core | bubble measured | bubble predicted | "
          "makespan measured / predicted (s) | (P-1)/(V*M) | peak memory (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, res in r.items():
        if name.startswith("megatron") or res is None:
            continue
        peer = r["megatron interleaved V=2" if "interleaved" in name else "megatron 1f1b"]
        vs = f"{tokens_per_gpu(res) / tokens_per_gpu(peer):.3f}x" if peer and name != "gpipe" else ""
        print(f"| {name} | {iteration_time(res):.3f} | {tokens_per_gpu(res):,.0f} | {vs} | "
              f"{res['measured_bubble_overhead']:.3f} | {res['predicted_bubble_overhead']:.3f} | "
              f"{res['measured_schedule_makespan_s']:.3f} / {res['predicted_makespan_s']:.3f} | "
              f"{res['formula_bubble_overhead']:.3f} | {res.get('peak_memory_gb') or float('nan'):.1f} |")
    for name in ("megatron 1f1b", "megatron interleaved V=2"):
        if r[name]:
            print(f"| {name} | {iteration_time(r[name]):.3f} | {tokens_per_gpu(r[name]):,.0f} | | | | | | "
                  f"{r[name].get('max_mem_allocated_gib', float('nan')):.1f} |")
    with open(os.path.join(a.out, "pipeline_bench.json"), "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
