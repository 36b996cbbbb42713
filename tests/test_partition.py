"""Layer partitioning over pipeline / virtual pipeline stages."""
import itertools
import random

import pytest

from parallel3d.pipeline.partition import balanced_counts, even_counts, partition_layers
from parallel3d.pipeline.schedules import stage_location
from parallel3d.pipeline.registry import build_schedule
from parallel3d.pipeline.simulate import simulate


def _counts(result):
    P, V = len(result), len(result[0])
    return [len(result[v % P][v // P]) for v in range(P * V)]


def _check_contiguous(result, num_layers):
    P, V = len(result), len(result[0])
    stages = [result[v % P][v // P] for v in range(P * V)]
    assert stages[0].start == 0 and stages[-1].stop == num_layers
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))


def _even(L, P, V=1, **kw):
    return partition_layers(L, P, V, layers_per_stage=even_counts(L, P * V), **kw)


def _balanced(L, P, V=1, costs=None, emb=0.0, head=0.0, allow=False):
    counts = balanced_counts(costs, P * V, emb, head, allow)
    return partition_layers(L, P, V, layers_per_stage=counts, allow_empty_stages=allow)


def test_even_divisible_with_virtual_stages():
    result = _even(8, 2, 2)
    # virtual stage v = chunk * P + rank, layers in virtual-stage order
    assert result == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert _even(8, 4) == [[range(0, 2)], [range(2, 4)], [range(4, 6)], [range(6, 8)]]


@pytest.mark.parametrize("L,P,V,counts", [
    (10, 4, 1, [2, 3, 3, 2]),   # remainder to the inner stages
    (11, 4, 1, [3, 3, 3, 2]),   # then to the first stage; the head stage is the last to grow
    (5, 2, 1, [3, 2]),
    (13, 3, 2, [2, 3, 2, 2, 2, 2]),
    (7, 1, 1, [7]),
])
def test_even_remainder_rule(L, P, V, counts):
    result = _even(L, P, V)
    assert _counts(result) == counts
    _check_contiguous(result, L)


def test_even_too_few_layers():
    with pytest.raises(ValueError, match=r"leaves virtual stage 3 empty; pass allow_empty_stages=True"):
        _even(3, 2, 2)
    # allowed: the embedding and head stages are the ones left empty
    assert _counts(_even(2, 4, allow_empty_stages=True)) == [0, 1, 1, 0]
    _check_contiguous(_even(2, 4, allow_empty_stages=True), 2)


def test_explicit_counts():
    result = partition_layers(10, 2, 2, layers_per_stage=[1, 3, 4, 2])
    assert result == [[range(0, 1), range(4, 8)], [range(1, 4), range(8, 10)]]
    assert _counts(partition_layers(4, 2, layers_per_stage=[0, 4], allow_empty_stages=True)) == [0, 4]


@pytest.mark.parametrize("kw,match", [
    ({"layers_per_stage": [5, 5]}, r"has 2 entries, expected one per virtual stage: pipeline_size=2 x virtual_size=2 = 4"),
    ({"layers_per_stage": [3, 3, 3, 3]}, r"sums to 12, but num_layers is 10"),
    ({"layers_per_stage": [0, 4, 3, 3]}, r"leaves virtual stage 0 empty; pass allow_empty_stages=True"),
    ({"layers_per_stage": [-1, 5, 3, 3]}, r"ints >= 0"),
])
def test_partition_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(10, 2, 2, **kw)


def test_argument_errors():
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        partition_layers(0, 2, layers_per_stage=[0, 0])
    with pytest.raises(ValueError, match="pipeline_size and virtual_size must be >= 1, got 0 and 1"):
        partition_layers(4, 0, layers_per_stage=[])
    with pytest.raises(TypeError, match="pipeline_size must be an int"):
        partition_layers(4, 2.0, layers_per_stage=[2, 2])


def virtual_stage_costs(partition, layer_costs, embedding_cost=0.0, head_cost=0.0):
    """Cost of each [rank][chunk] (loop placement): its layers, the embedding on v=0, the head on the last v."""
    P, V = len(partition), len(partition[0])
    out = [[sum(layer_costs[i] for i in partition[r][c]) for c in range(V)] for r in range(P)]
    (r0, c0), (r1, c1) = stage_location(0, P), stage_location(P * V - 1, P)
    out[r0][c0] += embedding_cost
    out[r1][c1] += head_cost
    return out


def test_balanced_moves_layers_away_from_head_and_embedding():
    result = _balanced(8, 4, costs=[1.0] * 8, head=2.0)
    costs = virtual_stage_costs(result, [1.0] * 8, head_cost=2.0)
    assert max(c for row in costs for c in row) == 3.0  # lower bound ceil(10 / 4)
    assert _counts(result)[-1] == 1
    result = _balanced(8, 2, 2, costs=[1.0] * 8, emb=2.0, head=2.0)
    assert _counts(result)[0] == 1 and _counts(result)[-1] == 1 and sum(_counts(result)) == 8


def _brute_force_max(costs, S, embedding, head, allow_empty):
    L, best = len(costs), float("inf")
    for cuts in itertools.combinations_with_replacement(range(L + 1), S - 1):
        bounds = [0, *cuts, L]
        sizes = [bounds[k + 1] - bounds[k] for k in range(S)]
        if not allow_empty and min(sizes) < 1:
            continue
        stage = [sum(costs[bounds[k]:bounds[k + 1]]) for k in range(S)]
        stage[0] += embedding
        stage[-1] += head
        best = min(best, max(stage))
    return best


def test_balanced_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        L, P, V = rng.randint(1, 8), rng.randint(1, 3), rng.randint(1, 2)
        allow = rng.random() < 0.5
        if L < P * V and not allow:
            continue
        costs = [rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, 5.0]) for _ in range(L)]
        emb, head = rng.choice([0.0, 1.0, 4.0]), rng.choice([0.0, 2.0, 7.0])
        result = _balanced(L, P, V, costs, emb, head, allow)
        _check_contiguous(result, L)
        if not allow:
            assert min(_counts(result)) >= 1
        got = max(c for row in virtual_stage_costs(result, costs, emb, head) for c in row)
        assert got == pytest.approx(_brute_force_max(costs, P * V, emb, head, allow))


def test_balanced_large_is_fast_and_feeds_simulate():
    rng = random.Random(1)
    costs = [rng.uniform(0.5, 1.5) for _ in range(96)]
    result = _balanced(96, 4, 2, costs, 3.0, 6.0)
    per_stage = virtual_stage_costs(result, costs, 3.0, 6.0)
    assert sum(map(sum, per_stage)) == pytest.approx(sum(costs) + 9.0)
    sim = simulate(build_schedule("interleaved-1f1b", 4, 8, 2),
                   stage_costs=[[(c, 2 * c) for c in row] for row in per_stage])
    assert sim.makespan >= max(max(row) for row in per_stage) * 3 * 8
