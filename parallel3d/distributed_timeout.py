"""When a collective or pipeline transfer fails or times out, say what this rank waited for, and on whom.

gloo's own error reads "Timed out waiting 600000ms for recv operation to complete", and
torchrun then names the first rank that exited, not the one that hung. Wrapping each
blocking point of the training step in ``waiting_for(operation, peers)`` turns such an
error into a ``CommunicationError`` naming the operation and its peer ranks; before it
is raised, every failing rank records itself in the process group's store and waits a
short while for the others, so each message also lists the ranks that never reported
(stopped, hung, or still computing): usually the culprit.

NCCL runs collectives asynchronously: a rank whose peer stopped blocks in a later host
synchronisation, and NCCL's own watchdog may log a C++ trace and hang in its abort rather
than raise. So ``start_watchdog()`` adds a thread of ours: the main thread's innermost
``waiting_for`` block is recorded on entry and exit (two assignments, no synchronisation),
and once the main thread has sat inside one block for the timeout plus ``WATCHDOG_GRACE_S``
the thread takes the same census, writes one line naming the operation, its peers and the
silent ranks, and ends the process (``os._exit(1)``). ``process_group_timeout`` gives NCCL a
longer timeout than ours, and ``nccl_environment_defaults`` turns off its debug dump, so our
line comes first; NCCL's watchdog stays armed behind it.

``--distributed-timeout-minutes`` (Megatron's flag) sets the timeout.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Callable, Optional, Sequence, Union

import torch.distributed as dist

_TIMEOUT_S = 1800.0  # torch's default for gloo, until set_timeout() is called
_CENSUS_PREFIX = "parallel3d/comm_failure/"
_COMM_FAILURE_TEXT = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe",
                      "ECONNRESET", "EPIPE")
WATCHDOG_GRACE_S = 30.0  # beyond the timeout: a gloo timeout (raised at the timeout) and its census come first
WATCHDOG_CENSUS_S = 10.0  # how long the watchdog waits for other ranks to report before it names the silent ones
_NCCL_MARGIN_S = 60.0  # NCCL's timeout exceeds the watchdog's deadline by this much (its census, host run-ahead)
# Our watchdog ends the process; NCCL's dump on timeout only delays that (it was measured to hang for minutes),
# and its heartbeat monitor bounds a watchdog thread stuck in an abort. The user's settings win.
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_ENABLE_MONITORING": "1",
                     "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60"}

Peers = Union[Sequence[int], str, Callable[[], Sequence[int]]]


class CommunicationError(RuntimeError):
    """A collective or point-to-point transfer failed; the message names the operation and the ranks."""


def set_timeout(timeout: datetime.timedelta) -> None:
    """The process-group timeout in force (for messages and for how long the census waits)."""
    global _TIMEOUT_S
    _TIMEOUT_S = timeout.total_seconds()


def process_group_timeout(backend: str, timeout: datetime.timedelta) -> datetime.timedelta:
    """The timeout to give the process groups: ``timeout`` for gloo (it raises, and we name the operation);
    for NCCL longer than the watchdog's deadline, so the watchdog's line comes before NCCL's abort."""
    if backend != "nccl":
        return timeout
    return timeout + datetime.timedelta(seconds=WATCHDOG_GRACE_S + WATCHDOG_CENSUS_S + _NCCL_MARGIN_S)


