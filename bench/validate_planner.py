"""Predicted against measured step time and peak memory of GPT-1.3B on 1 and 2 GPUs.

    python3 bench/validate_planner.py --cluster-file planner_cluster.json [--batches 16 32] [--out table.md]

Runs bench/gpt_bench.py (--preset gpt-1.3b, micro-batch 4, bf16) under torchrun for the layouts
1 GPU, DP=2, TP=2, PP=2 and PP=2 V=2, each bounded by BENCH_TIMEOUT (default 300 s), and prints a
markdown table.  The prediction is of the same quantities gpt_bench reports: the median step time
and torch.cuda.max_memory_allocated() of the LAST rank (the one that prints RESULT_JSON), i.e.
the last pipeline stage.  About 10 runs x ~1 minute; --layouts picks a subset.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from parallel3d.planning import Layout, ModelSpec, estimate, get_cluster, load_cluster  # noqa: E402
from parallel3d.planning.hardware import GIB, ClusterSpec  # noqa: E402

# name: (GPUs, gpt_bench arguments, TP, PP, virtual stages)
LAYOUTS = {
    "1gpu": (1, [], 1, 1, 1),
    "dp2": (2, [], 1, 1, 1),
    "tp2": (2, ["--tp", "2"], 2, 1, 1),
    "pp2": (2, ["--pp", "2"], 1, 2, 1),
    "pp2-v2": (2, ["--pp", "2", "--vpp", "2"], 1, 2, 2),
}
# bench/gpt_bench.py's gpt-1.3b preset (dropout 0, learned positions, LayerNorm, tied embeddings).
GPT_1_3B = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257)
MICRO_BATCH = 4


def predict(name: str, global_batch: int, cluster: ClusterSpec) -> tuple[float, float]:
    """(step seconds, peak GiB of the last rank) that gpt_bench should report for this run."""
    gpus, _, tp, pp, v = LAYOUTS[name]
    per_stage = GPT_1_3B.num_layers // pp
    layout = Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    num_layers_per_virtual_pipeline_stage=per_stage // v if v > 1 else None,
                    data_parallel_size=gpus // (tp * pp), micro_batch_size=MICRO_BATCH, global_batch_size=global_batch)
    est = estimate(GPT_1_3B, layout, cluster)
    return est.step_time_s, est.memory[-1].peak / GIB


def table(rows: list[tuple[str, int, dict | None, float, float]]) -> str:
    """Markdown: one row per (layout, batch) with measured, predicted and the error of each."""
    lines = ["| layout | global batch | step measured | step predicted | error | peak GiB measured | "
             "peak GiB predicted | error |", "|---|---|---|---|---|---|---|---|"]
    for name, batch, result, step, mem in rows:
        if not result:
            lines.append(f"| {name} | {batch} | no result | {step:.3f} s | | | {mem:.1f} | |")
            continue
        ms, mm = float(result["iteration_time_s"]), result.get("peak_memory_gb")
        mem_cells = (f"{mm:.1f} | {mem:.1f} | {100 * (mem / mm - 1):+.1f}%" if mm else f"- | {mem:.1f} | ")
        lines.append(f"| {name} | {batch} | {ms:.3f} s | {step:.3f} s | {100 * (step / ms - 1):+.1f}% | {mem_cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="h100-sxm")
    p.add_argument("--cluster-file", default=None, help="from bench/calibrate_planner.py (recommended)")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--log-dir", default=os.path.join(ROOT, "bench_logs", "validate_planner"))
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--dry-run", action="store_true", help="print the predictions only (no GPU needed)")
    args = p.parse_args(argv)
    cluster = load_cluster(args.cluster_file) if args.cluster_file else get_cluster(args.cluster)
    rows = []
    for name in args.layouts:
        gpus, extra, *_ = LAYOUTS[name]
        for batch in args.batches:
            step, mem = predict(name, batch, cluster)
            result = None
            if not args.dry_run:
                import launch

                bench_args = ["--preset", "gpt-1.3b", "--global-batch-size", str(batch), "--iters", str(args.iters),
                              "--warmup", "2"] + extra
                result = launch.run(f"{name}-gbs{batch}", gpus, launch.OURS, bench_args, args.log_dir)
            rows.append((name, batch, result, step, mem))
    text = f"cluster: {cluster.name}\n\n" + table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
