"""Validate and time pipeline schedules without running any model.

Execution model (the one the executor implements):
- each rank runs its action list in order; compute actions (F, B) never block;
- a maximal run of consecutive comm actions is one batch (one batch_isend_irecv); the rank
  posts all of it and blocks until every op in it is matched;
- a send and a receive match when both sides have posted them, i.e. the peer is blocked on
  the batch that holds the matching op (rendezvous; conservative, like NCCL for big messages);
- the k-th send from rank A to rank B matches the k-th receive at B from A.  NCCL has no
  tags, so this FIFO is per (src, dst) across both directions; the pair must also agree on
  direction, microbatch and virtual stage, or the wrong tensor would arrive silently.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from parallel3d.pipeline.schedules import Action, Schedule, ScheduleError

Slot = tuple[int, int]  # (rank, index into that rank's action list)


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank} action #{index} {action}"


@dataclass(frozen=True)
class _Where:
    rank: int
    index: int
    action: Action

    def __str__(self) -> str:
        return _where(self.rank, self.index, self.action)


def _check_shape(schedule: Schedule) -> None:
    P, M, V = schedule.num_stages, schedule.num_microbatches, schedule.num_model_chunks
    if len(schedule.actions) != P:
        raise ScheduleError(f"schedule has action lists for {len(schedule.actions)} ranks, "
                            f"expected num_stages={P}")
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if not 0 <= a.microbatch < M:
                raise ScheduleError(f"{_where(rank, i, a)}: microbatch {a.microbatch} is outside 0..{M - 1}")
            if not 0 <= a.chunk < V:
                raise ScheduleError(f"{_where(rank, i, a)}: chunk {a.chunk} is outside 0..{V - 1}")
            if a.is_comm and not 0 <= a.peer < P:
                raise ScheduleError(f"{_where(rank, i, a)}: peer {a.peer} is outside 0..{P - 1}")


def _check_rank_order(schedule: Schedule, rank: int) -> None:
    """Each (microbatch, chunk) forwarded then backwarded exactly once, inputs present, peers right."""
    P, M, V = schedule.num_stages, schedule.num_microbatches, schedule.num_model_chunks
    last = P * V - 1
    done: dict[str, set[tuple[int, int]]] = {"F": set(), "B": set(), "W": set()}
    received: dict[str, set[tuple[int, int]]] = {"RECV_F": set(), "RECV_B": set()}
    consumed: dict[str, set[tuple[int, int]]] = {"RECV_F": set(), "RECV_B": set()}
    sent: dict[str, set[tuple[int, int]]] = {"SEND_F": set(), "SEND_B": set()}

    for i, a in enumerate(schedule.actions[rank]):
        key, v = (a.microbatch, a.chunk), schedule.virtual_stage(rank, a.chunk)
        here = _Where(rank, i, a)  # formatted only if an error is raised
        if a.kind == "W":
            if key in done["W"]:
                raise ScheduleError(f"{here}: weight gradient of microbatch {a.microbatch} chunk {a.chunk} runs twice")
            if key not in done["B"]:
                raise ScheduleError(f"{here}: weight gradient before its backward B{a.microbatch}.{a.chunk}")
            done["W"].add(key)
        elif not a.is_comm:
            forward = a.kind == "F"
            if key in done[a.kind]:
                raise ScheduleError(f"{here}: {'forward' if forward else 'backward'} of microbatch {a.microbatch} "
                                    f"chunk {a.chunk} runs twice")
            if not forward and key not in done["F"]:
                raise ScheduleError(f"{here}: backward before its forward F{a.microbatch}.{a.chunk}")
            # A forward needs the previous virtual stage's output, a backward the next one's gradient.
            src_v, recv = (v - 1, "RECV_F") if forward else (v + 1, "RECV_B")
            if 0 <= src_v <= last:
                src_rank, src_chunk = schedule.stage_location(src_v)
                if src_rank == rank and (a.microbatch, src_chunk) not in done[a.kind]:
                    raise ScheduleError(f"{here}: needs {a.kind}{a.microbatch}.{src_chunk} earlier on this rank")
                if src_rank != rank:
                    if key not in received[recv] or key in consumed[recv]:
                        raise ScheduleError(f"{here}: needs the {'output' if forward else 'output gradient'} of "
                                            f"virtual stage {src_v} (rank {src_rank}), but no {recv}"
                                            f"{a.microbatch}.{a.chunk} precedes it")
                    consumed[recv].add(key)
            done[a.kind].add(key)
        else:
            forward = a.kind.endswith("_F")
            # The other side of this message: the next virtual stage for forward sends and
            # backward receives, the previous one otherwise.
            toward_next = forward == a.kind.startswith("SEND")
            other_v = v + 1 if toward_next else v - 1
            if not 0 <= other_v <= last:
                raise ScheduleError(f"{here}: virtual stage {v} has no {'next' if toward_next else 'previous'} "
                                    f"stage to talk to")
            other_rank = schedule.stage_location(other_v)[0]
            if other_rank == rank:
                raise ScheduleError(f"{here}: virtual stage {other_v} is on this same rank; no message needed")
            if a.peer != other_rank:
                raise ScheduleError(f"{here}: peer is rank {a.peer}, but virtual stage {other_v} lives "
                                    f"on rank {other_rank}")
            if a.kind.startswith("SEND"):
                producer = "F" if forward else "B"
                if key not in done[producer]:
                    raise ScheduleError(f"{here}: sends before {producer}{a.microbatch}.{a.chunk} has run")
                if key in sent[a.kind]:
                    raise ScheduleError(f"{here}: sent twice")
                sent[a.kind].add(key)
            else:
                if key in received[a.kind]:
                    raise ScheduleError(f"{here}: received twice")
                received[a.kind].add(key)

    # A schedule that splits backward must run every W (else weight gradients go missing).
    for kind in ("F", "B", "W") if schedule.splits_backward else ("F", "B"):
        missing = sorted({(mb, c) for mb in range(M) for c in range(V)} - done[kind])
        if missing:
            mb, c = missing[0]
            raise ScheduleError(f"rank {rank} never runs {kind}{mb}.{c} "
                                f"({len(missing)} {kind} steps missing in all)")
    for kind in ("RECV_F", "RECV_B"):
        unused = sorted(received[kind] - consumed[kind])
        if unused:
            mb, c = unused[0]
            raise ScheduleError(f"rank {rank}: {kind}{mb}.{c} is received but no compute uses it")


def _match_messages(schedule: Schedule) -> dict[Slot, Slot]:
    """Pair every send with its receive (FIFO per (src, dst)) and check they carry the same thing."""
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.kind.startswith("SEND"):
                sends.setdefault((rank, a.peer), []).append(i)
            elif a.kind.startswith("RECV"):
                recvs.setdefault((a.peer, rank), []).append(i)

    partner: dict[Slot, Slot] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, (si, ri) in enumerate(zip(s_list, r_list)):
            s, r = schedule.actions[src][si], schedule.actions[dst][ri]
            s_v, r_v = schedule.virtual_stage(src, s.chunk), schedule.virtual_stage(dst, r.chunk)
            step = 1 if s.kind == "SEND_F" else -1
            if s.kind[-1] != r.kind[-1] or s.microbatch != r.microbatch or s_v + step != r_v:
                raise ScheduleError(
                    f"{_where(src, si, s)} (message #{k} from rank {src} to rank {dst}, microbatch "
                    f"{s.microbatch} from virtual stage {s_v}) is matched by {_where(dst, ri, r)} "
                    f"(expects microbatch {r.microbatch} {'from' if r.kind == 'RECV_F' else 'for'} "
                    f"virtual stage {r_v}): the wrong tensor would arrive")
            partner[(src, si)] = (dst, ri)
            partner[(dst, ri)] = (src, si)
        if len(s_list) > len(r_list):
            si = s_list[len(r_list)]
            raise ScheduleError(f"{_where(src, si, schedule.actions[src][si])}: no matching receive on rank "
                                f"{dst} ({len(s_list)} sends from rank {src} to {dst}, {len(r_list)} receives)")
        if len(r_list) > len(s_list):
            ri = r_list[len(s_list)]
            raise ScheduleError(f"{_where(dst, ri, schedule.actions[dst][ri])}: no matching send on rank "
                                f"{src} ({len(s_list)} sends from rank {src} to {dst}, {len(r_list)} receives)")
    return partner


def _batch_ends(actions: list[Action]) -> list[int]:
    """ends[i] = index one past the comm batch that starts at i (only meaningful at batch starts)."""
    ends = [0] * len(actions)
    end = len(actions)
    for i in range(len(actions) - 1, -1, -1):
        if not actions[i].is_comm:
            end = i
        ends[i] = end if actions[i].is_comm else i + 1
    return ends


def _run(schedule: Schedule, partner: dict[Slot, Slot], duration: Callable[[int, Action], float],
         comm_time: float, sends_block: bool,
         headers: bool = False) -> tuple[list[list[tuple[float, float, Action]]], list[float]]:
    """Execute the schedule under the rendezvous model; raise ScheduleError on deadlock.

    ``headers``: the executor with variable_seq_lengths, where a batch first exchanges the shape
    headers of its forward-direction transfers (a round of its own) and only then the data.

    Returns per-rank compute timelines and each rank's finish time.  The result does not
    depend on the order ranks are visited in: posting never un-happens, so progress is monotone.
    """
    P = schedule.num_stages
    acts = schedule.actions
    ends = [_batch_ends(a) for a in acts]
    pc, clock = [0] * P, [0.0] * P
    posted: dict[Slot, float] = {}  # comm op -> time its rank reached its batch
    header_posted: set[Slot] = set()
    timelines: list[list[tuple[float, float, Action]]] = [[] for _ in range(P)]

    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pc[r] < len(acts[r]):
                a = acts[r][pc[r]]
                if not a.is_comm:
                    d = duration(r, a)
                    timelines[r].append((clock[r], clock[r] + d, a))
                    clock[r] += d
                    pc[r] += 1
                    progress = True
                    continue
                batch = range(pc[r], ends[r][pc[r]])
                negotiated = [i for i in batch if headers and acts[r][i].kind.endswith("_F")]
                header_posted.update((r, i) for i in negotiated)
                if any(partner[(r, i)] not in header_posted for i in negotiated):
                    break  # the header round waits for every peer's header round
                for i in batch:
                    posted.setdefault((r, i), clock[r])
                # Without sends_block (the paper's model: a transfer never holds up its sender),
                # only receives wait for their peers.
                waits = [i for i in batch if sends_block or acts[r][i].kind.startswith("RECV")]
                if any(partner[(r, i)] not in posted for i in waits):
                    break  # blocked until the peers post their side
                clock[r] = max([clock[r]] + [max(posted[(r, i)], posted[partner[(r, i)]]) + comm_time
                                             for i in waits])
                pc[r] = batch.stop
                progress = True

    if any(pc[r] < len(acts[r]) for r in range(P)):
        raise ScheduleError(_deadlock_report(schedule, partner, pc, ends, posted))
    return timelines, clock


def _deadlock_report(schedule: Schedule, partner: dict[Slot, Slot], pc: list[int],
                     ends: list[list[int]], posted: dict[Slot, float]) -> str:
    lines = [f"{schedule.name} deadlocks: every unfinished rank is blocked in a comm batch"]
    for r in range(schedule.num_stages):
        if pc[r] >= len(schedule.actions[r]):
            continue
        for i in range(pc[r], ends[r][pc[r]]):
            pr, pi = partner[(r, i)]
            if (pr, pi) in posted:
                continue
            peer_at = pc[pr]
            peer_state = ("finished" if peer_at >= len(schedule.actions[pr]) else
                          f"blocked at #{peer_at} {schedule.actions[pr][peer_at]}")
            lines.append(f"  {_where(r, i, schedule.actions[r][i])} waits for rank {pr} #{pi} "
                         f"{schedule.actions[pr][pi]}, but rank {pr} is {peer_state}")
            break
    return "\n".join(lines)


def _check_and_match(schedule: Schedule) -> dict[Slot, Slot]:
    _check_shape(schedule)
    for rank in range(schedule.num_stages):
        _check_rank_order(schedule, rank)
    return _match_messages(schedule)


def _check_batches_pair_up(schedule: Schedule, partner: dict[Slot, Slot]) -> None:
    """What one batch sends to a peer, the peer receives in one batch (and vice versa).

    The executor may exchange shape headers in a batch of their own before the data
    (variable_seq_lengths); on a backend that matches a pair's messages in order (NCCL)
    the headers and data of two batches must then not interleave differently on the
    two sides, which this rules out.
    """
    batch_of: dict[Slot, int] = {}
    for rank in range(schedule.num_stages):
        b, prev_comm = -1, False
        for i, a in enumerate(schedule.actions[rank]):
            if a.is_comm and not prev_comm:
                b += 1
            prev_comm = a.is_comm
            if a.is_comm:
                batch_of[(rank, i)] = b
    seen: dict[tuple[int, int, int, bool], tuple[int, Slot]] = {}
    for (rank, i), (peer, j) in partner.items():
        key = (rank, batch_of[(rank, i)], peer, schedule.actions[rank][i].kind.startswith("SEND"))
        other = batch_of[(peer, j)]
        if key in seen and seen[key][0] != other:
            first = seen[key][1]
            raise ScheduleError(
                f"{_where(rank, i, schedule.actions[rank][i])}: one batch of rank {rank} exchanges "
                f"{schedule.actions[rank][first[1]]} and {schedule.actions[rank][i]} with rank {peer} in the same "
                f"direction, which rank {peer} handles in two different batches; in-order matching needs one")
        seen.setdefault(key, (other, (rank, i)))


def validate(schedule: Schedule, negotiate_shapes: bool = False) -> None:
    """Raise ScheduleError unless the schedule is complete, correctly matched and deadlock-free
    (with ``negotiate_shapes``: also when each batch first exchanges shape headers)."""
    partner = _check_and_match(schedule)
    _check_batches_pair_up(schedule, partner)
    # A send that waits for its receiver is the stricter rendezvous: an order that cannot deadlock
    # so cannot deadlock however the transport buffers (NCCL may hold a large send until it is received).
    _run(schedule, partner, lambda rank, action: 1.0, 0.0, sends_block=True, headers=negotiate_shapes)


@dataclass
class SimResult:
    timelines: list[list[tuple[float, float, Action]]]  # per rank: (start, end, compute action)
    makespan: float
    busy_time: list[float]  # per rank
    bubble_overhead: float  # total idle / total busy, idle = makespan - busy per rank
    peak_inflight: list[int]  # per rank: most (microbatch, chunk) forwards whose activations are held
    stage_bubble: list[float] = field(default_factory=list)  # per rank: idle between its first and last action
    peak_memory: list[float] = field(default_factory=list)  # per rank, in activation_memory units

    @property
    def bubble(self) -> float:
        """The zero-bubble paper's bubble: the most idle time of a stage between its first and
        last action (stages start staggered; the stagger overlaps the previous step's tail)."""
        return max(self.stage_bubble, default=0.0)


StageCosts = Mapping[tuple[int, int], Sequence[float]] | Sequence[Sequence[Sequence[float]]]


def _costs(schedule: Schedule, forward_time: float, backward_time: float, weight_time: float,
           stage_costs: StageCosts | None) -> dict[tuple[int, int], tuple[float, float, float]]:
    """(forward, backward, weight) time per (rank, chunk); a (f, b) entry has weight_time 0."""
    P, V = schedule.num_stages, schedule.num_model_chunks
    raw: dict = {(r, c): (forward_time, backward_time, weight_time) for r in range(P) for c in range(V)}
    if isinstance(stage_costs, Mapping):
        raw.update(stage_costs)
    elif stage_costs is not None:
        if len(stage_costs) != P or any(len(row) != V for row in stage_costs):
            raise ValueError(f"stage_costs must be {P} ranks x {V} chunks of (forward, backward[, weight])")
        raw = {(r, c): stage_costs[r][c] for r in range(P) for c in range(V)}
    costs = {}
    for key, entry in raw.items():
        entry = tuple(entry)
        if len(entry) not in (2, 3) or min(entry) < 0:
            raise ValueError(f"stage_costs entries must be (forward, backward[, weight]) times >= 0, got {entry}")
        costs[key] = entry if len(entry) == 3 else entry + (0.0,)
    return costs


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0,
             comm_time: float = 0.0, stage_costs: StageCosts | None = None, *, weight_time: float = 0.0,
             activation_memory: float = 1.0, weight_memory: float = 0.0, sends_block: bool = False) -> SimResult:
    """Time a schedule: costs are per model chunk; comm batches finish when matched + comm_time.

    backward_time is the input gradient (B), weight_time the weight gradient (W): a schedule
    without W actions runs both in its backward, which then costs backward_time + weight_time.
    stage_costs gives (forward, backward[, weight]) time per (rank, chunk), either as a mapping
    {(rank, chunk): (f, b[, w])} (missing entries use the times above) or as a nested sequence
    stage_costs[rank][chunk].  Memory (the paper's Table 1): a forward holds activation_memory
    until its B, which keeps weight_memory of it until its W (without W actions: until the B).
    By default a send never waits for its receiver (the zero-bubble paper's model), which is what
    the executor's NCCL batches cost: their waits order the NCCL stream, not the compute stream,
    and every measured GPU step matched it (PP=2 ZB-H1/ZB-H2/auto within 0.3%, where the other model
    was 14-21% slow; BENCHMARKS.md). sends_block=True times a comm batch that waits until both
    sides posted it (a blocking transport, e.g. gloo on CPU ranks).
    Checks first that the schedule is complete and its messages
    match (and _run that it cannot deadlock); unlike validate() it does not require the two sides of
    a message to sit in batches that pair up, so a forward-only chain can be timed too.
    """
    if min(forward_time, backward_time, comm_time, weight_time) < 0:
        raise ValueError(f"times must be >= 0, got forward_time={forward_time}, backward_time={backward_time}, "
                         f"weight_time={weight_time}, comm_time={comm_time}")
    costs = _costs(schedule, forward_time, backward_time, weight_time, stage_costs)
    split = schedule.splits_backward

    def duration(rank: int, a: Action) -> float:
        f, b, w = costs[(rank, a.chunk)]
        return {"F": f, "B": b if split else b + w, "W": w}[a.kind]

    partner = _check_and_match(schedule)
    timelines, _ = _run(schedule, partner, duration, comm_time, sends_block)

    makespan = max((tl[-1][1] for tl in timelines if tl), default=0.0)
    busy = [sum(end - start for start, end, _ in tl) for tl in timelines]
    total_busy = sum(busy)
    idle = sum(makespan - b for b in busy)
    held_after_b = weight_memory if split else 0.0
    delta = {"F": activation_memory, "B": held_after_b - activation_memory, "W": -held_after_b}
    peak, peak_mem = [], []
    for tl in timelines:
        inflight = most = 0
        memory = most_memory = 0.0
        for _, _, a in tl:
            inflight += {"F": 1, "B": 0 if split else -1, "W": -1}[a.kind]
            most = max(most, inflight)
            memory += delta[a.kind]
            most_memory = max(most_memory, memory)
        peak.append(most)
        peak_mem.append(most_memory)
    stage_bubble = [tl[-1][1] - tl[0][0] - b if tl else 0.0 for tl, b in zip(timelines, busy)]
    return SimResult(timelines=timelines, makespan=makespan, busy_time=busy,
                     bubble_overhead=idle / total_busy if total_busy > 0 else 0.0, peak_inflight=peak,
                     stage_bubble=stage_bubble, peak_memory=peak_mem)
