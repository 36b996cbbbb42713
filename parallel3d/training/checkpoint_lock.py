"""One job per --save directory: ``SAVE/parallel3d_save.lock``, held by rank 0 for the whole run.

Two jobs saving into one directory delete each other's saves (each clears the other's
``iter_*.tmp`` as debris). Rank 0 takes an exclusive ``flock`` on the lock file, without waiting,
and writes its host and pid into it; a second job is refused, on every rank, naming that holder.
The kernel drops the lock when its process dies, however it dies, so a lock file left by a killed
job (its host and pid stale) is taken over at once; on release the file is removed. A directory
holding ``iter_*`` checkpoints but no tracker is refused here too (checkpoint_metadata), before a
fresh run's first save would overwrite them.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel3d.collectives import all_ranks_ok
from parallel3d.device import default_device
from parallel3d.training.checkpoint_integrity import CheckpointError, CheckpointWarning
from parallel3d.training.checkpoint_metadata import read_latest_iteration

LOCK_FILE = "parallel3d_save.lock"
_MESSAGE_BYTES = 2048


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {info['host']} pid {info['pid']} (since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its host and pid yet)"


class SaveDirLock:
    """The lock of one --save directory: ``acquire`` (a CheckpointError naming the holder) and ``release``."""

    def __init__(self, save_dir: str):
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.save_dir = save_dir
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise CheckpointError(
                    f"--save directory {self.save_dir} is in use by another job: {holder} holds {self.path}. Two "
                    "jobs saving into one directory delete each other's saves: stop that job or give this run "
                    "another --save") from None
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    warnings.warn(f"the filesystem of --save {self.save_dir} offers no file locks: nothing stops a "
                                  "second job from saving into it", CheckpointWarning, stacklevel=2)
                    return
                raise CheckpointError(f"cannot lock {self.path}: {e.strerror or e}") from None
            try:  # a holder releasing in between removed the file we locked: lock the one now there
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.remove(self.path)  # still locked by us: nobody can have locked this file meanwhile
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


class save_dir_guard:
    """Context manager around a run saving into ``save_dir``: on rank 0 refuse a directory with untracked
    checkpoints and take its lock; every rank gets rank 0's error line (no rank is left waiting)."""

    def __init__(self, save_dir: Optional[str]):
        self.lock = SaveDirLock(save_dir) if save_dir else None

    def __enter__(self) -> "save_dir_guard":
        if self.lock is None:
            return self
        error = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                if os.path.isdir(self.lock.save_dir):
                    read_latest_iteration(self.lock.save_dir)  # refuses iter_* without a tracker
                self.lock.acquire()
            except CheckpointError as e:
                error = str(e)
            except OSError as e:  # never raise past the collective below: the other ranks would wait for rank 0
                error = f"cannot lock --save directory {self.lock.save_dir}: {e.strerror or e}"
        if not all_ranks_ok(error is None, "rank 0's check and lock of the --save directory"):
            self.lock.release()
            raise CheckpointError(_from_rank_0(error))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.lock is not None:
            self.lock.release()


def _from_rank_0(message: Optional[str]) -> str:
    """Rank 0's error line, on every rank."""
    if not dist.is_initialized():
        return message or ""
    data = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if dist.get_rank() == 0:
        raw = (message or "").encode()[:_MESSAGE_BYTES]
        data[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    data = data.to(default_device())
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
