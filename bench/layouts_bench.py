"""Multi-GPU layouts side by side with Megatron-Core, and the planner's prediction of each run.

    python3 bench/layouts_bench.py --runs 1gpu pp4-1f1b pp4-zb-v ... [--out DIR]   # on the GPU machine
    python3 bench/layouts_bench.py --report DIR/layouts_bench.json [...] --cluster-file FILE   # anywhere

Measuring: every run is one torchrun job of bench/gpt_bench.py (parallel3d) and, where Megatron-Core
has the layout, one of ../shared/anchors/megatron_gpt_bench.py with the same flags, in the same call;
each bounded by --timeout. Results go to DIR/layouts_bench.json (merged with an existing file).
Reporting: the tokens/s/GPU table with the ratio to Megatron-Core and to the 1-GPU run of the same
call, and the planner's step time and peak memory (of the last rank, the one gpt_bench reports)
against the measured ones. The planner is pure Python: predictions need no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "bench"), ROOT]

from gpt_bench import FP8_RECIPES  # noqa: E402
from launch import MEGATRON, OURS, iteration_time, run, tokens_per_gpu  # noqa: E402

from parallel3d.pipeline.registry import ZERO_BUBBLE  # noqa: E402

BREAKDOWN = ("span_ms", "gemm_ms", "attention_ms", "other_ms", "comm_ms", "comm_exposed_ms", "idle_ms")

GPT = ["--preset", "gpt-1.3b"]
PP4 = GPT + ["--pp", "4", "--global-batch-size", "64"]  # 16 microbatches: the bubble of 1F1B is 3/19
ZB = ZERO_BUBBLE
TP2 = GPT + ["--global-batch-size", "16", "--tp", "2", "--sequence-parallel"]
TP2_DP2 = GPT + ["--global-batch-size", "32", "--tp", "2", "--sequence-parallel", "--use-distributed-optimizer",
                 "--overlap-grad-reduce"]
SEVEN_B = ["--preset", "mlm-7.1b", "--num-layers", "16", "--global-batch-size", "16", "--tp", "4", "--sequence-parallel"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
PROFILE = ["--profile-overlap"]  # one more step, profiled after the timed ones: where the GPU time goes
TP2_NOSP = GPT + ["--global-batch-size", "16", "--tp", "2"]
LLAMA = ["--preset", "llama-1b", "--global-batch-size", "16"]
LLAMA_TP2_SP = LLAMA + ["--tp", "2", "--sequence-parallel"]
LLAMA_3B = ["--preset", "llama-3b", "--global-batch-size", "8"]  # single_gpu_bench's FP8_GLOBAL_BATCH
TP2_PP2_V2 = GPT + ["--global-batch-size", "32", "--tp", "2", "--pp", "2", "--vpp", "2", "--sequence-parallel"]
# name: (GPUs, flags both runners take, flags only parallel3d takes, run Megatron-Core too)
RUNS: dict[str, tuple[int, list[str], list[str], bool]] = {
    "1gpu": (1, GPT + ["--global-batch-size", "16"], [], True),
    "tp2-sp": (2, TP2, PROFILE, True),
    "tp2-pp2-v2-sp": (4, GPT + ["--global-batch-size", "32", "--tp", "2", "--pp", "2", "--vpp", "2",
                                "--sequence-parallel"], [], True),
    "pp2-dp2": (4, GPT + ["--global-batch-size", "32", "--pp", "2", "--use-distributed-optimizer",
                          "--overlap-grad-reduce"], [], True),
    "tp2-dp2": (4, TP2_DP2, PROFILE, True),
    "pp4-1f1b": (4, PP4, ["--schedule-timing"], True),
    "pp4-interleaved": (4, PP4 + ["--vpp", "2"], ["--schedule-timing"], True),
    **{f"pp4-{z}": (4, PP4, ["--pipeline-schedule", z, "--schedule-timing"], False) for z in ZB},
    "7b-tp4": (4, SEVEN_B, [], True),
    # TP communication (issue 26): without SP, the compute alone (collectives stubbed), and GEMMs that leave
    # SMs free (--sm-carveout) so a collective beside them runs at once instead of after them
    "tp2": (2, TP2_NOSP, [], False),
    "tp2-stub": (2, TP2_NOSP, ["--stub-tp-comm"], False),
    "llama-1gpu": (1, LLAMA, [], True),
    "llama-tp2-sp": (2, LLAMA + ["--tp", "2", "--sequence-parallel"], [], True),
    "llama-tp2": (2, LLAMA + ["--tp", "2"], [], False),
    "tp2-dp2-nosp": (4, [a for a in TP2_DP2 if a != "--sequence-parallel"], [], False),
    "tp2-pp2-v2": (4, [a for a in TP2_PP2_V2 if a != "--sequence-parallel"], [], False),
    "7b-tp4-nosp": (4, [a for a in SEVEN_B if a != "--sequence-parallel"], [], False),
    **{f"tp2{sp}-co{n}": (2, TP2 if sp else TP2_NOSP, ["--sm-carveout", str(n)], False)
       for sp in ("", "-sp") for n in (8, 16, 32)},
    "tp2-hp-co16": (2, TP2_NOSP, ["--sm-carveout", "16"], False),
    # is the TP step bound by the host's launches? More work per launch (a micro-batch of 8), fewer launches
    "tp2-sp-mbs8": (2, TP2 + ["--micro-batch-size", "8"], [], False),
    "1gpu-mbs8": (1, GPT + ["--global-batch-size", "16", "--micro-batch-size", "8"], [], False),
    "tp2-sp-compile": (2, TP2 + ["--compile"], [], False),
    # --enable-cuda-graph: the layers' launches replayed as graphs (the host-bound TP step's fix)
    "1gpu-graph": (1, GPT + ["--global-batch-size", "16", "--enable-cuda-graph"], [], False),
    "llama-1gpu-graph": (1, LLAMA + ["--enable-cuda-graph"], [], False),
    # the one-GPU rows profiled: where the step's idle time falls (profile_breakdown.top_gaps)
    "1gpu-profile": (1, GPT + ["--global-batch-size", "16"], PROFILE, False),
    "llama-1gpu-profile": (1, LLAMA, PROFILE, False),
    # the one-GPU step is power-bound (BENCHMARKS.md, thirteenth lease): do GEMM algorithms chosen by timing
    # (PyTorch's TunableOp, ENV below) beat cuBLAS's heuristic at the clock the step holds?
    "1gpu-tunableop": (1, GPT + ["--global-batch-size", "16"], [], False),
    "llama-1gpu-tunableop": (1, LLAMA, [], False),
    "tp2-sp-graph": (2, TP2 + ["--enable-cuda-graph"], PROFILE, False),
    "tp2-graph": (2, TP2_NOSP + ["--enable-cuda-graph"], PROFILE, False),
    "llama-tp2-sp-graph": (2, LLAMA + ["--tp", "2", "--sequence-parallel", "--enable-cuda-graph"], [], False),
    "tp2-sp-mbs8-graph": (2, TP2 + ["--micro-batch-size", "8", "--enable-cuda-graph"], [], False),
    "tp2-dp2-graph": (4, TP2_DP2 + ["--enable-cuda-graph"], [], False),
    "tp2-pp2-v2-sp-graph": (4, TP2_PP2_V2 + ["--enable-cuda-graph"], [], False),
    "7b-tp4-graph": (4, SEVEN_B + ["--enable-cuda-graph"], [], False),
    "tp2-co16-nc8": (2, TP2_NOSP, ["--sm-carveout", "16"], False),
    # Megatron's default dropout (0.1): eager, and replayed as graphs that register the RNG tracker's streams
    "tp2-sp-dropout": (2, TP2 + DROPOUT, [], False),
    "tp2-sp-graph-dropout": (2, TP2 + DROPOUT + ["--enable-cuda-graph"], [], False),
    # The SP all-gathers with graphs: the default (NCCL symmetric windows on the copy engines, symmetric_memory.py)
    # against the windows with NCCL's symmetric kernels ("-symm", NCCL_CTA_POLICY=0) and NCCL's own buffers
    # ("-plain"). Eager layers always take NCCL's own buffers (validate_args)
    **{f"{row}-{v}": (2, both, ours + (["--no-tp-symmetric-gathers"] if v == "plain" else []), False)
       for row, both, ours in (("tp2-sp-graph", TP2 + ["--enable-cuda-graph"], PROFILE),
                               ("llama-tp2-sp-graph", LLAMA_TP2_SP + ["--enable-cuda-graph"], []))
       for v in ("symm", "plain")},
    "tp2-sp-graph-hp": (2, TP2 + ["--enable-cuda-graph"], [], False),  # NCCL's stream at high priority
    # FP8 (issue 28) on one GPU, its step bound by the host: eager and with the layers replayed as graphs
    **{f"llama3b{name}{mbs}": (1, LLAMA_3B + flags + (["--micro-batch-size", "2"] if mbs else []), [], False)
       for name, flags in (("", []), ("-graph", ["--enable-cuda-graph"]), ("-fp8", FP8_RECIPES["tensorwise"]),
                           ("-fp8-graph", FP8_RECIPES["tensorwise"] + ["--enable-cuda-graph"]),
                           ("-fp8-rowwise", FP8_RECIPES["rowwise"]), ("-fp8-delayed", FP8_RECIPES["delayed"]),
                           ("-fp8-rowwise-graph", FP8_RECIPES["rowwise"] + ["--enable-cuda-graph"]),
                           ("-fp8-delayed-graph", FP8_RECIPES["delayed"] + ["--enable-cuda-graph"]))
       for mbs in ("", "-mbs2")},
}
# A row without --enable-cuda-graph measures the eager layers: parallel3d's default replays a TP run's layers
# as graphs (arguments.py, _cuda_graph_rules), which the "-graph" rows measure by name
RUNS = {name: (gpus, both, ours + ([] if "--enable-cuda-graph" in both + ours else ["--cuda-graph-impl", "none"]), peer)
        for name, (gpus, both, ours, peer) in RUNS.items()}
# parallel3d runs' extra environment: NCCL's stream at high priority, and (nc8) at most 8 channels, so its
# blocks fit in the SMs the GEMMs leave free
_NC8 = {"TORCH_NCCL_HIGH_PRIORITY": "1", "NCCL_MAX_NCHANNELS": "8"}
ENV = {"tp2-hp-co16": {"TORCH_NCCL_HIGH_PRIORITY": "1"}, "tp2-co16-nc8": _NC8,
       **{name: {"NCCL_CTA_POLICY": "0"} for name in RUNS if name.endswith("-symm")},
       "tp2-sp-graph-hp": {"TORCH_NCCL_HIGH_PRIORITY": "1"},
       **{name: {"PYTORCH_TUNABLEOP_ENABLED": "1", "PYTORCH_TUNABLEOP_TUNING": "1",
                 "PYTORCH_TUNABLEOP_FILENAME": f"/tmp/tunableop_{name}.csv"}
          for name in ("1gpu-tunableop", "llama-1gpu-tunableop")}}
# With MEGATRON_CDMC1=1, Megatron-Core's TP runs also with CUDA_DEVICE_MAX_CONNECTIONS=1 (its own setting for
# its overlap) and the table takes its faster run (unset was faster in both calls of BENCHMARKS.md's issue-26 section).
CDMC1 = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def measure(names: list[str], out: str, iters: int, warmup: int, timeout: int, peers: bool = True) -> dict:
    path = os.path.join(out, "layouts_bench.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    logs = os.path.join(out, "logs")
    for name in names:
        gpus, both, ours_only, peer = RUNS[name]
        common = both + ["--iters", str(iters), "--warmup", str(warmup)]
        trace = ["--trace-out", f"/tmp/trace_{name}.json"] if "--profile-overlap" in ours_only else []
        results[name] = {"ours": run(f"p3d_{name}", gpus, OURS, common + ours_only + trace, logs, timeout=timeout,
                                     env=ENV.get(name))}
        ours = results[name]["ours"] or {}
        if ours.get("span_ms"):
            print(f"profile {name}: " + ", ".join(f"{k} {ours[k]:.1f}" for k in BREAKDOWN))
        if ours.get("collective_profile"):
            print(f"collectives {name}: {json.dumps(ours['collective_profile'])}")
        if ours.get("top_gaps"):
            print(f"idle gaps {name}: {json.dumps(ours['top_gaps'])}")
        if peer and peers:
            runs = [run(f"megatron_{name}", gpus, MEGATRON, common, logs, timeout=timeout)]
            if "--tp" in common and os.environ.get("MEGATRON_CDMC1") == "1":
                runs.append(run(f"megatron_{name}_cdmc1", gpus, MEGATRON, common, logs, timeout=timeout, env=CDMC1))
            results[name]["megatron"] = max((r for r in runs if r), key=tokens_per_gpu, default=None)
        with open(path, "w") as f:  # after every run: a later timeout keeps what was measured
            json.dump(results, f, indent=1)
    return results


def predict(name: str, cluster) -> tuple[float, float]:
    """(step seconds, peak GiB of the last rank) the planner gives for this run."""
    import gpt_bench
    from parallel3d.planning import Layout, ModelSpec, estimate
    from parallel3d.training import gpt
    from parallel3d.planning.hardware import GIB

    gpus, both, ours_only, _ = RUNS[name]
    # The prediction is for the GPU machine the run measured, from any machine: the arguments' "needs a CUDA
    # device" rule (--enable-cuda-graph) is about the machine that trains, not this one
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        _, args = gpt_bench.bench_args(both + ours_only, world=gpus)
    model = ModelSpec.from_config(gpt.transformer_config_from_args(args))
    est = estimate(model, Layout.from_args(args), cluster)
    return est.step_time_s, est.memory[-1].peak / GIB


def report(results: dict, cluster) -> str:
    ones = {family: tokens_per_gpu(results.get(f"{family}1gpu", {}).get("ours")) for family in ("", "llama-")}
    lines = ["| run | parallel3d tokens/s/GPU | Megatron-Core | ratio | vs parallel3d 1 GPU | step measured / "
             "predicted | error | peak GiB measured / predicted | error |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ours, peer = r.get("ours"), r.get("megatron")
        if not ours:
            lines.append(f"| {name} | failed or timed out (see its log) | {tokens_per_gpu(peer):,.0f} | | | | | | |")
            continue
        tok = tokens_per_gpu(ours)
        ratio = f"{tok / tokens_per_gpu(peer):.3f}x" if peer else ""
        step, mem = predict(name, cluster) if cluster and name in RUNS else (float("nan"), float("nan"))
        ms, mm = iteration_time(ours), ours.get("peak_memory_gb") or float("nan")
        lines.append(f"| {name} | {tok:,.0f} | {tokens_per_gpu(peer):,.0f} | {ratio} | {tok / ones['llama-' if name.startswith('llama-') else '']:.1%} | "
                     f"{ms:.3f} / {step:.3f} s | {100 * (step / ms - 1):+.1f}% | {mm:.1f} / {mem:.1f} | "
                     f"{100 * (mem / mm - 1):+.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=[])
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=150, help="seconds per torchrun job before it is killed")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    p.add_argument("--report", nargs="*", default=None, help="layouts_bench.json files to tabulate (merged)")
    p.add_argument("--cluster-file", default=None, help="planner cluster (bench/calibrate_planner.py)")
    p.add_argument("--no-peer", action="store_true", help="parallel3d's runs only (an A/B of our own code)")
    a = p.parse_args(argv)
    if a.report is None:
        measure(a.runs, a.out, a.iters, a.warmup, a.timeout, peers=not a.no_peer)
        a.report = [os.path.join(a.out, "layouts_bench.json")]
    results: dict = {}
    for path in a.report:
        results.update(json.load(open(path)))
    cluster = None
    if a.cluster_file:
        from parallel3d.planning import load_cluster
        cluster = load_cluster(a.cluster_file)
    print(report(results, cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
