"""One GPU, one preset: Megatron-Core, plain PyTorch (eager and torch.compile) and, for the llama
presets, torchtitan (its Trainer, torch.compile) against parallel3d with and without the fused kernels,
and with --compile (each layer through torch.compile).

    python3 bench/single_gpu_bench.py [--preset llama-1b] [--out DIR]

Each run is ``gpt_bench.py`` (or a peer's anchor) under torchrun with the same model and batch:
micro-batch 4, 4 microbatches per step (the plain runner's ``--grad-accum 4``). The unfused run sets
PARALLEL3D_DISABLE_FUSION=1, so the difference between the two parallel3d runs is what csrc/ is worth
end to end. Ratios are to the fastest peer.
"""
from __future__ import annotations

import argparse
import json
import os

from launch import MEGATRON, OURS, PLAIN, TITAN, TITAN_WHEELS, iteration_time, run, tokens_per_gpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    a = p.parse_args()
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
        peak = (res or {}).get("peak_memory_gb") or (res or {}).get("max_mem_allocated_gib") or float("nan")
        print(f"| {name} | {iteration_time(res):.3f} s | {tokens_per_gpu(res):,.0f} | {peak:.1f} | "
              f"{tokens_per_gpu(res) / base:.3f}x |")
    with open(os.path.join(a.out, f"single_gpu_{a.preset}.json"), "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
