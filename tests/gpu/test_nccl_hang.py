"""On NCCL a stopped rank ends the job: every process exits within the timeout plus a bounded grace, and the
live rank writes one line naming the operation it waited in and the rank that stopped answering.

NCCL runs collectives asynchronously, so the live rank blocks in a later host synchronisation, where NCCL's
own watchdog used to log a C++ trace and linger for minutes; parallel3d/distributed_timeout.py's watchdog
ends it instead (tests/test_comm_watchdog.py proves the same path on gloo CPU ranks).
"""
import os
import signal
import time

import pytest
import torch

import torchrun
from parallel3d.distributed_timeout import WATCHDOG_CENSUS_S, WATCHDOG_GRACE_S

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
TIMEOUT_S = 30.0
# the watchdog's poll and line, then torchrun's SIGTERM -> SIGKILL of the stopped rank (30 s), and slack
BOUND_S = TIMEOUT_S + WATCHDOG_GRACE_S + WATCHDOG_CENSUS_S + 30.0 + 30.0

pytestmark = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs; this machine has {GPUS}")


def test_a_stopped_tp_rank_ends_the_nccl_job_naming_it(tmp_path):
    argv = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "1000000", "--log-interval", "1", "--eval-interval", "1000000", "--no-progress-bar",
            "--distributed-timeout-minutes", str(TIMEOUT_S / 60)]
    agent = torchrun.start(2, SCRIPT, argv, tmp_path, {"PARALLEL3D_DEVICE": "cuda"})
    workers = {}
    try:
        torchrun.wait_for(tmp_path / "out.txt", "iteration     20/", agent, 300)
        workers = torchrun.workers(agent)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        everything = [agent.pid, *workers.values()]
        while any(torchrun.alive(p) for p in everything) and time.monotonic() < stopped_at + BOUND_S:
            time.sleep(0.5)
        ended_after = time.monotonic() - stopped_at
        left = [p for p in everything if torchrun.alive(p)]
        assert not left, f"processes {left} still alive {BOUND_S:.0f} s after rank 1 stopped"
    finally:
        torchrun.cleanup(agent, workers.values())
    err = (tmp_path / "err.txt").read_text()
    lines = [line for line in err.splitlines() if line.startswith("error: rank 0: ")]
    assert len(lines) == 1, err[-6000:]
    # the watchdog's "timed out after N s waiting in OP with ..." (or, had NCCL raised first, "failed (...) in OP")
    assert ("timed out after" in lines[0] or "failed (" in lines[0]) and \
        "rank 1 reported no communication failure" in lines[0], lines[0]
    print(f"job ended {ended_after:.0f} s after rank 1 stopped: {lines[0]}")
