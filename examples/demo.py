"""The main job in one command: install what is missing, then pretrain a small GPT in 3D parallel.

    python3 examples/demo.py

On a CPU it starts 8 processes as TP=2 x PP=2 (interleaved, 2 virtual stages) x DP=2;
with GPUs, one process per GPU (the layout adapts to the count). It trains on the
Python documentation shipped with Python (pydoc_data), byte-level tokens, shows the
loss falling, saves a checkpoint under ./demo_checkpoint and prints a sample
generated from it. Extra arguments go to examples/pretrain_gpt.py unchanged.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_installed() -> None:
    """pip install the CPU build of torch (if no torch at all) and this package with its dependencies."""
    missing = [m for m in ("torch", "einops", "safetensors", "numpy", "parallel3d")
               if importlib.util.find_spec(m) is None]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q"]
    if "torch" in missing:
        cmd.append("torch==2.13.0")
    cmd += ["-e", ROOT]
    print("installing:", " ".join(cmd[4:]), flush=True)
    subprocess.run(cmd, check=True)


def layout(gpus: int) -> tuple[int, list[str]]:
    """(process count, parallel flags) for the machine."""
    if gpus >= 4:
        n = gpus - gpus % 4
        return n, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1"]
    if gpus >= 2:
        return 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    if gpus == 1:
        return 1, []
    return 8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "1"]


def main() -> int:
    ensure_installed()
    import torch

    from parallel3d.device import default_backend

    # PARALLEL3D_DEVICE=cpu keeps the demo on CPU processes on a machine with GPUs (the test suite does)
    gpus = torch.cuda.device_count() if default_backend() == "nccl" else 0
    nproc, parallel = layout(gpus)
    gpu_args = ["--bf16", "--micro-batch-size", "8", "--train-iters", "1000"] if gpus else []
    args = parallel + [
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters", "300", "--lr", "5e-3",
        "--min-lr", "5e-4", "--lr-warmup-iters", "20", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--log-interval", "25", "--eval-interval", "100", "--eval-iters", "2",
        "--save", os.path.join(os.getcwd(), "demo_checkpoint"),
        "--sample-prompt", "The try statement", "--sample-tokens", "80",
    ] + gpu_args + sys.argv[1:]  # later flags win: the user's, then the GPU ones
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "examples", "pretrain_gpt.py")] + args
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"running {nproc} process(es) on {'%d GPU(s)' % gpus if gpus else 'the CPU'}", flush=True)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
