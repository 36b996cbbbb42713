"""The planner on the pipeline package's schedules: zero-bubble W timing, V placement, the layer split."""
from __future__ import annotations

import dataclasses

import pytest

from parallel3d.pipeline.layout import layers_per_virtual_stage
from parallel3d.planning.compute import head_cost_in_layers
from parallel3d.pipeline.registry import ZERO_BUBBLE
from parallel3d.pipeline.schedules import stage_location, virtual_stage
from parallel3d.planning import Layout, ModelSpec, estimate, get_cluster
from parallel3d.planning.memory import layer_activation_bytes, memory_breakdown, rank_chunks
from parallel3d.planning.step import schedule_times, stage_costs
from parallel3d.tensor_parallel.cross_entropy import loss_memory_per_logit
from parallel3d.training import gpt
from parallel3d.training.arguments import parse_args, validate_args

LOGIT_BYTES, LOGIT_SAVED_BYTES = loss_memory_per_logit(tensor_parallel=False)

CLUSTER = get_cluster("h100-sxm")
# Small enough to simulate in a blink, 8 layers so zb-v / dualpipev get 2 x PP chunks at PP=4.
MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=32000)
GPT_1_3B = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257)


def _layout(pp: int, schedule: str | None = None, **kw) -> Layout:
    base = dict(pipeline_model_parallel_size=pp, micro_batch_size=1, global_batch_size=4 * pp,
                pipeline_schedule=schedule)
    base.update(kw)
    return Layout(**base)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_estimate_runs_every_zero_bubble_schedule(name, pp):
    layout = _layout(pp, name)
    est = estimate(MODEL, layout, CLUSTER)
    V = 2 if name in ("zb-v", "dualpipev") else 1
    assert layout.virtual_stages(MODEL) == V and layout.schedule_name(MODEL) == name
    assert est.step_time_s > 0 and est.fits and est.bubble_s >= 0
    sim = est.pipeline.sim
    assert sim.makespan == pytest.approx(est.pipeline.makespan)
    costs = stage_costs(MODEL, layout, CLUSTER)
    kinds = {a.kind.value for tl in sim.timelines for _, _, a in tl}
    if "W" in kinds:  # timed as the weight-gradient part; B is the rest of the backward
        for rank, tl in enumerate(sim.timelines):
            for start, end, a in tl:
                c = costs[rank][a.chunk]
                times = dict(zip("FBW", schedule_times(c)))  # the GPU's times, stretched where the host is slower
                assert end - start == pytest.approx(times[a.kind.value])
                assert times["W"] / times["B"] == pytest.approx(c.bwd_weight / (c.backward - c.bwd_weight))
    else:
        assert name == "auto"  # auto may pick 1F1B; then B carries the whole backward


def test_zb_h1_step_is_no_longer_than_1f1b():
    for model in (MODEL, GPT_1_3B):
        for pp in (2, 4):
            one = estimate(model, _layout(pp, "1f1b", global_batch_size=8 * pp), CLUSTER)
            zb = estimate(model, _layout(pp, "zb-h1", global_batch_size=8 * pp), CLUSTER)
            assert all(c.bwd_weight > 0 for row in stage_costs(model, zb.layout, CLUSTER) for c in row)
            assert zb.step_time_s <= one.step_time_s
            assert zb.pipeline.makespan < one.pipeline.makespan  # W fills the bubble


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev"])
def test_memory_inflight_comes_from_the_simulated_schedule(name):
    kw = {"num_layers_per_virtual_pipeline_stage": 1} if name == "interleaved-1f1b" else {}
    est = estimate(MODEL, _layout(4, name, **kw), CLUSTER)
    assert [m.inflight_microbatches for m in est.memory] == est.pipeline.peak_inflight == \
        est.pipeline.sim.peak_inflight
    if name == "zb-h2":  # holds more than 1F1B's P - rank: each rank's W is deferred
        one = estimate(MODEL, _layout(4, "1f1b"), CLUSTER)
        assert est.memory[-1].inflight_microbatches > one.memory[-1].inflight_microbatches


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_placement_puts_embedding_and_head_on_rank_0(name):
    layout = _layout(4, name, pipeline_split="even")
    P, V = 4, layout.virtual_stages(MODEL)
    assert layout.placement(MODEL) == "v"
    chunks = [rank_chunks(MODEL, layout, r) for r in range(P)]
    assert chunks[0] == [(1, True, False), (1, False, True)]
    assert stage_location(0, P, "v") == (0, 0) and stage_location(P * V - 1, P, "v") == (0, 1)
    assert sum(first for row in chunks for _, first, _ in row) == 1
    assert sum(last for row in chunks for _, _, last in row) == 1
    est = estimate(MODEL, layout, CLUSTER)
    assert est.memory[0].activations > est.memory[1].activations  # the loss's logits live on rank 0


