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

    def comm_batches(self, rank: int) -> list[list[Action]]:
        """The batches of comm actions rank issues, in order (each is one batch_isend_irecv)."""
        return [step for step in self.steps(rank) if isinstance(step, list)]

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


# --- what a schedule name stands for -----------------------------------------------------------

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


def check_megatron_args(record: ScheduleRecord, P: int, M: int, V: int, group_size: int | None) -> None:
    """Megatron's schedules' rules (stages, chunks, microbatches): a ValueError naming them, else None."""
    name = record.name
    if name == "no-pipelining" and P != 1:
        raise ValueError(f"'no-pipelining' runs the whole model on one rank, so num_stages must be 1, "
                         f"got {P}; use 'gpipe', '1f1b' or 'interleaved-1f1b' for {P} stages")
    if record.chunks != ANY_CHUNKS:
        if V not in record.chunks:
            raise ValueError(f"{name!r} uses one model chunk per rank, got num_model_chunks={V}; "
                             f"use 'interleaved-1f1b' for {V} chunks per rank, or num_model_chunks=1")
        if group_size is not None:
            raise ValueError(f"microbatch_group_size_per_vp_stage only applies to 'interleaved-1f1b', not {name!r}")
        return
    if V < 2:
        raise ValueError(f"{name!r} needs num_model_chunks >= 2, got {V}; use '1f1b' for one chunk per rank")
    if P < 2:
        raise ValueError(f"{name!r} needs num_stages >= 2, got {P}; with one stage "
                         f"use 'no-pipelining' (and num_model_chunks=1)")
    if M < record.min_microbatches(P):
        raise ValueError(
            f"{name!r} needs num_microbatches >= num_stages: each rank's chunk c+1 "
            f"consumes what the last rank's chunk c produced, which takes a group of {P} "
            f"microbatches to fill the ring; got num_microbatches={M} < num_stages={P}. "
            f"Any num_microbatches >= {P} works (or use '1f1b').")
    G = P if group_size is None else group_size
    if not P <= G <= M:
        raise ValueError(f"microbatch_group_size_per_vp_stage must be in [num_stages, num_microbatches] "
                         f"= [{P}, {M}], got {G}")


def placement_of(name: Optional[str], num_model_chunks: int = 1) -> str:
    """registry.placement_of, for pipeline/forward_backward.py and training/training.py until they import
    it from the registry (both are being edited elsewhere); then this goes."""
    from .registry import placement_of as registry_placement_of
    return registry_placement_of(name, num_model_chunks)


# --- one chunk per rank: compute order, then comm next to the compute ---------------------------
# Each order is, per rank, the ordered compute steps ("F" | "B", microbatch, chunk).
Order = list[list[tuple[str, int, int]]]


def _no_pipelining_order(P: int, M: int) -> Order:
    # Plain gradient accumulation: forward and backward each microbatch before the next.
    return [[(kind, mb, 0) for mb in range(M) for kind in ("F", "B")]]


def _gpipe_order(P: int, M: int) -> Order:
    return [[("F", mb, 0) for mb in range(M)] + [("B", mb, 0) for mb in range(M)] for _ in range(P)]


def _1f1b_order(P: int, M: int) -> Order:
    """Megatron's non-interleaved 1F1B (forward_backward_pipelining_without_interleaving)."""
    orders = []
    for rank in range(P):
        warmup = num_warmup_microbatches("1f1b", rank, P, M)
        order = [("F", mb, 0) for mb in range(warmup)]
        for i in range(M - warmup):  # steady state: one forward, one backward
            order += [("F", warmup + i, 0), ("B", i, 0)]
        order += [("B", mb, 0) for mb in range(M - warmup, M)]  # cooldown
        orders.append(order)
    return orders


