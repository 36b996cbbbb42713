"""When a collective or pipeline transfer fails or times out, say what this rank waited for, and on whom.

gloo's own error reads "Timed out waiting 600000ms for recv operation to complete", and
torchrun then names the first rank that exited, not the one that hung. Wrapping each
blocking point of the training step in ``waiting_for(operation, peers)`` turns such an
error into a ``CommunicationError`` naming the operation and its peer ranks; before it
is raised, every failing rank records itself in the process group's store and waits a
short while for the others, so each message also lists the ranks that never reported
(stopped, hung, or still computing): usually the culprit.

``--distributed-timeout-minutes`` (Megatron's flag) sets the timeout; the wrapper costs
nothing until an error happens (no extra synchronisation).
"""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Callable, Iterator, Sequence, Union

import torch.distributed as dist

_TIMEOUT_S = 1800.0  # torch's default for gloo, until set_timeout() is called
_CENSUS_PREFIX = "parallel3d/comm_failure/"
_COMM_FAILURE_TEXT = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe",
                      "ECONNRESET", "EPIPE")


class CommunicationError(RuntimeError):
    """A collective or point-to-point transfer failed; the message names the operation and the ranks."""


def set_timeout(timeout: datetime.timedelta) -> None:
    """The process-group timeout in force (for messages and for how long the census waits)."""
    global _TIMEOUT_S
    _TIMEOUT_S = timeout.total_seconds()


def _is_comm_failure(e: BaseException) -> bool:
    backend_error = getattr(dist, "DistBackendError", None)
    return (backend_error is not None and isinstance(e, backend_error)) or \
        any(s in str(e) for s in _COMM_FAILURE_TEXT)


def _silent_ranks(rank: int, what: str) -> list[int] | None:
    """Record this rank's failure in the store; return the ranks that did not record one in time.

    Ranks blocked on the same culprit time out within about one timeout of each other, so
    waiting up to that long (at most 30 s) collects them; None if the store is unreachable.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_CENSUS_PREFIX}{rank}", what)
        others = [r for r in range(dist.get_world_size()) if r != rank]
        deadline = time.monotonic() + min(_TIMEOUT_S, 30.0)
        while True:
            silent = [r for r in others if not store.check([f"{_CENSUS_PREFIX}{r}"])]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store may live in the hung process; the message still names the peers
        return None


@contextlib.contextmanager
def waiting_for(operation: Union[str, Callable[[], str]], peers: Union[Sequence[int], str]) -> Iterator[None]:
    """Name ``operation`` and ``peers`` (global ranks, or a description) if the block fails to communicate.

    ``operation`` may be a function, called only on failure: per-microbatch callers pay no formatting.
    """
    try:
        yield
    except CommunicationError:
        raise
    except RuntimeError as e:
        if not dist.is_initialized() or not _is_comm_failure(e):
            raise
        rank = dist.get_rank()
        peer_text = peers if isinstance(peers, str) else "rank " + ", ".join(str(p) for p in peers)
        timed_out = "imed out" in str(e)
        how = f"timed out after {_TIMEOUT_S:g} s" if timed_out else f"failed ({' '.join(str(e).split())[:160]})"
        what = f"rank {rank} {how} in {operation() if callable(operation) else operation} with {peer_text}"
        silent = _silent_ranks(rank, what)
        if silent:
            what += (f"; rank {', '.join(map(str, silent))} reported no communication failure within "
                     f"{min(_TIMEOUT_S, 30.0):g} s: stopped, hung, crashed or still computing")
        raise CommunicationError(what) from e
