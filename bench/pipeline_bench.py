"""Pipeline schedules on PP=2: step time, measured bubble vs the simulator's prediction, vs Megatron-Core.

    python3 bench/pipeline_bench.py [--preset gpt-1.3b] [--schedules 1f1b,zb-v,...] [--splits even,balanced]
                                    [--timeout 300] [--out DIR]

Every forward, backward (B) and weight-gradient step (W) of the schedule is timed with CUDA
events; the simulator is then given those per-stage times and predicts the step's makespan and
bubble, which are compared with what was measured (with the simulator's default, sends that
never wait for their receiver, as NCCL runs them; and, for contrast, if every send waited).  Each schedule runs with the even
split (Megatron's default) and the cost-balanced one (ours, the default); Megatron-Core's 1F1B
and interleaved run in the same call.  Every run is one torchrun job bounded by --timeout.
"""
from __future__ import annotations

import argparse
import json
import os

from launch import MEGATRON, OURS, iteration_time, run, tokens_per_gpu

SCHEDULES = "1f1b,interleaved-1f1b,zb-h1,zb-h2,zb-v,dualpipev,auto"


def _row(name: str, res: dict, peer: dict | None) -> str:
    vs = f"{tokens_per_gpu(res) / tokens_per_gpu(peer):.3f}x" if peer else ""
    return (f"| {name} | {iteration_time(res):.3f} | {tokens_per_gpu(res):,.0f} | {vs} | "
            f"{res['measured_bubble_overhead']:.3f} | {res['predicted_bubble_overhead']:.3f} | "
            f"{res['measured_schedule_makespan_s']:.3f} / {res['predicted_makespan_s']:.3f} / "
            f"{res.get('predicted_makespan_blocking_sends_s', float('nan')):.3f} | "
            f"{res.get('peak_memory_gb') or float('nan'):.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--global-batch-size", default="32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--schedules", default=SCHEDULES, help=f"comma-separated (default {SCHEDULES})")
    p.add_argument("--splits", default="even,balanced", help="layer splits to run each schedule with")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run before it is killed and skipped")
    p.add_argument("--no-megatron", action="store_true", help="skip Megatron-Core's runs")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    a = p.parse_args()
    common = ["--preset", a.preset, "--iters", str(a.iters), "--warmup", str(a.warmup), "--pp", "2",
              "--global-batch-size", a.global_batch_size]
    logs = os.path.join(a.out, "logs")
    r: dict[str, dict | None] = {}
    # The peer first: a call cut short by its time limit still has the reference the table divides by.
    if not a.no_megatron:
        r["megatron 1f1b"] = run("megatron_pp2_1f1b", 2, MEGATRON, common, logs, timeout=a.timeout)
        r["megatron interleaved V=2"] = run("megatron_pp2_interleaved", 2, MEGATRON, common + ["--vpp", "2"], logs,
                                            timeout=a.timeout)
    for schedule in a.schedules.split(","):
        for split in a.splits.split(","):
            extra = ["--pipeline-schedule", schedule, "--pipeline-split", split, "--schedule-timing"]
            extra += ["--vpp", "2"] if schedule == "interleaved-1f1b" else []
            r[f"{schedule} {split}"] = run(f"p3d_pp2_{schedule}_{split}", 2, OURS, common + extra, logs,
                                           timeout=a.timeout)
    best_megatron = max((x for k, x in r.items() if k.startswith("megatron") and x), key=tokens_per_gpu, default=None)
    print("\n| schedule split | step (s) | tokens/s/GPU | vs Megatron-Core's best | bubble measured | bubble predicted "
          "| makespan measured / predicted / if sends blocked (s) | peak memory (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in r.items():
        if res is None:
            print(f"| {name} | failed or timed out: see {logs} | | | | | | |")
        elif not name.startswith("megatron"):
            print(_row(name, res, best_megatron))
    for name in ("megatron 1f1b", "megatron interleaved V=2"):
        if r.get(name):
            print(f"| {name} | {iteration_time(r[name]):.3f} | {tokens_per_gpu(r[name]):,.0f} | | | | | "
                  f"{r[name].get('max_mem_allocated_gib', float('nan')):.1f} |")
    with open(os.path.join(a.out, "pipeline_bench.json"), "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
