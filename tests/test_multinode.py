"""Two nodes without a cluster: 2 torchrun agents x 2 gloo processes on this machine, joined through torchrun's
c10d rendezvous on 127.0.0.1, as on two hosts (README, "Several nodes").

One job trains and saves, each node building the default dataset in its own PARALLEL3D_CACHE (a node-local
disk); a second resumes from the checkpoint, then a rank of node 1 is stopped and node 0's ranks name it.
"""
import os
import signal
import socket
import time

import torchrun
from parallel3d.training import checkpointing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
TINY = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "1000", "--no-progress-bar",
        "--lr-decay-style", "constant"]
# The resumed job's collective timeout, start-up's included: on a loaded 2-core machine the two nodes' ranks reached
# the checkpoint's first check more than 3 s apart (both nodes' ranks then timed out there)
TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(argv, tmp_path, run_id):
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = []
    for node in (0, 1):
        launcher = ("--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", run_id, "--rdzv-conf", f"is_host={int(node == 0)}")
        agents.append(torchrun.start(2, SCRIPT, argv, tmp_path, {"PARALLEL3D_CACHE": str(tmp_path / f"cache{node}")},
                                     launcher_args=launcher, name=f"node{node}_"))
    return agents


def _output(tmp_path, node, stream="out"):
    return (tmp_path / f"node{node}_{stream}.txt").read_text()


def test_two_nodes_save_resume_and_name_a_stopped_rank_on_the_other_node(tmp_path):
    ckpt = tmp_path / "ckpt"
    agents = _two_nodes(TINY + ["--train-iters", "3", "--save", str(ckpt)], tmp_path, "save")
    try:
        rcs = [a.wait(timeout=120) for a in agents]
    finally:
        for a in agents:
            torchrun.cleanup(a, [])
    assert rcs == [0, 0], _output(tmp_path, 0, "err")[-3000:] + _output(tmp_path, 1, "err")[-3000:]
    assert checkpointing.read_latest_iteration(str(ckpt)) == 3
    built = [_output(tmp_path, n).count("built the default dataset") for n in (0, 1)]
    assert built == [1, 1], built  # once per node, by its first process, into its own cache
    assert all(any(f.endswith(".idx") for f in os.listdir(tmp_path / f"cache{n}")) for n in (0, 1))

    # resume on both nodes, then stop global rank 3 (node 1, pipeline stage 1)
    agents = _two_nodes(TINY + ["--train-iters", "100000", "--load", str(ckpt), "--distributed-timeout-minutes",
                                str(TIMEOUT_S / 60)], tmp_path, "resume")
    workers = {}
    try:
        torchrun.wait_for(tmp_path / "node1_out.txt", "iteration      5/", agents[1], 120)
        assert "at iteration 3" in _output(tmp_path, 0) + _output(tmp_path, 1)
        workers = {**torchrun.workers(agents[0]), **torchrun.workers(agents[1])}
        assert sorted(workers) == [0, 1, 2, 3], workers
        os.kill(workers[3], signal.SIGSTOP)
        stopped_at = time.monotonic()
        live = [workers[r] for r in (0, 1, 2)]
        while any(torchrun.alive(p) for p in live) and time.monotonic() < stopped_at + TIMEOUT_S + 30:
            time.sleep(0.2)
        assert not any(torchrun.alive(p) for p in live), "a live rank did not exit within the timeout + 30 s"
    finally:
        for a in agents:
            torchrun.cleanup(a, workers.values())
    err = _output(tmp_path, 0, "err")
    for rank in (0, 1):  # node 0's ranks name the stopped rank of node 1
        lines = [line for line in err.splitlines() if line.startswith(f"error: rank {rank}: ")]
        assert len(lines) == 1 and "rank 3 reported no communication failure" in lines[0], err[-4000:]