def add_comm(num_stages: int, num_model_chunks: int, orders: Order, placement: str = "loop") -> list[list[Action]]:
    """Put each RECV right before the compute that needs it and each SEND right after the one
    that produced it.  Consecutive comm actions then form one batch, so a 1F1B steady state
    gets Megatron's fused send_forward_recv_backward / send_backward_recv_forward.
    W actions talk to nobody; neighbours on the same rank (the V's turn) need no message."""
    P, last = num_stages, num_stages * num_model_chunks - 1
    actions = []
    for rank, order in enumerate(orders):
        out = []
        for kind, mb, chunk in order:
            if kind == "W":
                out.append(Action(ActionKind.W, mb, chunk))
                continue
            v = virtual_stage(rank, chunk, P, placement)
            src, dst = (v - 1, v + 1) if kind == "F" else (v + 1, v - 1)
            src_rank = stage_location(src, P, placement)[0] if 0 <= src <= last else rank
            dst_rank = stage_location(dst, P, placement)[0] if 0 <= dst <= last else rank
            if src_rank != rank:
                out.append(Action(ActionKind.RECV_F if kind == "F" else ActionKind.RECV_B, mb, chunk, src_rank))
            out.append(Action(ActionKind(kind), mb, chunk))
            if dst_rank != rank:
                out.append(Action(ActionKind.SEND_F if kind == "F" else ActionKind.SEND_B, mb, chunk, dst_rank))
        actions.append(out)
    return actions


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """Forwards only (evaluation, generation): each rank runs, microbatch by microbatch,
    its chunks in order, receiving each input just before and sending each output just after.

    Nothing flows in the other direction, so the chain cannot deadlock (the executor issues
    its transfers one at a time: see ScheduleExecutor.run), and unlike the training
    schedules it works for any number of microbatches (even one).
    """
    P, M, V = schedule.num_stages, schedule.num_microbatches, schedule.num_model_chunks
    orders = [[("F", mb, chunk) for mb in range(M) for chunk in range(V)] for _ in range(P)]
    return Schedule(schedule.name + "/forward-only", P, M, V, add_comm(P, V, orders, schedule.placement),
                    schedule.placement)


# --- interleaved 1F1B ---------------------------------------------------------------------------

def interleaved_microbatch_groups(num_microbatches: int, num_stages: int,
                                  microbatch_group_size_per_vp_stage: int | None = None) -> list[range]:
    """Split microbatches into the groups that the interleaved schedule runs chunk by chunk.

    Groups have size G = microbatch_group_size_per_vp_stage (default P).  A remainder
    M % G >= P runs as its own last group (as in Megatron).  A remainder < P cannot: in a
    group smaller than P, rank 0 would need the last rank's chunk-c output before it has gone
    round the ring (Megatron refuses such M).  We fold it into the FIRST group instead, the
    only place a bigger group is safe: the warm-up is sized for the first group, and a later,
    bigger group would put some chunk's backward before its forward.
    """
    M, P = num_microbatches, num_stages
    G = P if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
    q, s = divmod(M, G)
    if s == 0:
        sizes = [G] * q
    elif s >= P:
        sizes = [G] * q + [s]
    else:
        sizes = [G + s] + [G] * (q - 1)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def interleaved_schedule_table(groups: list[range], num_model_chunks: int) -> list[tuple[int, int]]:
    """Order of (microbatch, chunk) forwards that every rank follows (Megatron's get_schedule_table).

    Within a group, each chunk runs all of the group's microbatches before the next chunk
    does.  Backwards use the same table with the chunk order reversed.  Example, groups
    [0, 1], [2, 3], V = 2:  microbatch 0 1 0 1 2 3 2 3,  chunk 0 0 1 1 0 0 1 1.
    """
    return [(mb, chunk) for group in groups for chunk in range(num_model_chunks) for mb in group]


