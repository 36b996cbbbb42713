"""Megatron's schedules as builders (no pipelining, GPipe, 1F1B, interleaved 1F1B) with their argument
rules, and what every builder shares: ``add_comm`` puts the sends and receives next to the compute, and
``forward_only_schedule`` derives evaluation's schedule from any other. The types are in schedules.py.
"""
from __future__ import annotations

from typing import Callable

from .schedules import ANY_CHUNKS, Action, ActionKind, Builder, Schedule, ScheduleRecord, stage_location, virtual_stage


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