@pytest.mark.parametrize("pp,schedule,per", [(2, None, None), (4, None, None), (4, None, 3), (4, "zb-v", None)])
def test_rank_chunks_follow_the_executors_layer_split(pp, schedule, per):
    balanced = _layout(pp, schedule, num_layers_per_virtual_pipeline_stage=per, micro_batch_size=4)
    even = dataclasses.replace(balanced, pipeline_split="even")
    V, placement = balanced.virtual_stages(GPT_1_3B), balanced.placement(GPT_1_3B)
    want = layers_per_virtual_stage(24, pp, V, head_cost=head_cost_in_layers(2048, 2048, GPT_1_3B.vocab(1)))
    got = [0] * (pp * V)
    for r in range(pp):
        for c, (layers, _, _) in enumerate(rank_chunks(GPT_1_3B, balanced, r)):
            got[virtual_stage(r, c, pp, placement)] = layers
    assert got == want and sum(got) == 24
    assert got[-1] < 24 // (pp * V)  # the stage with the output layer holds fewer layers
    assert all(layers == 24 // (pp * V) for r in range(pp) for layers, _, _ in rank_chunks(GPT_1_3B, even, r))


def test_balanced_split_lowers_the_predicted_step():
    layout = _layout(4, None, micro_batch_size=4, global_batch_size=64)
    balanced = estimate(GPT_1_3B, layout, CLUSTER)
    even = estimate(GPT_1_3B, dataclasses.replace(layout, pipeline_split="even"), CLUSTER)
    assert balanced.step_time_s < even.step_time_s


def _parsed(*extra: str):
    argv = ["--num-layers", "24", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
            "--vocab-size", "1000", "--micro-batch-size", "2", "--global-batch-size", "32", "--bf16",
            "--train-iters", "1", "--lr", "1e-4", *extra]
    return validate_args(parse_args(argv), 4)


@pytest.mark.parametrize("extra,schedule,split,V", [
    ([], None, "balanced", 1),
    (["--pipeline-model-parallel-size", "4"], None, "balanced", 1),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "zb-h1", "--pipeline-split", "even"],
     "zb-h1", "even", 1),
    (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "zb-v"], "zb-v", "balanced", 2),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3"], None, "balanced", 3),
])
def test_layout_from_args_round_trip(extra, schedule, split, V):
    args = _parsed(*extra)
    model, layout = ModelSpec.from_config(gpt.transformer_config_from_args(args)), Layout.from_args(args)
    assert (layout.pipeline_schedule, layout.pipeline_split, layout.virtual_stages(model)) == (schedule, split, V)
    assert layout.virtual_stages(model) == (args.virtual_pipeline_model_parallel_size or 1)
    assert (layout.pp, layout.dp, layout.num_microbatches) == (
        args.pipeline_model_parallel_size, args.data_parallel_size, args.num_microbatches)
    if schedule:
        assert layout.schedule_name(model) == schedule
    estimate(model, layout, CLUSTER)


def test_unknown_schedule_or_split_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown --pipeline-schedule 'zb-h3'.*zb-h1"):
        _layout(4, "zb-h3")
    with pytest.raises(ValueError, match="--pipeline-split"):
        _layout(4, None, pipeline_split="uneven")
    with pytest.raises(ValueError, match="two chunks per rank"):
        _layout(2, "zb-v", num_layers_per_virtual_pipeline_stage=1).check(MODEL)
    assert _layout(1, "zb-h1").schedule_name(MODEL) == "no-pipelining"


