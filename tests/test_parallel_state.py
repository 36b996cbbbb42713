"""parallel_state: group tables (pure function) and a real 8-process check."""
import itertools

import pytest
import torch.distributed as dist

from parallel3d import parallel_state as ps
from parallel3d.testing import DistributedTestError, run_distributed


def test_megatron_table_world16_tp2_pp4():
    g = ps.build_group_ranks(16, 2, 4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert "position_embedding" not in g  # one rank per group: nothing to reduce
    assert g["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_tp_pp_dp_order():
    g = ps.build_group_ranks(16, 2, 4, order="tp-pp-dp")
    assert g["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["dp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g["embedding"] == [[0, 6], [1, 7], [8, 14], [9, 15]]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (8, 2, 2), (8, 1, 8), (8, 8, 1), (12, 2, 3), (64, 4, 4)])
@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp"])
def test_groups_partition_the_world(world, tp, pp, order):
    g = ps.build_group_ranks(world, tp, pp, order)
    dp = world // (tp * pp)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp), ("mp", tp * pp)):
        flat = sorted(r for grp in g[kind] for r in grp)
        assert flat == list(range(world)), kind
        assert all(len(grp) == size for grp in g[kind]), kind
    # a TP group and a DP group meet in exactly one rank, and so do TP and PP
    for t in g["tp"]:
        for d in g["dp"]:
            assert len(set(t) & set(d)) <= 1
    if order == "tp-dp-pp":
        assert all(grp == list(range(grp[0], grp[0] + tp)) for grp in g["tp"])  # TP ranks adjacent
    assert all(e == ([p[0], p[-1]] if pp > 1 else [p[0]]) for e, p in zip(g["embedding"], g["pp"]))


@pytest.mark.parametrize(
    "args,match",
    [
        ((12, 5, 1), r"world size \(12\) is not divisible by tensor_model_parallel_size \(5\)"),
        ((8, 2, 3), r"= 6"),
        ((8, 0, 1), r"must be >= 1"),
    ],
)
def test_bad_sizes_name_the_numbers(args, match):
    with pytest.raises(ValueError, match=match):
        ps.build_group_ranks(*args)


@pytest.mark.parametrize("order,match", [("tp-xx-pp", "order must name each of tp-dp-pp"),
                                         ("tp-tp-dp-pp", "order must name each of tp-dp-pp"),
                                         ("tp-pp", "order 'tp-pp' leaves out dp, whose size is 2")])
def test_bad_order(order, match):
    with pytest.raises(ValueError, match=match):
        ps.build_group_ranks(8, 2, 2, order=order)


ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))] + ["tp-cp-ep-dp-pp", "TP-PP-CP-DP", "tp-dp"]


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_matches_megatron_rank_generator(order):
    """Megatron's order strings (any permutation; cp and ep at size 1; a size-1 dim left out) give
    Megatron-Core's groups: its RankGenerator where megatron-core is installed, else the grid's own
    definition (ranks that differ only in the group's dimensions) checked by brute force."""
    for world, tp, pp in ((16, 2, 4), (24, 2, 3), (8, 1, 2), (4, 2, 1)):
        if order == "tp-dp" and pp > 1:
            continue
        g = ps.build_group_ranks(world, tp, pp, order)
        dp = world // (tp * pp)
        try:
            from megatron.core.parallel_state import RankGenerator
        except ImportError:  # megatron-core not installed: the definition itself
            dims = ps.parse_order(order)
            sizes = {"tp": tp, "dp": dp, "pp": pp}

            def coord(r):
                out = {}
                for d in dims:
                    out[d], r = r % sizes[d], r // sizes[d]
                return out
            for kind, varying in ps.GROUPS.items():
                for group in g[kind]:
                    fixed = {d: v for d, v in coord(group[0]).items() if d not in varying}
                    assert group == [r for r in range(world) if all(coord(r)[d] == v for d, v in fixed.items())]
            continue
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order.lower())
        for kind, token in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mp", "tp-pp")):
            assert g[kind] == gen.get_ranks(token), (kind, world, tp, pp)


