"""A worker ends with its launcher: killing torchrun (even with SIGKILL) ends every worker within seconds.

torchrun starts each worker in a session of its own, so a signal to torchrun's process group reaches
none of them, and a ``kill -9`` of torchrun leaves them training and saving beside the next launch.
``exit_with_launcher()``, called first thing by the training entry and the tools, arms two guards:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process when the *thread* that
  started it exits. torchrun's agent starts its workers from its main thread, which lives as long as
  the agent. SIGKILL, not SIGTERM: under ``--exit-signal-handler`` a SIGTERM would start a save beside
  the next launch, and a process blocked in a collective runs no Python signal handler. Saves are
  kill-safe (``iter_N.tmp``).
- elsewhere (no prctl): a daemon thread polls ``os.getppid()`` every ``POLL_S`` seconds and, once the
  process has been re-parented (its launcher is gone), writes one line and ``os._exit(1)``s.
  ``exit_with_process(pid)`` polls the same way for a launcher that is not the parent (the test
  harness's workers are children of a forkserver, which lives as long as they do).

Only under a launcher (torchrun sets ``TORCHELASTIC_RUN_ID``): a plain
``python pretrain_gpt.py`` under ``nohup`` must outlive the shell that started it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun (torch.distributed.run) in every worker
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig); False where the call is unavailable or fails."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned(parent: int) -> None:
    rank = os.environ.get("RANK", "0")
    sys.stderr.write(f"error: rank {rank}: the launcher (pid {parent}) is gone: exiting (parallel3d.lifetime)\n")
    sys.stderr.flush()
    os._exit(1)  # no cleanup: atexit handlers and destructors could wait on peers that are gone too


def _watch(alive, pid: int) -> None:
    while alive():
        time.sleep(POLL_S)
    _orphaned(pid)


def _exists(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (not Linux): kill(pid, 0) said it exists


def _start_watch(alive, pid: int) -> None:
    threading.Thread(target=_watch, args=(alive, pid), name="parallel3d-launcher-watch", daemon=True).start()


def exit_with_process(pid: int) -> None:
    """End this process when process ``pid``, not its parent, ends (polled): the test harness's workers are
    children of a forkserver that lives as long as they do, and must end with the test process behind it."""
    _start_watch(lambda: _exists(pid), pid)


def exit_with_launcher(use_prctl: bool = sys.platform.startswith("linux")) -> bool:
    """End this process when its parent (the launcher) dies; True if armed.

    ``use_prctl=False`` forces the polling thread (what other platforms get).
    """
    if LAUNCHER_ENV not in os.environ:
        return False
    parent = os.getppid()
    if not (use_prctl and _set_parent_death_signal(signal.SIGKILL)):
        _start_watch(lambda: os.getppid() == parent, parent)
    if os.getppid() != parent:  # the launcher died before the guard was armed
        _orphaned(parent)
    return True


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc; none found elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _kill_group(pid: int) -> None:
    """SIGKILL ``pid``'s process group where it leads one (a torchrun worker leads its own session), else ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_job(launcher) -> None:
    """SIGKILL a launch (``subprocess.Popen`` of torchrun) and every process it started, then reap it.

    torchrun starts each worker in a session of its own, so killing torchrun's process group misses them; a
    worker that never armed ``exit_with_launcher`` (a peer's script, a test worker), or one blocked where the
    parent-death signal cannot reach it yet, then runs on and holds its GPU beside the next launch (a GPU bench
    call once ran at half speed behind such workers). The workers are found and killed first, while torchrun
    is still their parent."""
    if launcher.poll() is None:
        for child in children(launcher.pid):
            _kill_group(child)
        _kill_group(launcher.pid)
    launcher.wait()


def exit_after_run(code: int = 0) -> None:
    """End a finished launch script now, without interpreter finalization: its checkpoints are written and its
    logs closed; only stdout and stderr are flushed here. Where anything still references a process group,
    gloo's worker threads run on into finalization, and one releasing a tensor there needs the GIL: two or three
    ranks of the 8-process demo aborted so, about 1 run in 20, after the run's last line ("terminate called
    without an active exception", SIGABRT, so torchrun failed a complete run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
