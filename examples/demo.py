"""The main job in one command: set up a local environment, then pretrain a GPT in 3D parallel.

    python3 examples/demo.py [extra pretrain_gpt.py flags]

First it re-runs itself inside the checkout's own virtual environment ``.venv`` (created on
the first run, see parallel3d/bootstrap.py: the Python that runs this is never modified).
Then it trains on the Python documentation shipped with Python (pydoc_data), byte-level
tokens, shows the loss falling, saves ``./demo_checkpoint`` and prints a sample from it.

- CPU: a small GPT (4 layers, hidden 128) as 8 processes, TP=2 x PP=2 (interleaved) x DP=2.
- GPUs: a GPT-2-small shape (12 layers, hidden 768, 12 heads, 512 tokens, bf16), one process
  per GPU: 1 GPU plain, 2-3 GPUs PP=2 interleaved, 4+ GPUs TP=2 x PP=2 interleaved x DP.

Extra arguments go to examples/pretrain_gpt.py and win over the demo's.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # parallel3d.bootstrap is standard library only: importable before any install

from parallel3d.bootstrap import reexec_in_venv  # noqa: E402

_CPU_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters", "300", "--lr", "5e-3",
              "--min-lr", "5e-4", "--lr-warmup-iters", "20", "--lr-decay-style", "cosine", "--log-interval", "25",
              "--eval-interval", "100"]
# GPT-2 small's shape (byte vocabulary, ~85M parameters). 500 iterations (~70 passes over the 0.47 MB
# corpus): longer runs memorise it and the validation loss rises again (README).
_GPU_MODEL = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "512",
              "--micro-batch-size", "16", "--global-batch-size", "128", "--train-iters", "500", "--lr", "1e-3",
              "--min-lr", "1e-4", "--lr-warmup-iters", "50", "--lr-decay-style", "cosine", "--bf16",
              "--log-interval", "100", "--eval-interval", "250"]


def layout(gpus: int) -> tuple[int, list[str]]:
    """(process count, parallel flags) for the machine; ``gpus == 0`` means the CPU."""
    interleave = ["--num-layers-per-virtual-pipeline-stage", "3" if gpus else "1"]
    if gpus >= 4:
        return gpus - gpus % 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 *interleave]
    if gpus >= 2:
        return 2, ["--pipeline-model-parallel-size", "2", *interleave]
    if gpus == 1:
        return 1, []
    return 8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *interleave]


def demo_args(gpus: int, user_args: Sequence[str], cwd: str) -> tuple[int, list[str]]:
    """(process count, pretrain_gpt.py arguments): the machine's model, then the user's flags (later wins).

    A user's shorter --train-iters keeps the warmup below it (warmup must end before the decay does)."""
    nproc, parallel = layout(gpus)
    model = list(_GPU_MODEL if gpus else _CPU_MODEL)
    user = list(user_args)
    if "--train-iters" in user and not {"--lr-warmup-iters", "--lr-warmup-fraction"} & set(user):
        iters = int(user[user.index("--train-iters") + 1])
        warmup = model.index("--lr-warmup-iters") + 1
        model[warmup] = str(min(int(model[warmup]), iters // 10))
    common = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--eval-iters", "2",
              "--save", os.path.join(cwd, "demo_checkpoint"),
              "--sample-prompt", "The try statement", "--sample-tokens", "200" if gpus else "80"]
    return nproc, parallel + model + common + user


def main() -> int:
    reexec_in_venv(os.path.abspath(__file__), sys.argv[1:])
    import torch

    from parallel3d.device import default_backend

    # PARALLEL3D_DEVICE=cpu keeps the demo on CPU processes on a machine with GPUs (the test suite does)
    gpus = torch.cuda.device_count() if default_backend() == "nccl" else 0
    nproc, args = demo_args(gpus, sys.argv[1:], os.getcwd())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "examples", "pretrain_gpt.py")] + args
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"running {nproc} process(es) on {'%d GPU(s)' % gpus if gpus else 'the CPU'}", flush=True)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