def nccl_environment_defaults() -> dict[str, str]:
    """Set ``NCCL_ENV_DEFAULTS`` where the user has not (before init_process_group); return what was set."""
    applied = {k: v for k, v in NCCL_ENV_DEFAULTS.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


def prepare_process_groups(backend: str, timeout: datetime.timedelta) -> datetime.timedelta:
    """Before init_process_group: record ``timeout``, set NCCL's environment defaults; return the groups' timeout."""
    set_timeout(timeout)
    if backend == "nccl":
        nccl_environment_defaults()
    return process_group_timeout(backend, timeout)


def _is_comm_failure(e: BaseException) -> bool:
    backend_error = getattr(dist, "DistBackendError", None)
    return (backend_error is not None and isinstance(e, backend_error)) or \
        any(s in str(e) for s in _COMM_FAILURE_TEXT)


def _silent_ranks(rank: int, what: str, wait_s: Optional[float] = None) -> list[int] | None:
    """Record this rank's failure in the store; return the ranks that did not record one in time.

    Ranks blocked on the same culprit time out within about one timeout of each other, so
    waiting up to that long (at most 30 s) collects them; None if the store is unreachable.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_CENSUS_PREFIX}{rank}", what)
        others = [r for r in range(dist.get_world_size()) if r != rank]
        deadline = time.monotonic() + (min(_TIMEOUT_S, 30.0) if wait_s is None else wait_s)
        while True:
            silent = [r for r in others if not store.check([f"{_CENSUS_PREFIX}{r}"])]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store may live in the hung process; the message still names the peers
        return None


def _silent_text(silent: list[int] | None, waited_s: float) -> str:
    if not silent:
        return ""
    return (f"; rank {', '.join(map(str, silent))} reported no communication failure within {waited_s:g} s: "
            "stopped, hung, crashed or still computing")


class _InFlight:
    """The main thread's open ``waiting_for`` blocks, and when it last entered or left one (the watchdog reads it)."""

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self.blocks: list["waiting_for"] = []
        self.since = time.monotonic()


_IN_FLIGHT = _InFlight()


class waiting_for:  # noqa: N801 - used as a context manager, like contextlib's
    """Name ``operation`` and ``peers`` (global ranks, a description, or a function giving the ranks) if the
    block fails to communicate.

    ``operation`` may be a function, called only on failure: per-microbatch callers pay no formatting.
    """

    __slots__ = ("operation", "peers")

    def __init__(self, operation: Union[str, Callable[[], str]], peers: Peers):
        self.operation, self.peers = operation, peers

    def describe(self) -> str:
        peers = self.peers() if callable(self.peers) else self.peers
        peer_text = peers if isinstance(peers, str) else "rank " + ", ".join(str(p) for p in peers)
        return f"{self.operation() if callable(self.operation) else self.operation} with {peer_text}"

    def __enter__(self) -> None:
        if threading.get_ident() == _IN_FLIGHT.main:
            _IN_FLIGHT.blocks.append(self)
            _IN_FLIGHT.since = time.monotonic()

    def __exit__(self, exc_type, e, tb) -> bool:
        if threading.get_ident() == _IN_FLIGHT.main and _IN_FLIGHT.blocks:
            _IN_FLIGHT.blocks.pop()
            _IN_FLIGHT.since = time.monotonic()  # the census below must not look like a hang to the watchdog
        if e is None or isinstance(e, CommunicationError) or not isinstance(e, RuntimeError):
            return False
        if not dist.is_initialized() or not _is_comm_failure(e):
            return False
        rank = dist.get_rank()
        timed_out = "imed out" in str(e)
        how = f"timed out after {_TIMEOUT_S:g} s" if timed_out else f"failed ({' '.join(str(e).split())[:160]})"
        what = f"rank {rank} {how} in {self.describe()}"
        what += _silent_text(_silent_ranks(rank, what), min(_TIMEOUT_S, 30.0))
        raise CommunicationError(what) from e


def group_peers(group: Optional[dist.ProcessGroup]) -> Callable[[], list[int]]:
    """The global ranks of ``group``, looked up only when a message needs them."""
    return lambda: dist.get_process_group_ranks(group)


def _watch(grace_s: float, census_s: float, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        waited = time.monotonic() - _IN_FLIGHT.since
        innermost = _IN_FLIGHT.blocks[-1:]  # a slice: the main thread may pop the last block meanwhile
        if innermost and waited > _TIMEOUT_S + grace_s:
            _end_hung_process(innermost[0], waited, grace_s, census_s)


def _end_hung_process(block: waiting_for, waited: float, grace_s: float, census_s: float) -> None:
    rank = dist.get_rank()
    try:
        what = f"rank {rank} timed out after {waited:.0f} s waiting in {block.describe()}"
    except Exception:  # noqa: BLE001 - describing the peers needs the process group; never let that stop the exit
        what = f"rank {rank} timed out after {waited:.0f} s waiting in {block.operation}"
    census: list = []
    helper = threading.Thread(target=lambda: census.append(_silent_ranks(rank, what, census_s)), daemon=True)
    helper.start()
    helper.join(census_s + 5.0)  # the store may be unreachable: exit anyway
    line = (f"error: rank {rank}: {what}{_silent_text(census[0] if census else None, census_s)} (watchdog: "
            f"--distributed-timeout-minutes {_TIMEOUT_S / 60:g} + {grace_s:g} s passed; the process exits)\n")
    sys.stderr.write(line)  # one write: ranks sharing stderr do not interleave
    sys.stderr.flush()
    os._exit(1)  # the main thread is blocked in the backend: no cleanup could finish


_STARTED: list[threading.Thread] = []


def start_watchdog(grace_s: float = WATCHDOG_GRACE_S, census_s: float = WATCHDOG_CENSUS_S,
                   poll_s: float = 1.0) -> None:
    """Once per process, after init_process_group: end the process when the main thread has been inside one
    ``waiting_for`` block for the timeout + ``grace_s`` (see the module's docstring)."""
    if _STARTED or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    thread = threading.Thread(target=_watch, args=(grace_s, census_s, poll_s), name="parallel3d-comm-watchdog",
                              daemon=True)
    thread.start()
    _STARTED.append(thread)
