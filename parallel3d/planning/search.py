"""Search the layouts of a model on N GPUs and rank them by predicted tokens/s.

Every candidate gets a cheap lower bound on its step time (each rank's own F/B work, DP
reduction and optimizer step, without any waiting) and a lower bound on its memory (one
microbatch in flight).  Candidates are then simulated in order of that bound, and the search
stops once the bound exceeds the k-th best simulated step: the result is the model's true top k,
at the cost of a few dozen simulations instead of thousands.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from parallel3d.pipeline.registry import SCHEDULES, ZERO_BUBBLE
from parallel3d.pipeline.builders import num_warmup_microbatches

from .compute import optimizer_time
from .hardware import ClusterSpec
from .memory import memory_breakdown, params_on_rank
from .model import Layout, ModelSpec
from .step import StepEstimate, dp_time, estimate, stage_costs, schedule_times


@dataclass
class SearchResult:
    best: list[StepEstimate]  # fitting layouts, fastest first
    considered: int  # layouts that satisfy Megatron's divisibility rules
    simulated: int
    not_fitting: int  # pruned or simulated, predicted over the memory
    skipped: list[str]  # why some sizes were not modelled at all


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, cluster: ClusterSpec, num_gpus: int, base: Layout,
               micro_batch_sizes: Iterable[int] = (1, 2, 4, 8), fixed: Optional[dict] = None,
               skipped: Optional[list[str]] = None) -> list[Layout]:
    """Layouts on exactly ``num_gpus`` GPUs; ``fixed`` pins fields given on the command line."""
    fixed = fixed or {}
    out = []
    tps = [t for t in _divisors(cluster.gpus_per_node) if num_gpus % t == 0]
    for tp, pp in itertools.product(tps, _divisors(model.num_layers)):
        if num_gpus % (tp * pp):
            continue
        dp = num_gpus // (tp * pp)
        per_stage = model.num_layers // pp
        vps = [None] + ([v for v in _divisors(per_stage) if v < per_stage and per_stage // v <= 8] if pp > 1 else [])
        # (virtual layers, schedule): Megatron's 1F1B / interleaved, and each zero-bubble schedule 'auto'
        # picks among (so 'auto' adds nothing)
        pipelines = [(vp, None) for vp in vps] + [(None, z) for z, r in SCHEDULES.items()
                                                  if r.splits_backward and r.auto_candidate and pp > 1]
        # TP with and without sequence parallelism: SP saves activation memory, without it TP ran faster
        # where it fits (BENCHMARKS.md, "Tensor parallelism: the link")
        # and TP with CUDA graphs, where its step is bound by the host's launches (Layout.check drops the
        # layouts graphs cannot hold)
        for mbs, (vp, schedule), rc, zero, sp, graphs in itertools.product(
                micro_batch_sizes, pipelines, (None, "selective", "full"), (False, True) if dp > 1 else (False,),
                (True, False) if tp > 1 else (False,), (False, True) if tp > 1 else (False,)):
            layout = replace(base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             data_parallel_size=dp, micro_batch_size=mbs, num_layers_per_virtual_pipeline_stage=vp,
                             recompute_granularity=rc, use_distributed_optimizer=zero, sequence_parallel=sp,
                             pipeline_schedule=schedule, enable_cuda_graph=graphs or base.enable_cuda_graph)
            if fixed:
                layout = replace(layout, **fixed)
            try:
                layout.check(model)
            except ValueError as e:  # a zero-bubble schedule or graphs that do not fit are no news: others run
                if skipped is not None and layout.pipeline_schedule is None and not layout.enable_cuda_graph \
                        and len(skipped) < 5 and str(e) not in skipped:
                    skipped.append(str(e))
                continue
            out.append(layout)
    return list(dict.fromkeys(out))  # pinned fields make duplicates


def lower_bound(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> tuple[float, bool]:
    """(no step can be shorter, does it fit): memory uses the schedule's own warm-up count."""
    costs = stage_costs(model, layout, cluster)
    name, V = layout.schedule_name(model), layout.virtual_stages(model)
    M, best, fits = layout.num_microbatches, 0.0, True
    start = 0.0  # a rank starts after the first microbatch's forward reached it (every schedule)
    for rank, row in enumerate(costs):
        work = M * sum(sum(schedule_times(c)) for c in row)  # the GPU's work, or the host's where longer
        window = sum(c.backward for c in row)
        n = params_on_rank(model, layout, rank)
        dp = dp_time(model, layout, cluster, rank, window)
        best = max(best, start + work + dp + optimizer_time(n, layout, cluster))
        start += schedule_times(row[0])[0]
        # The most (microbatch, chunk) forwards a rank holds: its warm-up plus the first steady one.
        # (A zero-bubble schedule's count is only known from its simulation: 1, a lower bound.)
        inflight = 1 if name in ZERO_BUBBLE else min(num_warmup_microbatches(name, rank, layout.pp, M, V) + 1, M * V)
        fits = fits and memory_breakdown(model, layout, rank, inflight).fits(cluster)
    return best, fits


def search(model: ModelSpec, cluster: ClusterSpec, num_gpus: int, base: Layout, top: int = 5,
           fixed: Optional[dict] = None, micro_batch_sizes: Iterable[int] = (1, 2, 4, 8)) -> SearchResult:
    skipped: list[str] = []
    layouts = candidates(model, cluster, num_gpus, base, micro_batch_sizes, fixed, skipped)
    bounds = []
    not_fitting = 0
    for i, layout in enumerate(layouts):
        bound, may_fit = lower_bound(model, layout, cluster)
        if may_fit:
            bounds.append((bound, i, layout))
        else:
            not_fitting += 1
    bounds.sort(key=lambda x: (x[0], x[1]))
    best: list[tuple[float, int, StepEstimate]] = []  # max-heap by step time (negated)
    simulated = 0
    for bound, i, layout in bounds:
        if len(best) == top and bound >= -best[0][0]:
            break
        est = estimate(model, layout, cluster, breakdown=False)
        simulated += 1
        if not est.fits:
            not_fitting += 1
            continue
        heapq.heappush(best, (-est.step_time_s, i, est))
        if len(best) > top:
            heapq.heappop(best)
    # The ranked few get the full breakdown (exposed p2p needs a second, comm-free simulation).
    ranked = [estimate(model, e.layout, cluster) for _, _, e in sorted(best, key=lambda x: (-x[0], x[1]))]
    return SearchResult(ranked, len(layouts), simulated, not_fitting, skipped)
