"""The automatic scheduler: measured times and a memory limit in, the fastest schedule out.

    schedule = build_schedule("auto", P, M, forward_time=F, backward_time=B, weight_time=W,
                              comm_time=C, memory_limit=2 * P)

Candidates: 1F1B, ZB-H1 and ZB-H2 (one chunk per rank), or ZB-V and DualPipeV (two chunks in a
V), plus the zero-bubble paper's greedy list scheduler (B when a gradient is there, else F
within the memory limit, else W) run with the measured times at every in-flight limit from
1F1B's to the memory limit.  Each candidate is validated and simulated under the executor's
communication model; the one with the smallest makespan whose peak activation memory fits
``memory_limit`` wins (ties: the earlier candidate, so a named schedule beats an ad-hoc one).

Memory is counted in M_B, the activations one microbatch leaves on one pipeline rank's whole
share of the model (a chunk of a V holds half); ``weight_fraction`` = M_W / M_B is what a
microbatch still holds between its B and its W (the paper's Table 1: about 32/34).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from .builders import add_comm
from .schedules import Schedule, ScheduleError
from .simulate import SimResult, simulate, validate
from .zero_bubble import greedy_orders, with_comm


def paper_costs(hidden_size: float, seq_length: float) -> tuple[float, float, float, float, float]:
    """A transformer layer's T_F, T_B, T_W, M_B, M_W by the zero-bubble paper's Table 1.

    Per token, up to a common factor: T_F = 24h + 4s, T_B = 24h + 8s, T_W = 24h FLOPs; a
    microbatch holds 34h + 5s activation units until its B and 32h of them until its W.
    What 'auto' ranks its candidates by when nothing was measured (Qi et al., ICLR 2024).
    """
    h, s = hidden_size, seq_length
    return 24 * h + 4 * s, 24 * h + 8 * s, 24 * h, 34 * h + 5 * s, 32 * h


def auto_options(hidden_size: Optional[int] = None, seq_length: Optional[int] = None) -> dict:
    """build_schedule('auto', ...)'s options where nothing was measured: the model's shape by
    paper_costs (unit times without one); the simulator's sends that do not wait are how NCCL ran
    them.  Training, the benchmark and the planner all build 'auto' through this, so they pick alike."""
    options: dict = {}
    if hidden_size and seq_length:
        f, b, w, m_b, m_w = paper_costs(hidden_size, seq_length)
        options.update(forward_time=f, backward_time=b, weight_time=w, weight_fraction=m_w / m_b)
    return options


def _greedy(P: int, M: int, V: int, limit: int, times: tuple[float, float, float], comm_time: float) -> Schedule:
    """The list scheduler at ``limit`` chunk-activations per rank (staggered by rank, as in 1F1B)."""
    placement = "v" if V == 2 else "loop"
    per_rank = [limit] * P if V == 2 else [max(1, limit - r) for r in range(P)]
    orders = greedy_orders(P, M, V, placement, per_rank, limit, times, comm_time)
    actions = add_comm(P, V, orders, placement) if V == 1 else with_comm(orders, P, V, placement, times)
    return Schedule(f"greedy-{limit}", P, M, V, actions, placement)


def candidates(P: int, M: int, V: int, times: tuple[float, float, float], comm_time: float,
               memory_limit: float, named: Sequence[Schedule]) -> list[Schedule]:
    out = list(named)
    # Greedy limits in chunk forwards: 1F1B's (P per rank, 2P chunks of a V) up to the memory limit.
    lowest = P * V
    for limit in range(lowest, max(lowest, int(memory_limit * V)) + 1):
        try:
            out.append(_greedy(P, M, V, limit, times, comm_time))
        except ValueError:
            continue  # no order fits this limit
    return out


def auto_schedule(num_stages: int, num_microbatches: int, num_model_chunks: int = 1, *,
                  named: Sequence[Schedule], forward_time: float = 1.0, backward_time: float = 1.0,
                  weight_time: float = 1.0, comm_time: float = 0.0, memory_limit: Optional[float] = None,
                  weight_fraction: float = 0.94,
                  sends_block: bool = False, results: Optional[dict[str, SimResult]] = None) -> Schedule:
    """The candidate with the smallest simulated makespan within ``memory_limit`` M_B per rank.

    ``named``: the named candidates (the registry's auto_candidate records that run these sizes), which
    the greedy orders join.  memory_limit defaults to 1F1B's peak, P M_B.  ``results``, if given,
    receives every candidate's simulation by name (what the benchmark prints).
    """
    P, M, V = num_stages, num_microbatches, num_model_chunks
    limit = float(P) if memory_limit is None else float(memory_limit)
    if limit < 1:
        raise ValueError(f"memory_limit must be >= 1 M_B (one microbatch's activations), got {memory_limit}")
    times = (forward_time, backward_time, weight_time)
    best: Optional[tuple[float, Schedule]] = None
    for schedule in candidates(P, M, V, times, comm_time, limit, named):
        try:
            validate(schedule)
        except ScheduleError:
            continue  # a greedy order whose messages cannot be batched deadlock-free
        result = simulate(schedule, forward_time, backward_time, comm_time, weight_time=weight_time,
                          activation_memory=1.0 / V, weight_memory=weight_fraction / V, sends_block=sends_block)
        if results is not None:
            results[schedule.name] = result
        if max(result.peak_memory) <= limit + 1e-9 and (best is None or result.makespan < best[0] - 1e-9):
            best = (result.makespan, schedule)
    if best is None:
        raise ValueError(f"no {V}-chunk schedule for P={P}, M={M} fits memory_limit={limit} M_B per rank")
    return dataclasses.replace(best[1], name=f"auto({best[1].name})")