def num_warmup_microbatches(name: str, rank: int, num_stages: int, num_microbatches: int,
                            num_model_chunks: int = 1,
                            microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """Forwards rank runs before its steady 1F1B phase (which then opens with one more forward).

    The one place for the warm-up counts: the schedule builders below and the tests read it.
    """
    P, M, V = num_stages, num_microbatches, num_model_chunks
    if name == "interleaved-1f1b":
        first_group = len(interleaved_microbatch_groups(M, P, microbatch_group_size_per_vp_stage)[0])
        # Megatron's rule: the first group through every chunk but the last, plus 2 per
        # downstream rank (one step for the forward to reach it, one for the gradient to return).
        return min((P - rank - 1) * 2 + (V - 1) * first_group, M * V)
    # 1F1B: the forwards in flight before the first backward can arrive.
    counts = {"no-pipelining": 0, "gpipe": M, "1f1b": min(P - rank - 1, M)}
    if name not in counts:
        raise ValueError(f"{name!r} has no warm-up count: it is not one of Megatron's schedules ({', '.join(counts)}, "
                         "interleaved-1f1b)")
    return counts[name]


def _interleaved_actions(num_stages: int, num_microbatches: int, num_model_chunks: int,
                         group_size: int | None) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving).

    Each rank runs steps: warm-up forwards, then (forward, backward) pairs, then cooldown
    backwards, in the table order.  After every step comes ONE comm batch, which sends what
    was produced and pre-posts the receives for the next step (Megatron's
    send_forward_backward_recv_forward_backward).  Each batch gets a global *level* such that
    the two sides of every message sit at the same level: rank r+1 runs forward i one step
    after rank r and backward k one step before it, hence "+ rank" / "- rank" below.  Levels
    rise along every rank's list, so level by level every batch finds its peers: no deadlock.
    A message is placed at the level where the receiver pre-posts it; that is also where it
    is produced, except across the ring wrap (last rank -> rank 0) in groups bigger than P,
    where the sender keeps the tensor until the receiver gets there.
    """
    P, M, V = num_stages, num_microbatches, num_model_chunks
    groups = interleaved_microbatch_groups(M, P, group_size)
    forwards = [Action(ActionKind.F, mb, chunk) for mb, chunk in interleaved_schedule_table(groups, V)]
    backwards = [Action(ActionKind.B, f.microbatch, V - 1 - f.chunk) for f in forwards]  # last chunk first
    total, last_stage = M * V, P * V - 1
    # Levels count from rank 0's uncapped warm-up so that they line up across ranks even
    # where a warm-up is capped at `total`.
    base = 2 * (P - 1) + (V - 1) * len(groups[0])

    # steps[rank] = list of (compute actions, level of the comm batch that follows them)
    steps: list[list[tuple[list[Action], int]]] = []
    for rank in range(P):
        warmup = num_warmup_microbatches("interleaved-1f1b", rank, P, M, V, group_size)
        rank_steps = [([], rank - 1 - base)]  # pre-posts the first forward's input
        rank_steps += [([forwards[i]], i + rank - base) for i in range(warmup)]
        if warmup == total and rank_steps[-1][1] < -1 - rank:
            rank_steps.append(([], -1 - rank))  # every forward was warm-up: pre-post B[0]'s gradient
        rank_steps += [([forwards[warmup + k], backwards[k]], k - rank) for k in range(total - warmup)]
        rank_steps += [([backwards[k]], k - rank) for k in range(total - warmup, total)]
        steps.append(rank_steps)

    step_of = {(rank, a): i for rank in range(P) for i, (acts, _) in enumerate(steps[rank]) for a in acts}
    batches: list[dict[int, list[Action]]] = [{level: [] for _, level in rank_steps} for rank_steps in steps]
    for (rank, a), i in step_of.items():
        v = virtual_stage(rank, a.chunk, P)
        if a.kind == "F" and v < last_stage:
            send_kind, recv_kind, other = "SEND_F", "RECV_F", v + 1
        elif a.kind == "B" and v > 0:
            send_kind, recv_kind, other = "SEND_B", "RECV_B", v - 1
        else:
            continue  # first/last virtual stage: nothing to pass on
        dst, dst_chunk = other % P, other // P
        level = steps[dst][step_of[(dst, Action(a.kind, a.microbatch, dst_chunk))] - 1][1]
        if level < steps[rank][i][1] or level not in batches[rank]:
            raise AssertionError(f"internal error: no level-{level} batch for {send_kind}{a.microbatch}"
                                 f".{a.chunk} on rank {rank} (P={P}, M={M}, V={V})")
        batches[rank][level].append(Action(send_kind, a.microbatch, a.chunk, dst))
        batches[dst][level].append(Action(recv_kind, a.microbatch, dst_chunk, rank))

    actions = []
    for rank in range(P):
        out = []
        for acts, level in steps[rank]:
            # Forward-direction ops first: with P == 2 both directions share one (src, dst)
            # pair, and NCCL matches a pair's messages in the order they were issued.
            out += acts + sorted(batches[rank][level], key=lambda a: (a.kind[-1] == "B", a.kind))
        actions.append(out)
    return actions


def _one_chunk(order: Callable[[int, int], Order]) -> Builder:
    return lambda P, M, V, G: add_comm(P, V, order(P, M))


# Megatron's schedules' builders; their records are pipeline/registry.py's.
build_no_pipelining = _one_chunk(_no_pipelining_order)
build_gpipe = _one_chunk(_gpipe_order)
build_1f1b = _one_chunk(_1f1b_order)
build_interleaved = _interleaved_actions