def test_megatron_keywords_refused_by_name_before_any_work():
    for name, value in (("context_parallel_size", 2), ("expert_model_parallel_size", 2),
                        ("num_distributed_optimizer_instances", 2), ("expert_tensor_parallel_size", 4),
                        ("use_sharp", True), ("get_embedding_ranks", lambda ranks, pp=None: ranks)):
        with pytest.raises(ValueError, match=f"initialize_model_parallel: {name}=.* is not supported"):
            ps.initialize_model_parallel(2, **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        ps.initialize_model_parallel(no_such_option=1)


def test_training_passes_each_layout_size_by_name_to_the_groups_and_the_model_config():
    """A new dimension is its entry in DIMENSIONS: training reads the layout's sizes off the arguments as one
    record (model_parallel_sizes) and passes them by Megatron's names, so initialize_model_parallel and
    TransformerConfig must take each, and the record must carry the values given."""
    import dataclasses
    import inspect

    from parallel3d.models import TransformerConfig
    from parallel3d.training.arguments import parse_args, validate_args
    from parallel3d.training.gpt import transformer_config_from_args
    from parallel3d.training.training_config import TrainingConfig

    assert set(ps.MODEL_PARALLEL_SIZES) <= set(inspect.signature(ps.initialize_model_parallel).parameters)
    assert set(ps.MODEL_PARALLEL_SIZES) <= {f.name for f in dataclasses.fields(TransformerConfig)}
    args = validate_args(parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--virtual-pipeline-model-parallel-size", "2", "--num-layers", "8",
                                     "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "8"]), 8)
    given = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
             "virtual_pipeline_model_parallel_size": 2}
    layout = TrainingConfig.from_args(args).layout
    assert (layout.model_parallel_sizes, layout.data_parallel_size) == (given, 2)
    config = transformer_config_from_args(args)
    assert {name: getattr(config, name) for name in given} == given


def test_not_initialised_error():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ps.initialize_model_parallel(1, 1)
    with pytest.raises(RuntimeError, match="not initialised"):
        ps.get_tensor_model_parallel_group()


def _check_real_groups(rank, world_size):
    expect = ps.build_group_ranks(world_size, 2, 2)
    out = {}
    for order in ("tp-dp-pp", "tp-pp-dp"):
        # Megatron's keywords at the values that mean this layout are accepted
        state = ps.initialize_model_parallel(2, 2, virtual_pipeline_model_parallel_size=2,
                                             order=order.replace("tp-", "tp-cp-ep-"), distributed_timeout_minutes=1,
                                             context_parallel_size=1, expert_model_parallel_size=1,
                                             expert_tensor_parallel_size=2, create_gloo_process_groups=False)
        assert state.order == order
        tables = ps.build_group_ranks(world_size, 2, 2, order)
        for kind in ("tp", "pp", "dp", "mp", "embedding"):
            mine = [grp for grp in tables[kind] if rank in grp]
            assert state.group_ranks[kind] == (mine[0] if mine else []), kind
        # the groups really connect the ranks we think they do
        for kind, group in (("tp", ps.get_tensor_model_parallel_group()),
                            ("pp", ps.get_pipeline_model_parallel_group()),
                            ("dp", ps.get_data_parallel_group()),
                            ("dp", ps.get_data_parallel_group(with_context_parallel=False)),
                            ("dp", ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)),
                            ("mp", ps.get_model_parallel_group())):
            got = [None] * dist.get_world_size(group)
            dist.all_gather_object(got, rank, group=group)
            assert got == state.group_ranks[kind], (kind, got)
        if ps.is_rank_in_embedding_group():
            got = [None] * 2
            dist.all_gather_object(got, rank, group=ps.get_embedding_group())
            assert got == state.group_ranks["embedding"]
        assert ps.get_tensor_model_parallel_world_size() == 2
        assert ps.get_data_parallel_world_size() == 2
        pp_rank = ps.get_pipeline_model_parallel_rank()
        # Megatron-Core's default ignore_virtual=True: the pipeline rank alone
        assert ps.is_pipeline_first_stage() == ps.is_pipeline_first_stage(ignore_virtual=True) == (pp_rank == 0)
        assert ps.is_pipeline_last_stage() == (pp_rank == 1)
        assert ps.is_pipeline_first_stage(vp_stage=1) == (pp_rank == 0)
        assert not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
        assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1) == (pp_rank == 1)
        assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) == (pp_rank == 0)
        assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=0) == (pp_rank == 0)
        assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=1) == (pp_rank == 1)
        with pytest.raises(ValueError, match="pass vp_stage"):
            ps.is_pipeline_first_stage(ignore_virtual=False)  # which chunk? no global "current virtual rank"
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
        try:
            ps.initialize_model_parallel(2, 2)
        except RuntimeError as e:
            assert "already initialised" in str(e)
        else:
            raise AssertionError("second initialize_model_parallel did not fail")
        out[order] = (ps.get_tensor_model_parallel_rank(), pp_rank, ps.get_data_parallel_rank())
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()
    try:
        ps.initialize_model_parallel(1, 1, virtual_pipeline_model_parallel_size=2)
    except ValueError as e:
        assert "needs pipeline_model_parallel_size > 1" in str(e)
    else:
        raise AssertionError("virtual stages with PP=1 did not fail")
    return out


