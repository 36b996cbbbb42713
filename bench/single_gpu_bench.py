"""One GPU per preset: parallel3d against its peers, same card, same call (bf16 peers, or --fp8's suite).

Default: Megatron-Core, plain PyTorch (eager and torch.compile) and, for the llama presets, torchtitan
(its Trainer, torch.compile) against parallel3d with and without the fused kernels, and with --compile
(each layer through torch.compile).

    python3 bench/single_gpu_bench.py [--preset llama-1b] [--out DIR]
    python3 bench/single_gpu_bench.py --fp8 [--presets PRESET ...] [--gpus N] [--budget-s S] [--out DIR]
    python3 bench/single_gpu_bench.py --fp8 --report A/fp8_bench.json B/fp8_bench.json   # one table of several calls

Each run is ``gpt_bench.py`` (or a peer's anchor) under torchrun with the same model and batch:
micro-batch 4, 4 microbatches per step (the plain runner's ``--grad-accum 4``). The unfused run sets
PARALLEL3D_DISABLE_FUSION=1, so the difference between the two parallel3d runs is what csrc/ is worth
end to end. Ratios are to the fastest peer.

``--fp8``: per preset, parallel3d in bf16 and in FP8 with each recipe of ``gpt_bench.FP8_RECIPES``
(Megatron's ``--fp8-format``/``--fp8-recipe`` flags), the bf16 peer (plain PyTorch + torch.compile)
and, for the llama presets, torchtitan's float8 (tensorwise and rowwise, torch.compile). Global batch
``FP8_GLOBAL_BATCH`` of the preset's micro-batch. Ratios: to parallel3d bf16 of the same preset, and to
the peer of the same precision (torchtitan float8 of the same recipe; plain + compile for bf16). Each
run is bounded by ``--timeout``; the whole suite by ``--budget-s``, after which the remaining runs are
listed as skipped, in priority order (the runs the goals compare come first). Results (and each run's
peer) go to OUT/fp8_bench.json after every run, the table to stdout at the end. ``--fp8-without NAME ...``:
after the first recipe's run, that recipe without each named speed-up (``gpt_bench.py --fp8-disable``),
its "vs the peer" ratio taken to the run with all of them.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Optional

from gpu_clocks import visible_gpus
from launch import MEGATRON, OURS, PLAIN, TITAN, TITAN_WHEELS, iteration_time, run, tokens_per_gpu

FP8_GLOBAL_BATCH = {"tiny": 4, "gpt-1.3b": 16, "llama-1b": 16, "llama-3b": 8}
COMPILE_TIMEOUT = 300  # torch.compile runs: compilation comes first
EAGER_TIMEOUT = 180


def peak_gib(res: Optional[dict]) -> float:
    return (res or {}).get("peak_memory_gb") or (res or {}).get("max_mem_allocated_gib") or float("nan")


def bf16_peers(a: argparse.Namespace) -> None:
    steps = ["--iters", str(a.iters), "--warmup", str(a.warmup)]
    common = ["--preset", a.preset, "--global-batch-size", "16"] + steps
    plain = ["--preset", a.preset, "--grad-accum", "4"] + steps
    logs = os.path.join(a.out, "logs")
    r = {
        "megatron": run(f"megatron_{a.preset}", 1, MEGATRON, common, logs),
        "plain PyTorch eager": run(f"plain_{a.preset}", 1, PLAIN, plain, logs),
        "plain PyTorch + torch.compile": run(f"plain_{a.preset}_compile", 1, PLAIN, plain + ["--compile"], logs),
    }
    if a.preset.startswith("llama"):  # torchtitan's model is Llama-3 only (bench/titan_spec.py)
        if TITAN is None:
            print(f"torchtitan: no wheels in {TITAN_WHEELS} (bench/fetch_titan_wheels.sh), skipped", flush=True)
        r["torchtitan + torch.compile"] = run(f"titan_{a.preset}_compile", 1, TITAN, ["--preset", a.preset] + steps,
                                              logs) if TITAN else None
    r |= {
        "parallel3d fused": run(f"p3d_{a.preset}_fused", 1, OURS, common, logs),
        "parallel3d fused, --compile": run(f"p3d_{a.preset}_compile", 1, OURS, common + ["--compile"], logs),
    }
    os.environ["PARALLEL3D_DISABLE_FUSION"] = "1"  # inherited by the next torchrun
    r["parallel3d unfused"] = run(f"p3d_{a.preset}_unfused", 1, OURS, common, logs)
    base = max((tokens_per_gpu(res) for name, res in r.items() if res and "parallel3d" not in name), default=float("nan"))
    print(f"\n| {a.preset} run | step time | tokens/s/GPU | peak GiB | vs the fastest peer |\n|---|---|---|---|---|")
    for name, res in r.items():
        print(f"| {name} | {iteration_time(res):.3f} s | {tokens_per_gpu(res):,.0f} | {peak_gib(res):.1f} | "
              f"{tokens_per_gpu(res) / base:.3f}x |")
    with open(os.path.join(a.out, f"single_gpu_{a.preset}.json"), "w") as f:
        json.dump(r, f, indent=1)


# ------------------------------------------------------------------------------------------ FP8 suite

def plain_flags(preset: str) -> list[str]:
    """gpt_bench's preset in plain_gpt_bench.py's flags, so both build the same shape from one definition."""
    from gpt_bench import PRESETS

    switches = {"--swiglu": "--swiglu", "--disable-bias-linear": "--no-bias",
                "--untie-embeddings-and-output-weights": "--untie-embeddings", "--group-query-attention": None}
    valued = {("--normalization", "RMSNorm"): "--rmsnorm", ("--position-embedding-type", "rope"): "--rope"}
    flags, argv, i = [], PRESETS[preset], 0
    while i < len(argv):
        if argv[i] in switches:
            flags += [switches[argv[i]]] if switches[argv[i]] else []
            i += 1
        elif (argv[i], argv[i + 1]) in valued:
            flags.append(valued[argv[i], argv[i + 1]])
            i += 2
        else:  # --num-layers, --hidden-size, ...: the same name in both runners
            flags += argv[i:i + 2]
            i += 2
    return flags


def fp8_runs(preset: str, a: argparse.Namespace) -> list[tuple[str, str, Optional[str], list[str], int]]:
    """(label, peer label, script, arguments, timeout) of one preset, most important first."""
    from gpt_bench import FP8_RECIPES, PRESETS

    argv = PRESETS[preset]
    micro = int(argv[argv.index("--micro-batch-size") + 1])
    gbs = FP8_GLOBAL_BATCH[preset]
    steps = ["--iters", str(a.iters), "--warmup", str(a.warmup)]
    ours = ["--preset", preset, "--global-batch-size", str(gbs)] + steps
    titan = ["--preset", preset, "--grad-accum", str(gbs // micro)] + steps + (["--cpu-smoke"] if a.cpu_smoke else [])
    plain = plain_flags(preset) + ["--grad-accum", str(gbs // micro)] + steps \
        + (["--cpu-smoke"] if a.cpu_smoke else ["--compile"])
    llama = preset.startswith("llama") or a.cpu_smoke  # torchtitan builds Llama-3 models only (its smoke: tiny)
    bf16_peer = ("plain PyTorch + torch.compile", "", PLAIN, plain, COMPILE_TIMEOUT)
    runs = [("parallel3d bf16", bf16_peer[0], OURS, ours, EAGER_TIMEOUT)]
    for i, recipe in enumerate(a.recipes):
        runs.append((f"parallel3d FP8 {recipe}", f"torchtitan float8 {recipe}", OURS, ours + FP8_RECIPES[recipe],
                     EAGER_TIMEOUT))
        for name in a.fp8_without if i == 0 else ():  # each speed-up's worth: its "vs the peer" is the run with all
            runs.append((f"parallel3d FP8 {recipe} without {name}", f"parallel3d FP8 {recipe}", OURS,
                         ours + FP8_RECIPES[recipe] + ["--fp8-disable", name], EAGER_TIMEOUT))
        if llama and recipe in ("tensorwise", "rowwise"):  # torchao's recipes of those names
            runs.append((f"torchtitan float8 {recipe}", "", TITAN, titan + ["--float8", recipe], COMPILE_TIMEOUT))
        if i == 0:  # the bf16 peer after the first recipe's pair: each goal's comparison before the rest
            runs.append(bf16_peer)
    if not a.recipes:
        runs.append(bf16_peer)
    if llama and a.titan_bf16:
        runs.append(("torchtitan bf16", "", TITAN, titan, COMPILE_TIMEOUT))
    return runs


def fp8_table(results: dict, peers: dict) -> str:
    lines = ["| preset | run | step time | tokens/s/GPU | peak GiB | vs parallel3d bf16 | vs the peer |",
             "|---|---|---|---|---|---|---|"]
    for preset, runs in results.items():
        ours_bf16 = tokens_per_gpu(runs.get("parallel3d bf16"))
        for label, res in runs.items():
            if res is None or isinstance(res, str):
                lines.append(f"| {preset} | {label} | {res or 'failed (see its log)'} | | | | |")
                continue
            tok, peer = tokens_per_gpu(res), peers[preset].get(label)
            vs_peer = f"{tok / tokens_per_gpu(runs[peer]):.3f}x ({peer})" \
                if peer and isinstance(runs.get(peer), dict) else ""
            vs_ours = f"{tok / ours_bf16:.3f}x" if ours_bf16 > 0 else ""  # nan: our bf16 run failed
            lines.append(f"| {preset} | {label} | {iteration_time(res):.3f} s | {tok:,.0f} | {peak_gib(res):.1f} | "
                         f"{vs_ours} | {vs_peer} |")
    return "\n".join(lines)


def fp8_suite(a: argparse.Namespace) -> None:
    """Every preset's runs, one GPU per preset: with ``--gpus N`` N presets at a time, each on its own GPU
    (a preset's runs, and so every ratio of its rows, stay on one card)."""
    start = time.monotonic()
    cards = visible_gpus(a.gpus, dict(os.environ))
    if a.gpus > len(cards):
        raise SystemExit(f"--gpus {a.gpus}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} leaves "
                         f"{len(cards)}; pass --gpus {len(cards)} or fewer")
    logs = os.path.join(a.out, "logs")
    path = os.path.join(a.out, "fp8_bench.json")
    results: dict = {preset: {} for preset in a.presets}
    peers: dict = {preset: {} for preset in a.presets}
    todo, lock = list(a.presets), threading.Lock()

    def bench_preset(preset: str, gpu: int) -> None:
        env = {"PARALLEL3D_DEVICE": "cpu"} if a.cpu_smoke else None
        if a.gpus > 1 and not a.cpu_smoke:
            env = {"CUDA_VISIBLE_DEVICES": cards[gpu]}
        for label, peer, script, args, timeout in fp8_runs(preset, a):
            left = a.budget_s - (time.monotonic() - start)
            if left < a.min_run_s:
                res = f"skipped: under {a.min_run_s:.0f} s of the {a.budget_s:.0f} s budget left"
                print(f"{preset} / {label}: {res}", flush=True)
            else:
                name = f"fp8_{preset}_{label}".replace(" ", "_").replace("+", "").replace("__", "_")
                res = run(name, 1, script, args, logs, timeout=int(min(timeout, left)), env=env)
            with lock, open(path, "w") as f:  # after every run: a later timeout keeps what was measured
                results[preset][label], peers[preset][label] = res, peer
                json.dump({"results": results, "peers": peers}, f, indent=1)

    def worker(gpu: int) -> None:
        while True:
            with lock:
                if not todo:
                    return
                preset = todo.pop(0)
            bench_preset(preset, gpu)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in range(a.gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"\nFP8 suite, {time.monotonic() - start:.0f} s\n" + fp8_table(results, peers), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    p.add_argument("--fp8", action="store_true", help="the FP8 suite (module docstring) instead of the bf16 peers")
    p.add_argument("--presets", nargs="+", default=["llama-3b", "llama-1b", "gpt-1.3b"], help="--fp8: in this order")
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise", "delayed"], help="--fp8: FP8 recipes")
    p.add_argument("--titan-bf16", action="store_true", help="--fp8: also torchtitan in bf16 (last of a preset)")
    p.add_argument("--fp8-without", nargs="+", default=[], metavar="SPEEDUP",
                   help="--fp8: after the first recipe's run, one run without each of these speed-ups "
                   "(gpt_bench.FP8_SPEEDUPS: gpt_bench.py --fp8-disable), compared with it")
    p.add_argument("--gpus", type=int, default=1, help="--fp8: presets measured at once, each on its own GPU")
    p.add_argument("--budget-s", type=float, default=480.0, help="--fp8: seconds for the whole suite")
    p.add_argument("--min-run-s", type=float, default=40.0, help="--fp8: skip a run with less budget than this left")
    p.add_argument("--report", nargs="+", default=None, help="--fp8: print the table of these fp8_bench.json files")
    p.add_argument("--cpu-smoke", action="store_true", help="--fp8 on CPU processes: the tiny preset, the peers' "
                   "smoke modes (checks the harness, not speed)")
    a = p.parse_args()
    if a.report:
        results, peers = {}, {}
        for path in a.report:
            with open(path) as f:
                got = json.load(f)
            results.update(got["results"])
            peers.update(got["peers"])
        print(fp8_table(results, peers))
        return
    os.makedirs(a.out, exist_ok=True)
    if a.cpu_smoke:
        a.presets, a.iters, a.warmup = ["tiny"], 1, 0
    fp8_suite(a) if a.fp8 else bf16_peers(a)


if __name__ == "__main__":
    main()
