"""One training step of a layout: stage costs -> the real schedule simulated -> DP, optimizer.

The pipeline part is ``parallel3d.pipeline.simulate`` run on ``build_schedule``'s schedule with
per-(rank, chunk) forward/backward times (backward split into its input side B and weight
gradients W for the zero-bubble schedules, which run W as actions of their own); there is no
bubble formula here.  Simulating tens of
thousands of actions takes seconds, so for many microbatches we simulate smaller counts
M = s, 2s, 3s, ... (s a multiple of PP) until the increment per s microbatches stops changing, and
extend linearly: once settled every schedule repeats the same steady step, so the makespan is affine in M
(tests/test_planning.py checks the extension against full simulations).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

from parallel3d.pipeline.registry import build_schedule
from parallel3d.pipeline.registry import schedule_record
from parallel3d.pipeline.schedules import Schedule
from parallel3d.pipeline.simulate import SimResult, simulate

from .comm import Group, all_gather_time, all_reduce_time, group_of, p2p_time, reduce_scatter_time
from .compute import PassCost, embedding_cost, head_cost, layer_cost, optimizer_time
from .hardware import GIB, ClusterSpec
from .memory import MemoryBreakdown, memory_breakdown, params_on_rank, rank_chunks
from .model import Layout, ModelSpec, model_flops

StageTimes = list[list[tuple[float, ...]]]  # [rank][chunk]: (F, B) or (F, B, W) seconds per microbatch
MAX_SIMULATED_ACTIONS = 4000  # compute actions (2 P M V) simulated in full; more are extended linearly
DDP_BUCKET_ELEMENTS = 40_000_000  # parallel3d's (and Megatron's) default --ddp-bucket-size


@dataclass
class PipelineTiming:
    makespan: float
    finish: list[float]  # per pipeline rank: when its last backward ends
    busy: list[float]  # per rank: seconds of F/B work (TP collectives included)
    peak_inflight: list[int]
    sim: SimResult  # the simulation actually run (the small one when extended), for the timeline


@dataclass
class StepEstimate:
    model: ModelSpec
    layout: Layout
    cluster: ClusterSpec
    step_time_s: float
    compute_s: float  # F/B compute on the critical rank, recompute included
    tp_comm_s: float  # TP/SP collectives on the critical rank (not overlapped)
    pp_comm_s: float  # exposed pipeline p2p: makespan with comm minus makespan without
    bubble_s: float  # idle time of the critical rank inside the pipeline
    dp_comm_s: float  # exposed DP (and embedding-group) gradient/parameter collectives
    optimizer_s: float
    memory: list[MemoryBreakdown]  # per pipeline rank
    pipeline: PipelineTiming
    warnings: list[str] = field(default_factory=list)
    host_wait_s: float = 0.0  # the critical rank's GPU waiting for the host's launches (in compute_s's actions)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.layout.global_batch_size * self.model.seq_length / self.step_time_s / self.layout.num_gpus

    @property
    def tflops_per_gpu(self) -> float:
        """Megatron's formula (model FLOPs), as parallel3d.training and bench/gpt_bench.py report."""
        return model_flops(self.model, self.layout.global_batch_size, self.layout.tp) / self.step_time_s \
            / self.layout.num_gpus / 1e12

    @property
    def peak_memory_gib(self) -> float:
        return max(m.peak for m in self.memory) / GIB

    @property
    def fits(self) -> bool:
        return all(m.fits(self.cluster) for m in self.memory)

    def as_dict(self) -> dict:
        L, m = self.layout, self.model
        return {
            "tensor_model_parallel_size": L.tp, "pipeline_model_parallel_size": L.pp,
            "virtual_pipeline_model_parallel_size": L.virtual_stages(m), "data_parallel_size": L.dp,
            "num_gpus": L.num_gpus, "micro_batch_size": L.micro_batch_size,
            "num_microbatches": L.num_microbatches, "recompute_granularity": L.recompute_granularity,
            "sequence_parallel": L.sequence_parallel, "use_distributed_optimizer": L.use_distributed_optimizer,
            "enable_cuda_graph": L.enable_cuda_graph, "schedule": L.schedule_name(m), "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.tflops_per_gpu / self.cluster.gemm.peak_tflops,
            "peak_memory_gb": self.peak_memory_gib, "fits": self.fits,
            "step_breakdown_s": {"compute": self.compute_s, "tp_comm": self.tp_comm_s, "pp_comm": self.pp_comm_s,
                                 "bubble": self.bubble_s, "dp_comm": self.dp_comm_s, "optimizer": self.optimizer_s,
                                 "host_wait": self.host_wait_s},
            "memory_gb_per_stage": [mem.as_gib() for mem in self.memory],
            "warnings": self.warnings,
        }


