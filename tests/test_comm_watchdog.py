"""A stopped rank is named with the collective the others actually waited in, and a host blocked inside a
collective (NCCL's asynchronous case, simulated on gloo) is ended by the watchdog with one line naming the
operation and the silent rank (parallel3d/distributed_timeout.py)."""
import datetime
import os
import time

import pytest
import torch

from parallel3d import parallel_state
from parallel3d import tensor_parallel as tp
from parallel3d.distributed_timeout import (
    CommunicationError, NCCL_ENV_DEFAULTS, nccl_environment_defaults, process_group_timeout, set_timeout,
    start_watchdog, waiting_for)
from parallel3d.testing import DistributedTestError, run_distributed

TIMEOUT_S = 2.0


def _tp_forward_with_a_late_rank(rank, world_size):
    """TP=2: rank 1 arrives long after the timeout; rank 0 waits in the row-parallel layer's all-reduce."""
    set_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    parallel_state.initialize_model_parallel(2, 1, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    layer = tp.RowParallelLinear(8, 8, input_is_parallel=True)
    # Both ranks here together, so rank 1's lateness is counted from rank 0's all-reduce, not from a set-up
    # that a loaded machine can slow by seconds (rank 0 once reached the all-reduce after rank 1 had slept).
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(2.5 * TIMEOUT_S)  # past rank 0's timeout and its census (TIMEOUT_S more)
    try:
        layer(torch.randn(4, 2, 4))
    except CommunicationError as e:
        return str(e)
    return "no error"


def test_a_late_tp_rank_is_named_with_the_tp_collective():
    messages = run_distributed(_tp_forward_with_a_late_rank, 2, timeout=60)
    assert messages[0].startswith(f"rank 0 timed out after {TIMEOUT_S:g} s in a tensor-parallel all-reduce "
                                  "(a TP layer's forward or backward) with rank 0, 1; rank 1 reported no "
                                  "communication failure"), messages[0]


def _blocked_host(rank, world_size, err_path):
    """Rank 0's host blocks inside a collective's block and never returns (as an NCCL rank does in a host sync
    on a collective whose peer stopped); rank 1 is 'stopped' (sleeps)."""
    os.dup2(os.open(err_path + f".{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    set_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    start_watchdog(grace_s=1.0, census_s=1.0, poll_s=0.1)
    if rank == 1:
        time.sleep(6)
        return "slept"
    with waiting_for("a test all-reduce", [0, 1]):
        time.sleep(30)  # the watchdog ends the process long before
    return "returned"


def test_the_watchdog_ends_a_host_blocked_in_a_collective(tmp_path):
    err = str(tmp_path / "err")
    started = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)rank 0 .*exited with code 1"):
        run_distributed(_blocked_host, 2, args=(err,), timeout=25)
    assert time.monotonic() - started < 20  # rank 0 ended at about 4 s; rank 1 returns at 6 s
    line = open(err + ".0").read()
    assert line.startswith("error: rank 0: rank 0 timed out after 3 s waiting in a test all-reduce with rank 0, 1; "
                           "rank 1 reported no communication failure within 1 s"), line
    assert "(watchdog: --distributed-timeout-minutes 0.0333333 + 1 s passed; the process exits)" in line, line
    assert line.count("\n") == 1


def test_nccl_gets_a_longer_timeout_and_no_debug_dump(monkeypatch):
    for k in NCCL_ENV_DEFAULTS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "120")  # the user's setting wins
    applied = nccl_environment_defaults()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" not in applied
    assert os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "120"
    t = datetime.timedelta(minutes=1)
    assert process_group_timeout("gloo", t) == t and process_group_timeout("nccl", t) > t
