"""Zero-bubble schedules (Qi et al., ICLR 2024) and DeepSeek's DualPipeV, as data.

Backward is split into B (the input gradient, which the previous stage waits for) and W (the
weight gradient, which nobody waits for), so W can fill the bubbles that 1F1B leaves idle.

- ``zb-h1``: 1F1B's memory.  Stage i runs P-i warm-up forwards and lets its W lag i
  microbatches behind its B; the lagging W fill the cool-down.  Bubble (P-1)(T_F+T_B-T_W).
- ``zb-h2``: up to 2P-1-2i forwards in flight on stage i (2P-1 on stage 0); each rank runs B
  when a gradient is there, else F when memory allows, else a pending W (the order is built
  for T_F = T_B = T_W and kept for any times).  Bubble (P-1)(T_F+T_B-2T_W) for M >= 2P.
- ``zb-v``: two chunks per rank in a V (placement "v"), the same greedy rule with at most 2P
  chunk forwards in flight per rank (1F1B's activation memory: a chunk is half a stage).
- ``dualpipev``: DeepSeek's DualPipe in its V form (github.com/deepseek-ai/DualPipe,
  dualpipev.py): eight phases per rank whose main loop pairs the forward of one microbatch on
  one chunk with the backward of another on the other chunk.  Here the pair is two
  consecutive compute actions whose transfers share one comm batch before and one after.

Every order is turned into a schedule the same way (``with_comm``): the orders are timed as a
dataflow, each message gets the time its producer ends as its *level*, and both sides place
it after every compute that starts before that level.  Levels rise along every rank's list,
so, as for interleaved 1F1B, level by level every batch finds its peers; ``validate`` checks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .builders import add_comm
from .schedules import Action, ActionKind, Builder, Schedule, ScheduleRecord, stage_location, virtual_stage

Step = tuple[str, int, int]  # (kind "F" | "B" | "W", microbatch, chunk)
Times = tuple[float, float, float]  # (forward, backward = input gradient, weight gradient)


def _dependencies(step: Step, rank: int, P: int, V: int, placement: str) -> list[tuple[int, Step]]:
    """(rank, step) that must finish before ``step`` runs on ``rank``."""
    kind, mb, chunk = step
    if kind == "W":
        return [(rank, ("B", mb, chunk))]
    v, last = virtual_stage(rank, chunk, P, placement), P * V - 1
    other, deps = (v - 1, []) if kind == "F" else (v + 1, [(rank, ("F", mb, chunk))])
    if 0 <= other <= last:
        src_rank, src_chunk = stage_location(other, P, placement)
        deps.append((src_rank, (kind, mb, src_chunk)))
    return deps


def time_orders(orders: Sequence[Sequence[Step]], P: int, V: int, placement: str, times: Times,
                comm_time: float = 0.0) -> dict[tuple[int, Step], tuple[float, float]]:
    """(start, end) of every step when each rank runs its order as early as its inputs allow.

    A depth-first walk: a step starts when the step before it on its rank and the steps it
    consumes (plus comm_time from another rank) have ended.
    """
    cost = {"F": times[0], "B": times[1], "W": times[2]}
    index = {(r, step): k for r, order in enumerate(orders) for k, step in enumerate(order)}

    def inputs(node: tuple[int, Step]) -> list[tuple[int, Step]]:
        r, step = node
        k = index[node]
        return ([(r, orders[r][k - 1])] if k else []) + _dependencies(step, r, P, V, placement)

    span: dict[tuple[int, Step], tuple[float, float]] = {}
    for root in index:
        stack, entered = [root], set()
        while stack:
            node = stack[-1]
            missing = [d for d in inputs(node) if d not in span] if node not in span else []
            if missing:
                if node in entered:
                    raise ValueError(f"internal error: rank {node[0]} waits forever at {node[1]} (cyclic order)")
                entered.add(node)
                stack += missing
                continue
            stack.pop()
            if node not in span:
                start = max([0.0] + [span[d][1] + (comm_time if d[0] != node[0] else 0.0) for d in inputs(node)])
                span[node] = (start, start + cost[node[1][0]])
    return span


def with_comm(orders: Sequence[Sequence[Step]], P: int, V: int, placement: str,
              times: Times = (1.0, 1.0, 1.0)) -> list[list[Action]]:
    """The orders with every SEND/RECV placed by level (see the module doc)."""
    span = time_orders(orders, P, V, placement, times)
    # per rank: (level, sort key, action) of every comm op
    comms: list[list[tuple[float, tuple, Action]]] = [[] for _ in range(P)]
    for (rank, step), (_, end) in span.items():
        kind, mb, chunk = step
        if kind == "W":
            continue
        v = virtual_stage(rank, chunk, P, placement)
        other = v + 1 if kind == "F" else v - 1
        if not 0 <= other <= P * V - 1:
            continue
        dst, dst_chunk = stage_location(other, P, placement)
        if dst == rank:
            continue  # the V's turn: both stages on this rank, nothing to send
        send, recv = (ActionKind.SEND_F, ActionKind.RECV_F) if kind == "F" else (ActionKind.SEND_B, ActionKind.RECV_B)
        # Forward-direction ops first at equal level: with P == 2 both directions share one
        # (src, dst) pair, and NCCL matches a pair's messages in the order they were issued.
        key = (end, kind != "F", mb, v)
        comms[rank].append((end, key, Action(send, mb, chunk, dst)))
        comms[dst].append((end, key, Action(recv, mb, dst_chunk, rank)))
    actions = []
    for rank in range(P):
        computes = sorted(orders[rank], key=lambda s: span[(rank, s)][0])
        if computes != list(orders[rank]):
            raise ValueError(f"internal error: rank {rank}'s order is not in time order")
        pending = sorted(comms[rank], key=lambda c: c[1])
        out: list[Action] = []
        k = 0
        for step in computes:
            start = span[(rank, step)][0]
            while k < len(pending) and pending[k][0] <= start:
                out.append(pending[k][2])
                k += 1
            out.append(Action(ActionKind(step[0]), step[1], step[2]))
        out += [c[2] for c in pending[k:]]
        actions.append(out)
    return actions


def hoist_receives_over_w(schedule: Schedule) -> Schedule:
    """The schedule with every RECV moved before the W steps that precede its compute.

    With variable_seq_lengths a batch first exchanges the shape headers of its forward
    transfers and waits for them, so its sends then wait for receives a peer may only post
    after a batch of its own that waits for us (ZB-H1: rank 0 sends F and awaits B in one
    batch, rank 1 sends that B, runs a W, then receives the F).  Hoisting the receive over
    the W puts it in the batch of the send before: both directions pair up in one batch.
    """
    actions = []
    for rank_actions in schedule.actions:
        out: list[Action] = []
        for a in rank_actions:
            at = len(out)
            while a.kind.startswith("RECV") and at > 0 and out[at - 1].kind == ActionKind.W:
                at -= 1
            out.insert(at, a)
        actions.append(out)
    return dataclasses.replace(schedule, actions=actions)


# --- ZB-H1: handcrafted -------------------------------------------------------------------------

def zb_h1_orders(P: int, M: int) -> list[list[Step]]:
    """Stage i: P-i warm-up forwards, then B_j, W_{j-i}, F_{j+P-i} per step, then the lagging W."""
    orders = []
    for i in range(P):
        warmup, lag = min(P - i, M), i
        order: list[Step] = [("F", mb, 0) for mb in range(warmup)]
        done_w = 0
        for j in range(M):
            order.append(("B", j, 0))
            if j - lag >= 0:
                order.append(("W", j - lag, 0))
                done_w += 1
            if j + warmup < M:
                order.append(("F", j + warmup, 0))
        order += [("W", mb, 0) for mb in range(done_w, M)]
        orders.append(order)
    return orders


# --- greedy: B if a gradient is there, else F if memory allows, else W ----------------------------

def greedy_orders(P: int, M: int, V: int, placement: str, limits: Sequence[int], held_limit: int,
                  times: Times = (1.0, 1.0, 1.0), comm_time: float = 0.0) -> list[list[Step]]:
    """List-schedule every rank in time order (the zero-bubble paper's heuristic).

    ``limits[r]``: most chunk forwards rank r may hold that have not run their B; ``held_limit``:
    most that have not run their W (what bounds memory: W needs the inputs too).  Among
    ready B, the later virtual stage first (it frees the rank's memory sooner and feeds the
    V's turn); among ready F, the later chunk first (it finishes a microbatch sooner).
    """
    cost = {"F": times[0], "B": times[1], "W": times[2]}
    end: dict[tuple[int, Step], float] = {}
    orders: list[list[Step]] = [[] for _ in range(P)]
    free = [0.0] * P
    next_f = [[0] * V for _ in range(P)]
    inflight, held, waiting_w = [0] * P, [0] * P, [[] for _ in range(P)]
    b_done: set[tuple[int, int, int]] = set()
    total = 3 * M * V

    def ready(r: int, step: Step, now: float) -> bool:
        return all(d in end and end[d] + (comm_time if d[0] != r else 0.0) <= now
                   for d in _dependencies(step, r, P, V, placement))

    while any(len(o) < total for o in orders):
        now = min(free[r] for r in range(P) if len(orders[r]) < total)
        moved = False
        for r in range(P):
            if len(orders[r]) == total or free[r] != now:
                continue
            choice = None
            for chunk in sorted(range(V), key=lambda c: -virtual_stage(r, c, P, placement)):
                mbs = [mb for mb in range(next_f[r][chunk]) if (r, mb, chunk) not in b_done]
                if mbs and ready(r, ("B", mbs[0], chunk), now):
                    choice = ("B", mbs[0], chunk)
                    break
            if choice is None and inflight[r] < limits[r] and held[r] < held_limit:
                for chunk in sorted(range(V), key=lambda c: -c):
                    mb = next_f[r][chunk]
                    if mb < M and ready(r, ("F", mb, chunk), now):
                        choice = ("F", mb, chunk)
                        break
            if choice is None and waiting_w[r]:
                choice = waiting_w[r].pop(0)
            if choice is None:
                continue
            kind, mb, chunk = choice
            orders[r].append(choice)
            end[(r, choice)] = free[r] = now + cost[kind]
            moved = True
            if kind == "F":
                next_f[r][chunk] += 1
                inflight[r] += 1
                held[r] += 1
            elif kind == "B":
                b_done.add((r, mb, chunk))
                inflight[r] -= 1
                waiting_w[r].append(("W", mb, chunk))
            else:
                held[r] -= 1
        if not moved:  # every rank due now waits: jump to the next time anything can change
            later = [t for t in free if t > now] + [t + comm_time for t in end.values() if t + comm_time > now]
            if not later:
                raise ValueError(f"no schedule within the memory limits {list(limits)} (P={P}, M={M}, V={V})")
            step_to = min(later)
            free = [step_to if f == now else f for f in free]
    return orders


def zb_h2_orders(P: int, M: int) -> list[list[Step]]:
    return greedy_orders(P, M, 1, "loop", [2 * P - 1 - 2 * r for r in range(P)], 2 * P - 1)


def zb_v_orders(P: int, M: int) -> list[list[Step]]:
    return greedy_orders(P, M, 2, "v", [2 * P] * P, 2 * P)


# --- DualPipeV ------------------------------------------------------------------------------------

def dualpipev_orders(P: int, M: int) -> list[list[Step]]:
    """DeepSeek's dualpipev.py phases for rank r (chunk 0 goes down the V, chunk 1 comes back up).

    A backward "with W" is B immediately followed by its W; the zero-bubble backwards (second
    half of phase 6 and phase 7) leave their W to phases 7-8, in order.
    """
    orders = []
    for r in range(P):
        order: list[Step] = []
        nf = [0, 0]  # next microbatch to forward, per chunk
        nb = [0, 0]
        deferred: list[Step] = []

        def f(c: int) -> None:
            order.append(("F", nf[c], c))
            nf[c] += 1

        def b(c: int, defer_w: bool = False) -> None:
            order.append(("B", nb[c], c))
            (deferred.append if defer_w else order.append)(("W", nb[c], c))
            nb[c] += 1

        for _ in range((P - r - 1) * 2):       # 1: chunk-0 forwards fill the down stroke
            f(0)
        for _ in range(r + 1):                 # 2: forwards of both chunks
            f(0)
            f(1)
        for _ in range(P - r - 1):             # 3: zero-bubble B of chunk 1 (W right after), F of chunk 1
            b(1)
            f(1)
        for _ in range(M - 2 * P + r + 1):     # 4: main loop, F and B of different chunks paired
            f(0)
            b(1)
            f(1)
            b(0)
        for _ in range(P - r - 1):             # 5
            b(1)
            f(1)
            b(0)
        steps6, zb = r + 1, False              # 6: backwards only; the second half defers W
        for i in range(steps6):
            # DeepSeek switches between the two chunks' backwards on even ranks, before them on odd.
            zb = zb or (i == steps6 // 2 and r % 2 == 1)
            b(1, defer_w=zb)
            zb = zb or (i == steps6 // 2 and r % 2 == 0)
            b(0, defer_w=zb)
        for _ in range(P - r - 1):             # 7: a deferred W, then a zero-bubble B of chunk 0
            if deferred:
                order.append(deferred.pop(0))
            b(0, defer_w=True)
        order += deferred                      # 8: what is left
        orders.append(order)
    return orders


def _builder(order, placement: str, V: int) -> Builder:
    # One chunk: comm next to the compute, as 1F1B (times every order exactly as built).
    # The V: two flows share each pair of ranks, so their messages are ordered by level.
    if V == 1:
        return lambda P, M, _V, G: add_comm(P, V, order(P, M), placement)
    return lambda P, M, _V, G: with_comm(order(P, M), P, V, placement)


# The zero-bubble schedules' builders; their records are pipeline/registry.py's.
build_zb_h1 = _builder(zb_h1_orders, "loop", 1)
build_zb_h2 = _builder(zb_h2_orders, "loop", 1)
build_zb_v = _builder(zb_v_orders, "v", 2)
build_dualpipev = _builder(dualpipev_orders, "v", 2)


def check_zero_bubble_args(record: ScheduleRecord, P: int, M: int, V: int, group_size: int | None) -> None:
    """The zero-bubble schedules' (and 'auto''s) rules: a ValueError naming them, else None."""
    name = record.name
    if group_size is not None:
        raise ValueError(f"microbatch_group_size_per_vp_stage only applies to 'interleaved-1f1b', not {name!r}")
    if P < 2:
        raise ValueError(f"{name!r} needs num_stages >= 2, got {P}; with one stage use 'no-pipelining'")
    if V not in record.chunks:
        raise ValueError(f"{name!r} runs {' or '.join(map(str, record.chunks))} model chunk(s) per rank, got "
                         f"num_model_chunks={V}" + ("; the V needs exactly two" if record.placement == "v" else ""))
    if M < record.min_microbatches(P):
        raise ValueError(f"{name!r} needs num_microbatches >= 2 * num_stages = {2 * P} (its main loop "
                         f"pairs microbatches from both arms of the V), got {M}; use 'zb-v' for fewer")
