"""What stops (or cleanly ends) a training run: non-finite steps, endless skipping, SIGTERM, fatal errors.

- ``StepGuard``: after each iteration, look at the averaged loss and the gradient norm
  (both already host floats, identical on every rank) and stop on a non-finite value
  (Megatron's ``--check-for-nan-in-loss-and-grad``), or skip up to
  ``--skip-nonfinite-iters`` of them; stop after ``--max-consecutive-skipped-iters``
  skipped iterations in a row (an fp16 loss scale that overflows every step); stop when the
  gradient norm is exactly 0 for ``ZERO_GRAD_STOP_ITERS`` iterations in a row (gradients that
  underflow to zero, e.g. a tiny fp16 loss scale: nothing learns, as useless as a NaN).
- ``ExitSignalHandler``: Megatron's ``--exit-signal-handler`` (remember SIGTERM, agree
  on it across ranks once per iteration).
- ``DurationLimit``: Megatron's ``--exit-duration-in-mins`` (every rank agrees to stop once the time is up).
- ``errors_as_one_line``: a script's fatal error as one ``error: rank N: ...`` line.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d import parallel_state
from parallel3d.device import default_device
from parallel3d.distributed_timeout import CommunicationError, waiting_for
from parallel3d.model_chunk import unwrap


# Iterations in a row whose gradient norm is exactly 0 before the run stops. A real model's norm is
# never exactly 0 at two steps in a row, and a few steps let a legitimately empty batch pass (all
# tokens masked); Megatron has no such check, so it follows the NaN check's switch.
ZERO_GRAD_STOP_ITERS = 5


class TrainingError(RuntimeError):
    """A stop decided by the training loop; the message is complete, a traceback would add nothing."""


def _first_nonfinite(named: Iterator[tuple[str, Optional[torch.Tensor]]]) -> Optional[str]:
    return next((name for name, t in named if t is not None and not bool(torch.isfinite(t).all())), None)


def locate_nonfinite(model: Sequence[torch.nn.Module], loss_is_finite: bool) -> str:
    """Where the non-finite values are: collective over all ranks, run only once a step went bad.

    Non-finite weights point at the earliest pipeline stage holding them (the forward runs
    first to last); a non-finite loss from finite weights at the last stage, where the loss is
    computed; non-finite gradients alone at the latest stage holding them (the backward runs
    last to first).
    """
    def params():
        for chunk in model:
            yield from unwrap(chunk).named_parameters()

    local = {"rank": dist.get_rank() if dist.is_initialized() else 0,
             "stage": parallel_state.resolve_parallel_state().pipeline_model_parallel_rank,
             "weight": _first_nonfinite((n, p.detach()) for n, p in params()),
             "grad": _first_nonfinite((n, getattr(p, "main_grad", p.grad)) for n, p in params())}
    everyone = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)

    def at(stage: int, key: Optional[str] = None) -> str:
        here = [e for e in everyone if e["stage"] == stage and (key is None or e[key])]
        first = f": {here[0][key]}" if key else ""
        return f"pipeline stage {stage} (rank {', '.join(str(e['rank']) for e in here)}{first})"

    weights = [e["stage"] for e in everyone if e["weight"]]
    if weights:
        return "first non-finite weights on " + at(min(weights), "weight")
    if not loss_is_finite:
        return ("weights finite everywhere: the forward pass produced the non-finite loss on the last "
                + at(max(e["stage"] for e in everyone)))
    grads = [e["stage"] for e in everyone if e["grad"]]
    if grads:
        return "weights and loss finite; the backward pass brings non-finite gradients from " + at(max(grads), "grad")
    return "weights, loss and local gradients finite on every rank: only the reduced gradient norm is not"


class StepGuard:
    """Per-iteration checks on host values only (no added synchronisation on the default path)."""

    def __init__(self, args: Any):  # training_config.LoopConfig, or the arguments
        self.check_nan = args.check_for_nan_in_loss_and_grad
        self.nonfinite_budget = args.skip_nonfinite_iters
        self.max_consecutive = args.max_consecutive_skipped_iters
        self.nonfinite = 0
        self.consecutive_skipped = 0
        self.consecutive_zero_grad = 0

    def check(self, iteration: int, loss: dict[str, float], grad_norm: Optional[float], skipped: bool,
              model: Sequence[torch.nn.Module], loss_scale: Optional[float] = None) -> bool:
        """True if this iteration was non-finite (then its state must not be saved); raises to stop.

        Every rank sees the same loss (all-reduced) and the same norm, so all decide alike.
        """
        values = dict(loss)
        if grad_norm is not None:
            values["grad norm"] = grad_norm
        loss_is_finite = all(math.isfinite(v) for v in loss.values())
        bad = self.check_nan and not (loss_is_finite and (grad_norm is None or math.isfinite(grad_norm)))
        if bad:
            self.nonfinite += 1
            what = ", ".join(f"{k} {v}" for k, v in values.items() if not math.isfinite(v))
            if self.nonfinite > self.nonfinite_budget:
                where = locate_nonfinite(model, loss_is_finite)
                budget = (f" ({self.nonfinite} non-finite iterations, more than --skip-nonfinite-iters "
                          f"{self.nonfinite_budget})" if self.nonfinite_budget else "")
                raise TrainingError(f"iteration {iteration}: non-finite {what}{budget}; {where}. Nothing of this "
                                    "iteration was saved. Lower --lr, check the data, or pass "
                                    "--skip-nonfinite-iters N / --no-check-for-nan-in-loss-and-grad")
            if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:  # the logging rank
                print(f"iteration {iteration}: non-finite {what}: update skipped ({self.nonfinite} of "
                      f"--skip-nonfinite-iters {self.nonfinite_budget})", flush=True)
        self.consecutive_skipped = self.consecutive_skipped + 1 if (skipped or bad) else 0
        if self.max_consecutive and self.consecutive_skipped >= self.max_consecutive:
            scale = f" with fp16 loss scale {loss_scale:g}" if loss_scale is not None else ""
            raise TrainingError(f"iteration {iteration}: the last {self.consecutive_skipped} iterations were all "
                                f"skipped{scale} (gradients overflowed or were not finite every time); lower "
                                "--loss-scale / --initial-loss-scale, check the weights for overflow, or raise "
                                "--max-consecutive-skipped-iters")
        self.consecutive_zero_grad = self.consecutive_zero_grad + 1 if grad_norm == 0.0 else 0
        if self.check_nan and self.consecutive_zero_grad >= ZERO_GRAD_STOP_ITERS:
            scale = f" (fp16 loss scale {loss_scale:g}: the scaled gradients underflow)" if loss_scale else ""
            raise TrainingError(f"iteration {iteration}: the gradient norm was exactly 0 for the last "
                                f"{self.consecutive_zero_grad} iterations{scale}: the weights no longer change. "
                                "Raise --loss-scale / --initial-loss-scale, check the loss mask and the data, or "
                                "pass --no-check-for-nan-in-loss-and-grad")
        return bad


class ExitSignalHandler:
    """Megatron's DistributedSignalHandler: a SIGTERM sets a flag; ``should_exit()`` agrees on it.

    The signal may reach ranks in different iterations, so each iteration all ranks take the
    MAX of their flags (one tiny all-reduce, only with --exit-signal-handler) and stop together.
    """

    def __init__(self, device: torch.device, sig: int = signal.SIGTERM):
        self.device, self.sig = device, sig
        self.received = False
        self.exiting = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = True

    def __enter__(self) -> "ExitSignalHandler":
        self._previous = signal.signal(self.sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.exiting:
            signal.signal(self.sig, self._previous)

    def should_exit(self) -> bool:
        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            with waiting_for("the exit-signal all-reduce (--exit-signal-handler)", "all ranks"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                flag = flag.item()  # NCCL: the host waits here
        self.exiting = bool(flag)
        if self.exiting:
            # From here on ignore the signal at the OS level (a Python handler is reset when the interpreter
            # shuts down): a second SIGTERM, the launcher's or one reaching this rank after the others agreed
            # to stop, must not kill the process between the save and its exit code 0.
            signal.signal(self.sig, signal.SIG_IGN)
        return self.exiting


class DurationLimit:
    """--exit-duration-in-mins: True on every rank once any rank's clock passed the limit (an all-reduce MAX,
    so all ranks stop after the same iteration and save together)."""

    def __init__(self, minutes: Optional[float], start: Optional[float] = None) -> None:
        self.minutes = minutes
        self.start = time.monotonic() if start is None else start

    def reached(self) -> bool:
        if self.minutes is None:
            return False
        over = torch.tensor([int((time.monotonic() - self.start) / 60.0 >= self.minutes)], device=default_device())
        if dist.is_initialized():
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
        return bool(over.item())


@contextlib.contextmanager
def errors_as_one_line() -> Iterator[None]:
    """Turn an exception into one ``error: rank N: ...`` line on stderr and exit 1.

    Each rank of a failed run would otherwise print a full traceback (eight ranks: eight of them,
    interleaved). ``PARALLEL3D_DEBUG=1`` lets the exception propagate with its traceback.
    """
    try:
        yield
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: one line, not a traceback per rank
        if os.environ.get("PARALLEL3D_DEBUG", "") not in ("", "0"):
            raise
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        kind = "" if isinstance(e, (TrainingError, CommunicationError)) else f"{type(e).__name__}: "
        text = " ".join(str(e).split()) or "(no message)"
        # One write: print() writes the text and its newline apart, and ranks sharing stderr interleave them.
        sys.stderr.write(f"error: rank {rank}: {kind}{text} (PARALLEL3D_DEBUG=1 shows the traceback)\n")
        sys.stderr.flush()
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)
