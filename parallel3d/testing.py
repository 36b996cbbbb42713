"""Run a function on N CPU processes with gloo: the harness of every distributed test.

    results = run_distributed(worker, world_size=4, args=(...,), timeout=120)

``worker(rank, world_size, *args)`` must be a module-level function (it is
pickled by reference).  The process group is initialised before it runs and
destroyed after.  ``results[r]`` is rank r's return value.

Failures are loud and bounded:
- an exception on any rank fails the call with that rank's traceback, and the
  other ranks (which are usually stuck waiting for the failed one) are killed;
- a rank still running at ``timeout`` has its Python stack dumped from inside
  (a watchdog thread), so the error says where each rank was waiting; then
  every process is killed. No process outlives the call.

Processes come from a forkserver that has already imported torch and parallel3d (PRELOAD), so starting
8 ranks costs well under a second each even on 2 cores; rendezvous goes through
a FileStore in a fresh temporary directory, so tests need no free port and can
run in parallel.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Sequence

_CTX = None
# Imported once by the forkserver, so no rank pays for them (each rank imports the module of its worker
# function, which imports these): torch, the training application, the models, the checkpoint tools, and
# pytest (a quarter of a second a rank on its own), and torch._dynamo, which torch.optim's first optimizer
# imports (over two seconds of CPU a rank). A module that fails to import here is skipped by
# multiprocessing, and a rank that needs it imports it as before.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "parallel3d", "parallel3d.training", "parallel3d.models",
           "parallel3d.tools.generate", "pytest"]


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _stack_of_main_thread() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(no main thread frame)"
    stack = traceback.extract_stack(frame)
    # Drop the multiprocessing bootstrap frames: the story starts at the test function.
    start = next((i for i, f in enumerate(stack) if f.name == "_child"), 0)
    return "".join(traceback.format_list(stack[start + 1:]))


def _watchdog(rank: int, seconds: float, results: Any, stop: threading.Event) -> None:
    if not stop.wait(seconds):
        results.put((rank, "timeout", _stack_of_main_thread()))


def _child(fn: Callable, rank: int, world_size: int, store_dir: str, args: Sequence, timeout: float,
           results: Any, env: dict, caller: int) -> None:
    import torch
    import torch.distributed as dist

    from parallel3d.lifetime import exit_with_process

    exit_with_process(caller)  # a killed test process must not leave its ranks running
    os.environ.update(env)
    torch.set_num_threads(1)  # N ranks share 2 cores: oversubscription makes gloo crawl
    stop = threading.Event()
    # The watchdog fires a little before the parent gives up, so its stack report arrives first.
    threading.Thread(target=_watchdog, args=(rank, max(timeout - 3.0, 1.0), results, stop), daemon=True).start()
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(store_dir, 'store')}", rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
        )
        out = fn(rank, world_size, *args)
        # Tensors would travel as shared-memory handles that die with this process: send bytes.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))
    finally:
        stop.set()
        try:
            from parallel3d import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure may itself fail
            pass


@contextlib.contextmanager
def single_process_layout():
    """Model-parallel groups with TP = PP = 1 around a single-process reference built and run inside a worker:
    each rank computes the whole model alone (the TP layers refuse a job of several processes without groups,
    rather than guess). Where no other layout is initialised; the groups are destroyed after, so run the
    reference inside."""
    from parallel3d import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


class DistributedTestError(AssertionError):
    pass


def run_distributed(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    timeout: float = 120.0,
    env: dict | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return per-rank results."""
    if not 1 <= world_size <= 16:
        raise ValueError(f"world_size must be in 1..16, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="p3d_dist_") as store_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, store_dir, tuple(args), timeout, results, dict(env or {}), os.getpid()),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        grace_deadline = None
        try:
            while len(outcome) < world_size:
                now = time.monotonic()
                limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
                if now >= limit:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(0.5, limit - now))
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in outcome and not p.is_alive() and p.exitcode not in (None, 0):
                            outcome[r] = ("error", f"process exited with code {p.exitcode} without reporting")
                    continue
                if rank not in outcome or outcome[rank][0] == "timeout":
                    outcome[rank] = (status, payload)
                if status != "ok" and grace_deadline is None:
                    # The others are most likely blocked on the failed rank: give them a moment, then stop.
                    grace_deadline = time.monotonic() + 5.0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            results.close()

    failures = {r: o for r, o in outcome.items() if o[0] != "ok"}
    missing = [r for r in range(world_size) if r not in outcome]
    if failures or missing:
        lines = [f"distributed test {getattr(fn, '__name__', fn)} failed (world_size={world_size}, timeout={timeout}s)"]
        for r in sorted(failures):
            status, payload = failures[r]
            what = "raised" if status == "error" else "timed out; it was waiting in"
            lines.append(f"--- rank {r} {what}:\n{payload}")
        if missing:
            lines.append(f"--- ranks {missing} were killed (still running when the test was stopped)")
        raise DistributedTestError("\n".join(lines))
    import torch

    # weights_only=False is safe here, unlike for any file: these bytes are the return values of the
    # worker processes this call started (torch.save in _child), passed through their own queue, and
    # tests return arbitrary objects (dicts of lists, strings). Nothing read from disk comes this way.
    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]