def test_real_groups_8_processes():
    results = run_distributed(_check_real_groups, 8, timeout=90)
    # rank = tp + 2*(dp + 2*pp) in the default order
    for rank, res in enumerate(results):
        assert res["tp-dp-pp"] == (rank % 2, rank // 4, (rank // 2) % 2)
        assert res["tp-pp-dp"] == (rank % 2, (rank // 2) % 2, rank // 4)


def _hang_on_rank1(rank, world_size):
    import time

    import torch
    if rank == 1:  # stays alive without joining (a rank that returned would close the connection instead)
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1 forever
    return "unreachable"


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    import torch
    dist.all_reduce(torch.ones(1))


def test_harness_reports_hangs_and_errors():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank1, 2, timeout=8)
    msg = str(info.value)
    assert "rank 0" in msg and ("all_reduce" in msg or "timed out" in msg), msg
    with pytest.raises(DistributedTestError, match="rank 1 raised") as info:
        run_distributed(_raise_on_rank1, 2, timeout=30)
    assert "planted failure on rank 1" in str(info.value)


def test_getters_raise_when_not_initialised():
    assert not ps.model_parallel_is_initialized()
    for getter in (ps.get_tensor_model_parallel_rank, ps.get_data_parallel_world_size, ps.get_data_parallel_group,
                   ps.get_pipeline_model_parallel_rank, ps.is_rank_in_embedding_group):
        with pytest.raises(RuntimeError, match="not initialised"):
            getter()
    # Layers and models without groups build the one-process version; they ask explicitly:
    one = ps.resolve_parallel_state()
    assert (one.tensor_model_parallel_size, one.data_parallel_size, one.data_parallel_group) == (1, 1, None)


def _ddp_without_groups(rank, world_size):
    import torch

    from parallel3d.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with pytest.raises(RuntimeError, match="not initialised"):  # never silently DDP over WORLD
        DistributedDataParallel(torch.nn.Linear(2, 2), DistributedDataParallelConfig())
    ddp = DistributedDataParallel(torch.nn.Linear(2, 2), DistributedDataParallelConfig(), dp_group=dist.group.WORLD)
    assert ddp.dp_size == world_size


def test_ddp_needs_groups_under_torch_distributed():
    run_distributed(_ddp_without_groups, 2)


def _tp_layers_without_groups(rank, world_size):
    import torch

    from parallel3d import tensor_parallel as tp
    from parallel3d.testing import single_process_layout

    if world_size == 1:  # a job of one process has one layout: the layer builds as one process
        return tp.ColumnParallelLinear(8, 8).tp_group is None
    for build in (lambda: tp.ColumnParallelLinear(8, 8),
                  lambda: tp.vocab_parallel_cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long)),
                  lambda: tp.model_parallel_cuda_manual_seed(1234)):  # else every rank seeds as TP rank 0
        with pytest.raises(RuntimeError, match=f"job of {world_size} processes.*initialize_model_parallel"):
            build()
    with single_process_layout():  # what a test's single-process reference does
        layer = tp.ColumnParallelLinear(8, 8, gather_output=True)
        assert dist.get_world_size(layer.tp_group) == 1 and layer(torch.randn(2, 8))[0].shape == (2, 8)
    return True


def test_tp_layers_refuse_a_job_of_several_processes_without_groups():
    """A TP layer (or the TP RNG seeding) without groups in a job of several processes would act on each rank as if
    alone: refused (as DDP refuses); alone in its job, or without torch.distributed, it is the one-process layer."""
    assert run_distributed(_tp_layers_without_groups, 2, timeout=60) == [True, True]
    assert run_distributed(_tp_layers_without_groups, 1, timeout=60) == [True]
    from parallel3d import tensor_parallel as tp

    assert tp.ColumnParallelLinear(8, 8).tp_group is None  # this process: no torch.distributed