def stage_costs(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> list[list[PassCost]]:
    """PassCost of every (pipeline rank, chunk): its layers, plus the embedding / head it holds."""
    layer = layer_cost(model, layout, cluster)
    emb = embedding_cost(model, layout, cluster)
    out = []
    for rank in range(layout.pp):
        row = []
        for layers, first, last in rank_chunks(model, layout, rank):
            cost = layer * layers
            if first:
                cost = cost + emb
            if last:
                cost = cost + head_cost(model, layout, cluster)
            row.append(cost)
        out.append(row)
    return out


@functools.lru_cache(maxsize=32)
def _schedule(name: str, P: int, M: int, V: int, shape: tuple[int, ...] = ()) -> Schedule:
    # the search asks for the same few shapes again and again; ``shape`` (hidden, seq) steers 'auto'
    hidden_size, seq_length = shape or (None, None)
    return build_schedule(name, P, M, V, hidden_size=hidden_size, seq_length=seq_length)


def _run(name: str, P: int, M: int, V: int, costs: StageTimes, comm: float, shape: tuple[int, ...] = ()) -> SimResult:
    """One simulation; (F, B, W) times become (F, B + W) for a schedule without W actions."""
    schedule = _schedule(name, P, M, V, shape)
    if not schedule.splits_backward:
        costs = [[(times[0], sum(times[1:])) for times in row] for row in costs]
    # The simulator's default, sends that do not hold up their sender, is what the executor measures.
    return simulate(schedule, comm_time=comm, stage_costs=costs)


def schedule_times(cost: PassCost) -> tuple[float, float, float]:
    """(F, B, W) seconds per microbatch: W the weight-gradient GEMMs, B the rest of the backward. Where the
    host takes longer to launch them than the GPU to run them, the GPU waits: the three stretch to the host's
    time, in proportion (the host's launches follow the same kernels)."""
    times = (cost.forward, cost.backward - cost.bwd_weight, cost.bwd_weight)
    stretch = max(1.0, cost.host / sum(times)) if sum(times) > 0 else 1.0
    return tuple(t * stretch for t in times)


def host_wait(cost: PassCost) -> float:
    """Seconds per microbatch the GPU waits for the host's launches (0 where the GPU is the slower)."""
    return max(0.0, cost.host - cost.forward - cost.backward)


def simulate_pipeline(name: str, P: int, M: int, V: int, costs: StageTimes, comm: float,
                      shape: tuple[int, ...] = ()) -> PipelineTiming:
    """Makespan, per-rank finish and in-flight peak of the schedule (extended linearly for large M).

    ``costs[rank][chunk]``: (forward, backward) or (forward, backward input side, weight) seconds;
    ``shape``: the model's (hidden size, sequence length), from which 'auto' picks as training does."""
    busy = [M * sum(sum(times) for times in row) for row in costs]
    if 2 * P * M * V <= MAX_SIMULATED_ACTIONS:
        r = _run(name, P, M, V, costs, comm, shape)
        return PipelineTiming(r.makespan, [tl[-1][1] for tl in r.timelines], busy, r.peak_inflight, r)
    # Unequal stages take a few rounds of P microbatches to settle: simulate M = s, 2s, 3s, ...
    # (s a multiple of P) until two successive increments agree, then extend from the last two.
    step = P * max(math.ceil(schedule_record(name).min_microbatches(P) / P), math.ceil(4 / P))
    runs = [(m, _run(name, P, m, V, costs, comm, shape)) for m in (step, 2 * step)]
    while True:
        (_, ra), (mb, rb) = runs[-2], runs[-1]
        mc = mb + step
        if mc >= M:
            r = _run(name, P, M, V, costs, comm, shape)
            return PipelineTiming(r.makespan, [tl[-1][1] for tl in r.timelines], busy, r.peak_inflight, r)
        rc = _run(name, P, mc, V, costs, comm, shape)
        runs.append((mc, rc))
        if all(math.isclose(c - b, b - a, rel_tol=1e-9, abs_tol=1e-12 * c) for a, b, c in zip(
                [t[-1][1] for t in ra.timelines], [t[-1][1] for t in rb.timelines], [t[-1][1] for t in rc.timelines])):
            break
    (m1, r1), (m2, r2) = runs[-2], runs[-1]

    def extend(a: float, b: float) -> float:
        return b + (M - m2) * (b - a) / (m2 - m1)

    finish = [extend(t1[-1][1], t2[-1][1]) for t1, t2 in zip(r1.timelines, r2.timelines)]
    return PipelineTiming(extend(r1.makespan, r2.makespan), finish, busy, r2.peak_inflight, r2)


def dp_time(model: ModelSpec, layout: Layout, cluster: ClusterSpec, rank: int, overlap_window: float) -> float:
    """Exposed gradient reduction (+ ZeRO parameter all-gather, + tied-embedding sync) of one rank."""
    n = params_on_rank(model, layout, rank)
    total = 0.0
    last_bucket = 0.0
    if layout.dp > 1:
        group = group_of(cluster, layout.dp, layout.tp)
        buckets = max(1, math.ceil(n / DDP_BUCKET_ELEMENTS))
        grad_bytes = 4.0 * n / buckets  # fp32 main_grad is what is reduced
        if layout.use_distributed_optimizer:
            one = reduce_scatter_time(cluster, group, grad_bytes)
        else:
            one = all_reduce_time(cluster, group, grad_bytes)
        total, last_bucket = buckets * one, one
        if layout.overlap_grad_reduce:  # buckets launch during the last microbatch's backward
            total = max(total - overlap_window, last_bucket)
        if layout.use_distributed_optimizer:  # the updated bf16 shards, gathered after the step
            total += buckets * all_gather_time(cluster, group, (2 if layout.bf16 else 4) * n / buckets)
    first_or_last = rank in (0, layout.pp - 1)
    if layout.pp > 1 and first_or_last and not model.untie_embeddings_and_output_weights:
        across = layout.tp * layout.dp * layout.pp > cluster.gpus_per_node
        emb = model.vocab(layout.tp) // layout.tp * model.hidden_size * 4.0
        total += all_reduce_time(cluster, Group(2, 1 if across else 2), emb)
    return total


def estimate(model: ModelSpec, layout: Layout, cluster: ClusterSpec, breakdown: bool = True) -> StepEstimate:
    """Predict one training step of ``layout`` (raises ValueError for a layout that cannot run).

    ``breakdown=False`` skips the comm-free simulation that separates exposed p2p from the
    bubble (pp_comm_s is then 0 and bubble_s includes it); the step time is the same.
    """
    layout.check(model)
    warnings = []
    if layout.num_gpus > cluster.num_gpus:
        warnings.append(f"needs {layout.num_gpus} GPUs, the cluster has {cluster.num_gpus}")
    if layout.tp > cluster.gpus_per_node:
        warnings.append(f"TP={layout.tp} spans nodes: TP collectives are costed on InfiniBand (not validated)")
    P, V, M = layout.pp, layout.virtual_stages(model), layout.num_microbatches
    name = layout.schedule_name(model)
    costs = stage_costs(model, layout, cluster)
    times = [[schedule_times(c) for c in row] for row in costs]
    elem = 2 if layout.bf16 else 4
    act_bytes = layout.micro_batch_size * model.seq_length * model.hidden_size * elem
    if layout.sequence_parallel:
        act_bytes /= layout.tp
    across = P > 1 and layout.tp * layout.dp * P > cluster.gpus_per_node
    comm = p2p_time(cluster, act_bytes, across, layout.tp, layout.scatter_gather_p2p) if P > 1 else 0.0
    shape = (model.hidden_size, model.seq_length)
    timing = simulate_pipeline(name, P, M, V, times, comm, shape)
    no_comm = timing.makespan
    if comm > 0 and breakdown:
        no_comm = simulate_pipeline(name, P, M, V, times, 0.0, shape).makespan

    ends = []
    for rank in range(P):
        window = sum(c.backward for c in costs[rank])  # one microbatch's backward on this rank
        dp = dp_time(model, layout, cluster, rank, window)
        opt = optimizer_time(params_on_rank(model, layout, rank), layout, cluster)
        ends.append((timing.finish[rank] + dp + opt, rank, dp, opt))
    step, crit, dp_s, opt_s = max(ends)
    compute = M * sum(c.compute for c in costs[crit])
    tp_comm = M * sum(c.tp_comm for c in costs[crit])
    pp_comm = timing.makespan - no_comm
    bubble = max(0.0, timing.finish[crit] - pp_comm - timing.busy[crit])
    memory = [memory_breakdown(model, layout, rank, timing.peak_inflight[rank],
                               [a for _, _, a in timing.sim.timelines[rank]]) for rank in range(P)]
    waiting = M * sum(host_wait(c) for c in costs[crit])
    if waiting > 0.05 * step:
        warnings.append(f"host-bound: the GPU waits {waiting:.3f} s of the step for the host's kernel launches "
                        "(a larger --micro-batch-size gives each launch more work)")
    return StepEstimate(model, layout, cluster, step, compute, tp_comm, pp_comm, bubble, dp_s, opt_s, memory,
                        timing, warnings, waiting)


def evaluate(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> Optional[StepEstimate]:
    """``estimate``, or None when the layout breaks one of Megatron's divisibility rules."""
    try:
        return estimate(model, layout, cluster)
    except ValueError:
        return None
