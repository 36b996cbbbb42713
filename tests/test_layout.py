"""Pipeline layouts: Megatron's layout string and split flags, the cost-balanced default, clear errors."""
import pytest

from parallel3d.pipeline.layout import LayoutError, expand_layout, layers_per_virtual_stage, parse_layout
from parallel3d.planning.compute import head_cost_in_layers


def layer_counts(num_stages, num_layers=24, **split):
    """GPT-1.3B's shape (padded vocabulary 50304, the one-rank loss) on ``num_stages`` stages."""
    return layers_per_virtual_stage(num_layers, num_stages, head_cost=head_cost_in_layers(2048, 2048, 50304), **split)


def test_layout_grammar():
    assert expand_layout("Et|(tt|)*6L") == "Et|tt|tt|tt|tt|tt|tt|L"
    assert expand_layout("E, t*3 | t*3 L") == "Ettt|tttL"
    assert parse_layout("Et|(tt|)*6L", 8, 13) == [1, 2, 2, 2, 2, 2, 2, 0]
    assert parse_layout("Ettt|(tt|)*2tL", 4, 8) == [3, 2, 2, 1]


@pytest.mark.parametrize("text,stages,layers,message", [
    ("Ett|ttL", 2, 6, r"places 4 transformer layers \(\[2, 2\] per stage\) .* --num-layers 6: it would drop 2"),
    ("Ettt|tttL", 2, 4, r"it would duplicate 2 layer"),
    ("Ett|tt|L", 2, 4, r"has 3 stages, expected pipeline x virtual size = 2"),
    ("tEt|ttL", 2, 4, r"'E' must appear once, first in the first stage"),
    ("Ett|tLt", 2, 4, r"'L' must appear once, last in the last stage"),
    ("Ett|tmL", 2, 3, r"MTP layers \('m'\) are not supported"),
    ("Ett|txL", 2, 3, r"unknown symbols \['x'\]"),
])
def test_layout_errors_name_the_problem(text, stages, layers, message):
    with pytest.raises(LayoutError, match=message):
        parse_layout(text, stages, layers)


def test_head_cost_of_gpt_1_3b_is_what_was_measured():
    # 4 x H100, PP=4, the vocab-parallel loss: output layer + loss 18.7 ms forward + backward per
    # microbatch against 4.9 ms per layer (bench/layouts_bench.py, BENCHMARKS.md): 3.8 layers.
    assert head_cost_in_layers(2048, 2048, 50304, tensor_parallel=True) == pytest.approx(3.8, rel=0.05)
    # the one-rank loss makes fewer passes; the logits GEMM alone would be 1.75 layers
    assert 1.75 < head_cost_in_layers(2048, 2048, 50304) < head_cost_in_layers(2048, 2048, 50304, True)


def test_balanced_default_moves_layers_off_the_loss_stage():
    assert layer_counts(2) == [13, 11]  # 13 vs 11 + 2.8
    assert layer_counts(2, split="even") == [12, 12]
    assert sum(layer_counts(4)) == 24 and layer_counts(4)[-1] < 6


def test_account_for_embedding_and_loss():
    # Megatron: the embedding and the loss each count as a layer of the even split.
    assert layer_counts(4, 6, account_for_embedding=True, account_for_loss=True) == [1, 2, 2, 1]
    assert layer_counts(2, 7, account_for_loss=True) == [4, 3]


def test_pretrain_script_partition_from_the_flags():
    from gpt_harness import layout_args

    from parallel3d.training import gpt
    from parallel3d.training.arguments import ArgumentError

    args = layout_args("gpt2", pp=4, extra=["--pipeline-model-parallel-layout", "Ettt|tt|tt|tL"], world=4)
    assert [len(r[0]) for r in gpt.layer_partition(args)] == [3, 2, 2, 1]
    args = layout_args("gpt2", pp=2, vp=2, extra=["--pipeline-schedule", "zb-v", "--account-for-loss-in-pipeline-split",
                                                  "--account-for-embedding-in-pipeline-split"], world=2)
    # 8 layers + E + L over 4 stages: [2, 3, 3, 2] (inner stages first) -> [1, 3, 3, 1];
    # the V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert gpt.layer_partition(args) == [[range(0, 1), range(7, 8)], [range(1, 4), range(4, 7)]]
    args = layout_args("gpt2", pp=2, extra=["--pipeline-model-parallel-layout", "Ettt|tttL"], world=2)
    with pytest.raises(ArgumentError, match="it would drop 2 layer"):
        gpt.layer_partition(args)


def test_a_layer_total_the_stages_do_not_divide():
    """As Megatron with a layout: 6 layers on 4 stages train when a layout (or the balanced split) places
    them; the even split refuses them by name."""
    from gpt_harness import layout_args

    from parallel3d.training import gpt
    from parallel3d.training.arguments import ArgumentError

    six = ["--num-layers", "6"]
    args = layout_args("gpt2", pp=4, extra=six + ["--pipeline-model-parallel-layout", "Et|tt|tt|tL"], world=4)
    config = gpt.transformer_config_from_args(args)
    assert [len(r[0]) for r in gpt.layer_partition(args, config)] == [1, 2, 2, 1]
    args = layout_args("gpt2", pp=4, extra=six, world=4)
    assert sum(len(r[0]) for r in gpt.layer_partition(args, gpt.transformer_config_from_args(args))) == 6
    args = layout_args("gpt2", pp=4, extra=six + ["--pipeline-split", "even"], world=4)
    with pytest.raises(ArgumentError, match=r"num_layers \(6\) is not divisible by .* = 4: no even split"):
        gpt.layer_partition(args, gpt.transformer_config_from_args(args))


def test_layout_string_wins_then_explicit_first_last():
    assert layer_counts(2, 4, layout="Et|tttL", first_stage_layers=1) == [1, 3]
    assert layer_counts(2, first_stage_layers=10) == [10, 14]
    # Megatron's uneven split over virtual stages: the first/last rank's layers spread over its chunks
    assert layers_per_virtual_stage(10, 3, 2, first_stage_layers=2, last_stage_layers=4) == [1, 2, 2, 1, 2, 2]
    with pytest.raises(LayoutError, match=r"the 3 layers left for the 2 middle pipeline stage\(s\) are not divisible"):
        layer_counts(3, 5, first_stage_layers=2)
    with pytest.raises(LayoutError, match=r"the 0 layers left for the 1 middle pipeline stage\(s\) .* \(or are none\)"):
        layer_counts(3, 4, first_stage_layers=2, last_stage_layers=2)
    with pytest.raises(LayoutError, match=r"3 layers cannot fill 4 virtual stages"):
        layer_counts(4, 3)
