"""Pipeline schedules as data: per pipeline rank, an ordered list of actions.

A schedule says, for every pipeline rank, which forward (F) and backward (B)
steps to run for which (microbatch, local model chunk), and where the
point-to-point sends/receives go.  The executor runs each rank's list in
order; every maximal run of consecutive communication actions is issued as
ONE ``torch.distributed.batch_isend_irecv`` call and waited on before going
on.  ``parallel3d.pipeline.simulate.validate`` checks that a schedule is
complete, correctly matched and deadlock-free under exactly that model.

Virtual stages follow Megatron: virtual stage ``v = chunk * P + rank`` lives
on ``rank`` as its local model chunk ``chunk``.  A microbatch's forward runs
through v = 0 .. V*P-1 (stage v's output goes to rank ``(rank + 1) % P``; on
the last rank it wraps to rank 0, chunk + 1); its backward runs in reverse.
Virtual stage 0 reads data, virtual stage V*P-1 computes the loss.

The zero-bubble schedules (parallel3d.pipeline.zero_bubble) split the backward into B (the
input gradient, on the critical path) and W (the weight gradient, free to fill bubbles), and
the V-shaped ones place a rank's two chunks as ``placement="v"``: chunk 0 is virtual stage
``rank``, chunk 1 is virtual stage ``2P-1-rank`` (so rank 0 holds both the first and the last).

This module holds the types (actions, schedules, the record of a schedule name, placements); the
builders are in builders.py (Megatron's) and zero_bubble.py, the names in registry.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional


class ActionKind(str, Enum):
    """What an action does. A str enum, so ``action.kind == "F"`` reads as the printed schedule."""

    F = "F"            # forward of (microbatch, chunk)
    B = "B"            # backward of it (the input gradient only, where the schedule has W actions)
    W = "W"            # weight gradient of it: runs the GEMMs that B deferred
    SEND_F = "SEND_F"  # send its output to the next virtual stage
    RECV_F = "RECV_F"  # receive its input from the previous one
    SEND_B = "SEND_B"  # send its input gradient back
    RECV_B = "RECV_B"  # receive its output gradient

    def __str__(self) -> str:
        return self.value

    @property
    def is_comm(self) -> bool:
        return self not in (ActionKind.F, ActionKind.B, ActionKind.W)


class ScheduleError(ValueError):
    """A schedule is incomplete, mismatched or would deadlock."""


PLACEMENTS = ("loop", "v")


def virtual_stage(rank: int, chunk: int, num_stages: int, placement: str = "loop") -> int:
    """The virtual stage of local ``chunk`` on pipeline ``rank``.

    "loop" (Megatron's interleaving): chunk * P + rank.  "v" (ZB-V, DualPipeV): chunk 0 is stage
    rank, chunk 1 is stage 2P-1-rank, so the model goes down the ranks and back up.
    """
    if placement == "v":
        return rank if chunk == 0 else 2 * num_stages - 1 - rank
    return chunk * num_stages + rank


def stage_location(v: int, num_stages: int, placement: str = "loop") -> tuple[int, int]:
    """(rank, local chunk) that holds virtual stage v (the inverse of virtual_stage)."""
    if placement == "v":
        return (v, 0) if v < num_stages else (2 * num_stages - 1 - v, 1)
    return v % num_stages, v // num_stages


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int
    chunk: int  # local model chunk index on this rank (0..V-1)
    peer: Optional[int] = None  # pipeline rank on the other side of a SEND_*/RECV_*

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ActionKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown action kind {self.kind!r}; valid kinds: {tuple(k.value for k in ActionKind)}") from None
        if self.is_comm and self.peer is None:
            raise ValueError(f"{self.kind}{self.microbatch}.{self.chunk} needs a peer rank")
        if not self.is_comm and self.peer is not None:
            raise ValueError(f"compute action {self.kind}{self.microbatch}.{self.chunk} takes no peer")

    @property
    def is_comm(self) -> bool:
        return self.kind.is_comm

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class Schedule:
    """Immutable (its action lists become tuples), so one cached schedule can serve every caller."""

    name: str
    num_stages: int
    num_microbatches: int
    num_model_chunks: int
    actions: tuple[tuple[Action, ...], ...]  # actions[rank] = ordered actions of that pipeline rank
    placement: str = "loop"  # which virtual stage each (rank, chunk) is: see virtual_stage()

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(rank_actions) for rank_actions in self.actions))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return virtual_stage(rank, chunk, self.num_stages, self.placement)

    def stage_location(self, v: int) -> tuple[int, int]:
        return stage_location(v, self.num_stages, self.placement)

    @property
    def splits_backward(self) -> bool:
        """True when backward is split into B (input gradient) and W (weight gradient) actions."""
        return any(a.kind == ActionKind.W for rank_actions in self.actions for a in rank_actions)

    def steps(self, rank: int) -> list[Action | list[Action]]:
        """Rank's actions with each maximal run of comm actions grouped into one list (one batch)."""
        out: list[Action | list[Action]] = []
        for action in self.actions[rank]:
            if not action.is_comm:
                out.append(action)
            elif out and isinstance(out[-1], list):
                out[-1].append(action)
            else:
                out.append([action])
        return out

    def __str__(self) -> str:
        header = (f"{self.name}: {self.num_stages} stages, {self.num_microbatches} microbatches, "
                  f"{self.num_model_chunks} model chunk(s) per rank; [..] = one comm batch")
        rows = [header]
        for rank in range(self.num_stages):
            cells = []
            for step in self.steps(rank):
                if isinstance(step, list):
                    cells.append("[" + " ".join(f"{a}{'>' if a.kind.startswith('SEND') else '<'}{a.peer}"
                                                for a in step) + "]")
                else:
                    cells.append(str(step))
            rows.append(f"rank {rank}: " + " ".join(cells))
        return "\n".join(rows)


# --- what a schedule name stands for (pipeline/registry.py holds one record per name) ------------

Builder = Callable[[int, int, int, Optional[int]], list[list[Action]]]  # (P, M, V, group size) -> actions
ANY_CHUNKS = range(2, 2 ** 31)  # interleaved 1F1B: any number of model chunks >= 2


@dataclass(frozen=True)
class ScheduleRecord:
    """Everything the rest of parallel3d may know about one schedule name (pipeline/registry.py holds them)."""

    name: str
    build: Optional[Builder]  # None: 'auto', which picks among the auto_candidate records
    check: Callable[["ScheduleRecord", int, int, int, Optional[int]], None]  # its rules: a ValueError naming them
    chunks: range = range(1, 2)  # model chunks per rank it runs; the first is the default
    placement: Optional[str] = "loop"  # "v": a rank's two chunks in a V (virtual_stage); None: its pick's
    splits_backward: bool = False  # B (input gradient) and W (weight gradient) actions: zero bubble
    min_microbatches: Callable[[int], int] = lambda P: 1  # of the number of stages
    auto_candidate: bool = False  # 'auto' simulates it
