"""One job per --save directory (issue 29, item 5): a second job is refused naming the holder's host and pid,
on every rank and without waiting; the lock of a killed job is taken over; the lock is released at exit.
(docs/reliability.md, "Checkpoint safety".)
"""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from parallel3d.testing import run_distributed
from parallel3d.training.checkpoint_lock import LOCK_FILE, SaveDirLock, save_dir_guard
from parallel3d.training.checkpointing import CheckpointError

# What a job killed while holding the lock leaves: the file, with its host and pid. (fcntl only: no torch import.)
_HOLD = ("import fcntl, json, os, socket, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, json.dumps({'host': socket.gethostname(), 'pid': os.getpid(), 'since': 'then'}).encode())\n"
         "print('locked', flush=True)\n"
         "time.sleep(600)\n")


def _holder(path):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_job_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    path = str(tmp_path / LOCK_FILE)
    proc = _holder(path)
    try:
        with pytest.raises(CheckpointError, match=rf"--save directory {tmp_path} is in use by another job: host "
                                                  rf"{socket.gethostname()} pid {proc.pid} \(since then\) holds "
                                                  rf".*{LOCK_FILE}.*give this run another --save"):
            SaveDirLock(str(tmp_path)).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert json.load(open(path))["pid"] == proc.pid  # the dead job's lock file is still there
    lock = SaveDirLock(str(tmp_path))
    lock.acquire()  # the kernel dropped the dead job's lock: taken over at once
    assert json.load(open(path))["pid"] == os.getpid()
    with pytest.raises(CheckpointError, match=rf"pid {os.getpid()}"):  # held: a second lock is refused
        SaveDirLock(str(tmp_path)).acquire()
    lock.release()
    assert not os.path.exists(path)
    with save_dir_guard(str(tmp_path)):  # free again
        assert os.path.exists(path)
    assert not os.path.exists(path)  # released at exit


def _guard_worker(rank, world_size, save_dir):
    try:
        with save_dir_guard(save_dir):
            return "entered"
    except CheckpointError as e:
        return str(e)


def test_every_rank_gets_the_holder_line_and_none_waits(tmp_path):
    proc = _holder(str(tmp_path / LOCK_FILE))
    try:
        results = run_distributed(_guard_worker, 2, args=(str(tmp_path),), timeout=120)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    for message in results:
        assert f"is in use by another job: host {socket.gethostname()} pid {proc.pid}" in message, results
    assert run_distributed(_guard_worker, 2, args=(str(tmp_path),), timeout=120) == ["entered", "entered"]
    assert not os.path.exists(tmp_path / LOCK_FILE)
