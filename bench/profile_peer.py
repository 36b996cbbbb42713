"""Profile the last training iteration of a peer's runner (the plain PyTorch anchor) without editing it.

    torchrun --standalone --nproc-per-node 1 bench/profile_peer.py [--table=FILE] \\
        ../shared/anchors/plain_gpt_bench.py --preset gpt-1.3b --grad-accum 4 --compile --iters 1 --warmup 2

The runner calls its optimizer's ``step()`` once per iteration. This wraps ``torch.optim.Optimizer``'s
subclasses' ``step`` so that the profiler starts after the next-to-last step and stops after the last
one (with a synchronize), then prints ``PROFILE_JSON: {...}``: bench/profile_breakdown.py's figures,
the same classes as ``gpt_bench.py --profile-overlap`` gives for parallel3d, so the two runs' GPU time
splits alike. The profiled run's own timing is perturbed: take the peer's tokens/s from an unprofiled run.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_breakdown import kernel_breakdown, write_op_table  # noqa: E402


def main() -> None:
    table = None
    if sys.argv[1].startswith("--table="):  # the operators' table (profile_breakdown.write_op_table) to a file
        table = sys.argv.pop(1).split("=", 1)[1]
    script, argv = sys.argv[1], sys.argv[2:]
    counts = argparse.ArgumentParser(add_help=False)
    counts.add_argument("--iters", type=int, required=True)
    counts.add_argument("--warmup", type=int, required=True)
    n = sum(vars(counts.parse_known_args(argv)[0]).values())
    state = {"steps": 0, "prof": None}

    def wrap(step):
        def profiled_step(self, *args, **kwargs):
            out = step(self, *args, **kwargs)
            state["steps"] += 1
            if state["steps"] == n - 1:
                state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                        record_shapes=table is not None).__enter__()
            elif state["steps"] == n and state["prof"] is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                state["prof"].__exit__(None, None, None)
                if int(os.environ.get("RANK", "0")) == 0:
                    print("PROFILE_JSON: " + json.dumps(kernel_breakdown(state["prof"])), flush=True)
                    if table:
                        write_op_table(state["prof"], table)
            return out
        return profiled_step

    # Each optimizer class defines its own step (AdamW's is torch.optim.AdamW.step), so patch them all.
    for cls in {c for c in vars(torch.optim).values() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)}:
        if "step" in vars(cls):
            cls.step = wrap(cls.step)
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
