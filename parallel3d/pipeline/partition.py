"""Split a stack of transformer layers over pipeline (and virtual pipeline) stages.

The result is indexed ``result[rank][chunk]`` and holds a ``range`` of global layer indices.
Virtual stage ``v = chunk * P + rank`` (Megatron's numbering) holds the v-th consecutive
slice of layers, so walking v = 0 .. P*V-1 walks the model from embedding to head.
Virtual stage 0 also holds the embedding, virtual stage P*V-1 the output head / loss.

The counts per virtual stage (pipeline/layout.py chooses them by Megatron's flags) come from:
- :func:`even_counts`: num_layers // (P*V) each; the remainder goes one layer each to the inner
  stages v = 1, 2, ..., P*V-2, then to v = 0.  The ends carry the embedding and the head, so they
  are the last to get an extra layer (the same reason as Megatron's
  account_for_embedding/loss_in_pipeline_split).
- :func:`balanced_counts`: a contiguous split of per-layer costs minimising the most expensive
  virtual stage, counting an embedding cost on stage 0 and a head cost on the last (exact).
:func:`partition_layers` turns counts into the ranges of each (rank, chunk).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from .schedules import virtual_stage


def _to_result(counts: list[int], pipeline_size: int, virtual_size: int, placement: str) -> list[list[range]]:
    starts = [sum(counts[:v]) for v in range(len(counts))]
    stage = [[virtual_stage(r, c, pipeline_size, placement) for c in range(virtual_size)] for r in range(pipeline_size)]
    return [[range(starts[v], starts[v] + counts[v]) for v in row] for row in stage]


def even_counts(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    for v in (list(range(1, num_stages - 1)) + [0])[:extra]:  # inner stages first (see module doc)
        counts[v] += 1
    return counts


def balanced_counts(layer_costs: Sequence[float], num_stages: int, embedding_cost: float,
                     head_cost: float, allow_empty: bool) -> list[int]:
    """Contiguous split of layer_costs into num_stages parts minimising the max part cost.

    best[s][i] = smallest possible max cost when the first s stages hold layers [0, i).
    best[s][i] = min over j of max(best[s-1][j], cost(j, i)); best[s-1][j] grows with j and
    cost(j, i) shrinks with j, so the optimum sits where they cross: found by bisection.
    """
    L, S = len(layer_costs), num_stages
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    min_layers = 0 if allow_empty else 1

    def cost(stage: int, j: int, i: int) -> float:  # layers [j, i) on `stage`
        extra = (embedding_cost if stage == 0 else 0.0) + (head_cost if stage == S - 1 else 0.0)
        return prefix[i] - prefix[j] + extra

    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(S)]
    choice = [[0] * (L + 1) for _ in range(S)]
    for i in range(min_layers, L + 1):
        best[0][i] = cost(0, 0, i)
    for s in range(1, S):
        prev = best[s - 1]
        for i in range(L + 1):
            lo, hi = s * min_layers, i - min_layers  # j = where stage s starts; prev[lo:] is finite
            if hi < lo:
                continue
            # first j in [lo, hi] where prev[j] >= cost(s, j, i); the optimum is there or just before
            k = bisect_left(range(lo, hi + 1), True, key=lambda j: prev[j] >= cost(s, j, i)) + lo
            for j in (k - 1, k):
                if lo <= j <= hi and max(prev[j], cost(s, j, i)) < best[s][i]:
                    best[s][i], choice[s][i] = max(prev[j], cost(s, j, i)), j
    if best[S - 1][L] == inf:
        raise ValueError(f"cannot split {L} layers into {S} non-empty stages")
    counts, i = [], L
    for s in range(S - 1, 0, -1):
        j = choice[s][i]
        counts.append(i - j)
        i = j
    counts.append(i)
    return counts[::-1]


def partition_layers(num_layers: int, pipeline_size: int, virtual_size: int = 1, *, layers_per_stage: list[int],
                     allow_empty_stages: bool = False, placement: str = "loop") -> list[list[range]]:
    """Assign ``layers_per_stage[v]`` layers to virtual stage v; result[rank][chunk] = range of layers.

    ``placement`` "v" (ZB-V, DualPipeV) puts virtual stage 2P-1-rank in chunk 1 of ``rank``;
    counts stay indexed by virtual stage v.
    """
    for arg, value in (("num_layers", num_layers), ("pipeline_size", pipeline_size),
                       ("virtual_size", virtual_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} must be an int, got {value!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if pipeline_size < 1 or virtual_size < 1:
        raise ValueError(f"pipeline_size and virtual_size must be >= 1, got {pipeline_size} and {virtual_size}")
    P, V, L = pipeline_size, virtual_size, num_layers
    counts = list(layers_per_stage)
    if len(counts) != P * V:
        raise ValueError(f"layers_per_stage has {len(counts)} entries, expected one per virtual stage: "
                         f"pipeline_size={P} x virtual_size={V} = {P * V} (indexed by v = chunk * {P} + rank)")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
        raise ValueError(f"layers_per_stage must hold ints >= 0, got {counts}")
    if sum(counts) != L:
        raise ValueError(f"layers_per_stage {counts} sums to {sum(counts)}, but num_layers is {L}")
    if not allow_empty_stages and 0 in counts:
        raise ValueError(f"layers_per_stage {counts} leaves virtual stage {counts.index(0)} empty; "
                         f"pass allow_empty_stages=True if that is intended")
    return _to_result(counts, P, V, placement)