@pytest.mark.parametrize("name,V", [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)])
def test_linear_extension_holds_for_zero_bubble_schedules(name, V, monkeypatch):
    from parallel3d.planning.step import _run, simulate_pipeline

    P, M = 4, 64
    costs = [[(1.0 + 0.2 * (r == P - 1), 1.4 + 0.3 * (r == 0), 0.7) for _ in range(V)] for r in range(P)]
    full = _run(name, P, M, V, costs, 0.05)
    monkeypatch.setattr("parallel3d.planning.step.MAX_SIMULATED_ACTIONS", 10)
    ext = simulate_pipeline(name, P, M, V, costs, 0.05)
    assert ext.makespan == pytest.approx(full.makespan, rel=1e-9)
    assert ext.peak_inflight == full.peak_inflight


@pytest.mark.parametrize("argv,world", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
      "--virtual-pipeline-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "32"], 4),
    (["--pipeline-model-parallel-size", "4", "--global-batch-size", "64"], 4),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v", "--global-batch-size", "32"], 2),
])
def test_planner_places_the_layers_where_training_does(argv, world):
    """The planner's layer split is training's (parallel3d.training.gpt), TP's loss (a larger head cost) included."""
    from parallel3d.planning.memory import layer_partition

    shape = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
           "--vocab-size", "50257", "--micro-batch-size", "4"]
    args = validate_args(parse_args(shape + argv, extra_args_provider=gpt.add_sampling_args), world)
    config = gpt.transformer_config_from_args(args)
    training = gpt.layer_partition(args, config)
    assert layer_partition(ModelSpec.from_config(config), Layout.from_args(args)) == training


def test_interleaved_memory_counts_each_held_chunk_by_its_own_layers():
    """PP=2 V=2 balanced on GPT-1.3B: at its peak (F0.0 F1.0 F0.1, the loss running) the last rank
    holds two microbatches of its first chunk and one of its second, each by its own layers, not three
    of the larger one (measured on 2 x H200 with the split of then, chunks of 7 and 4 layers: 24.0
    GiB; counted as 3 x 7 layers: 26.9)."""
    layout = _layout(2, None, num_layers_per_virtual_pipeline_stage=6, micro_batch_size=4, global_batch_size=32)
    first, second = [layers for layers, _, _ in rank_chunks(GPT_1_3B, layout, 1)]
    assert first != second, "a split whose chunks differ, or the test cannot tell them apart"
    est = estimate(GPT_1_3B, layout, CLUSTER)
    mem = est.memory[1]
    per_layer = layer_activation_bytes(GPT_1_3B, layout, None)
    logits = 4 * 2048 * GPT_1_3B.vocab(1)
    assert mem.inflight_microbatches == est.pipeline.peak_inflight[1] == 3
    assert mem.activations == pytest.approx((2 * first + second) * per_layer + LOGIT_SAVED_BYTES * logits)
    # at the peak the backward's working set: one layer's activations, or the loss's beyond what it holds
    work = max(per_layer, (LOGIT_BYTES - LOGIT_SAVED_BYTES) * logits)
    assert mem.activations + mem.transient == pytest.approx(
        (2 * first + second) * per_layer + LOGIT_SAVED_BYTES * logits + work)
    # the count alone (no schedule) is the lower bound the search prunes with: never above the walk
    assert memory_breakdown(GPT_1_3B, layout, 1, 3).peak < mem.peak
    # 1F1B's last rank: one microbatch of its layers while the loss runs
    one_layout = dataclasses.replace(layout, num_layers_per_virtual_pipeline_stage=None)
    (layers, _, _), = rank_chunks(GPT_1_3B, one_layout, 1)
    one = estimate(GPT_1_3B, one_layout, CLUSTER)
    assert one.memory[1].activations + one.memory[1].transient == pytest.approx(
        layers * per_layer + LOGIT_SAVED_BYTES * logits + work)
