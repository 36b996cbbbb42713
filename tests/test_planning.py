"""The planner's cost model (parallel3d/planning): memory against real models, ranking
invariants, the simulator extension, and SC21's published Table 1 within 15%."""
import dataclasses
import math
import os

import pytest
import torch

from gpt_harness import layout_args, train
from sc21 import TABLE_1, figure_12, reproduce

from parallel3d.training import gpt
from parallel3d.planning import GemmCurve, Layout, ModelSpec, estimate, get_cluster, load_cluster
from parallel3d.planning.hardware import cluster_from_dict
from parallel3d.planning.search import candidates
from parallel3d.planning.memory import static_bytes
from parallel3d.models import gpt2_config, llama_config
from parallel3d.planning.model import model_flops, num_floating_point_operations
from parallel3d.planning.search import candidates, search
from parallel3d.planning.step import _run, simulate_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPT_1_3B = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257)
H100 = get_cluster("h100-sxm")


def _storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    for ptr in exclude:
        seen.pop(ptr, None)
    return sum(seen.values())


def _allocated(result):
    """(params, grads, optimizer) bytes the real library allocated for one process."""
    chunks, opt = result["model"], result["optimizer"]
    params = [p for c in chunks for p in c.module.parameters()]
    grads = [buf.grad_data for c in chunks for buf in c.param_and_grad_buffers]
    owned = {t.untyped_storage().data_ptr() for t in params + grads}
    states = [t for st in opt.optimizer.state.values() for k, t in st.items() if k != "step"]
    return (_storage_bytes(params), _storage_bytes(grads),
            _storage_bytes(list(opt._main_params()) + states, exclude=owned))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("extra", [["--bf16"], ["--bf16", "--use-distributed-optimizer"], []],
                         ids=["bf16", "bf16-zero1", "fp32"])
def test_static_memory_matches_the_real_optimizers(family, extra):
    args = layout_args(family, extra=extra, iters=2)
    result = train(args)  # two Adam steps: every state tensor exists
    model = ModelSpec.from_config(gpt.transformer_config_from_args(args))
    assert model.total_params() == sum(p.numel() for p in result["model"][0].module.parameters())
    zero = "--use-distributed-optimizer" in extra
    layout = Layout(use_distributed_optimizer=zero, bf16="--bf16" in extra, global_batch_size=args.global_batch_size)
    predicted = static_bytes(model, layout, 0)
    measured = _allocated(result)
    if not zero:
        assert measured == tuple(int(x) for x in predicted)
    else:  # ZeRO pads each bucket to a multiple of 64 x DP elements; the model ignores that padding
        buckets = sum(len(b.buckets) for c in result["model"] for b in c.param_and_grad_buffers)
        for got, want, per_elem in zip(measured, predicted, (2, 4, 4)):
            assert want <= got <= want + buckets * 64 * per_elem


def test_flops_formula_is_megatrons():
    # GPT-1.3B, batch 16: 6 B s (L (12 h^2) + h V) + 6 B s^2 L h (causal attention counted as half).
    b, s, L, h, V = 16, 2048, 24, 2048, 50304
    expected = 6 * b * s * (L * 12 * h * h + h * V) + 6 * b * s * s * L * h
    got = num_floating_point_operations(batch_size=b, seq_length=s, num_layers=L, hidden_size=h,
                                        num_attention_heads=16, kv_channels=None, num_query_groups=None,
                                        ffn_hidden_size=4 * h, swiglu=False, padded_vocab_size=V)
    assert got == expected


def test_gemm_curve_fit_recovers_its_parameters():
    curve = GemmCurve(peak_tflops=989.4, max_efficiency=0.8, half_dim=120.0)
    shapes = [(8192, 8192, 8192), (4096, 4096, 16384), (16384, 2048, 2048), (2048, 1024, 8192)]
    points = [(m, n, k, curve.efficiency(m, n, k) * 989.4) for m, n, k in shapes]
    fit = GemmCurve.fit(points, 989.4)
    assert fit.max_efficiency == pytest.approx(0.8, rel=1e-9) and fit.half_dim == pytest.approx(120.0, rel=1e-6)


def test_gemm_curve_fit_ignores_a_fixed_per_call_overhead():
    """A constant 25 us per timed call (host dispatch) must not bend the curve (it once fitted E < 0)."""
    curve = GemmCurve(peak_tflops=989.4, max_efficiency=0.8, half_dim=90.0)
    shapes = [(8192, 8192, 8192), (1024, 1024, 1024), (2048, 2048, 2048), (8192, 2048, 2048), (16384, 1024, 4096)]
    points = []
    for m, n, k in shapes:
        t = 2 * m * n * k / (curve.efficiency(m, n, k) * 989.4e12) + 25e-6
        points.append((m, n, k, 2 * m * n * k / t / 1e12))
    fit = GemmCurve.fit(points, 989.4)
    assert fit.max_efficiency == pytest.approx(0.8, rel=1e-6) and fit.half_dim == pytest.approx(90.0, rel=1e-4)


def test_shipped_h100_calibration_fits_a_sane_curve():
    cluster = load_cluster(os.path.join(ROOT, "bench", "clusters", "h100-sxm-2x.json"))
    assert 0.7 < cluster.gemm.max_efficiency < 0.9
    assert cluster.gemm.efficiency(8192, 8192, 8192) * 989.4 == pytest.approx(776, rel=0.05)  # measured 776


def test_cluster_file_round_trip(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(H100.to_json())
    assert load_cluster(str(path)) == H100
    with pytest.raises(ValueError, match="unknown cluster fields"):
        cluster_from_dict({**dataclasses.asdict(H100), "gpus": 3})


@pytest.mark.parametrize("name,P,M,V", [("1f1b", 4, 64, 1), ("1f1b", 8, 96, 1), ("interleaved-1f1b", 4, 64, 2),
                                      ("no-pipelining", 1, 900, 1)])
def test_linear_extension_equals_the_full_simulation(name, P, M, V, monkeypatch):
    costs = [[(1.0 + 0.2 * (r == P - 1), 2.1 + 0.3 * (r == 0)) for _ in range(V)] for r in range(P)]
    full = _run(name, P, M, V, costs, 0.05)
    monkeypatch.setattr("parallel3d.planning.step.MAX_SIMULATED_ACTIONS", 10)
    ext = simulate_pipeline(name, P, M, V, costs, 0.05)
    assert ext.makespan == pytest.approx(full.makespan, rel=1e-9)
    assert ext.finish == pytest.approx([tl[-1][1] for tl in full.timelines], rel=1e-9)
    assert ext.peak_inflight == full.peak_inflight


def test_more_gpus_never_lower_total_throughput():
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        totals = []
        for dp in (1, 2, 4, 8):
            layout = Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                            micro_batch_size=2, global_batch_size=128, sequence_parallel=tp > 1)
            est = estimate(GPT_1_3B, layout, get_cluster("h100-8x64"))
            totals.append(est.tokens_per_s_per_gpu * layout.num_gpus)
        assert totals == sorted(totals), (tp, pp, totals)


def test_recompute_lowers_memory_and_raises_time():
    base = Layout(pipeline_model_parallel_size=2, micro_batch_size=4, global_batch_size=32)
    runs = [estimate(GPT_1_3B, dataclasses.replace(base, recompute_granularity=rc), H100)
            for rc in (None, "full")]
    assert runs[1].peak_memory_gib < runs[0].peak_memory_gib
    assert runs[1].step_time_s > runs[0].step_time_s
    unfused = dataclasses.replace(GPT_1_3B, attention_backend="local")
    sel = [estimate(unfused, dataclasses.replace(base, recompute_granularity=rc), H100) for rc in (None, "selective")]
    assert sel[1].peak_memory_gib < sel[0].peak_memory_gib and sel[1].step_time_s > sel[0].step_time_s


def test_search_tries_every_zero_bubble_schedule():
    layouts = candidates(GPT_1_3B, H100, 4, Layout(global_batch_size=64), (4,))
    schedules = {layout.pipeline_schedule for layout in layouts if layout.pp == 4}
    assert schedules == {None, "zb-h1", "zb-h2", "zb-v", "dualpipev"}
    assert all(layout.pipeline_schedule is None for layout in layouts if layout.pp == 1)


def test_search_ranks_only_fitting_layouts_and_finds_the_true_best():
    small = dataclasses.replace(H100, memory_gib=30.0)
    base = Layout(global_batch_size=32)
    found = search(GPT_1_3B, small, 8, base, top=3, micro_batch_sizes=(1, 4))
    assert found.best and all(e.fits for e in found.best)
    assert [e.step_time_s for e in found.best] == sorted(e.step_time_s for e in found.best)
    everything = [estimate(GPT_1_3B, layout, small) for layout in candidates(GPT_1_3B, small, 8, base, (1, 4))]
    fitting = sorted(e.step_time_s for e in everything if e.fits)
    assert [e.step_time_s for e in found.best] == pytest.approx(fitting[:3])
    assert any(not e.fits for e in everything)  # the small card really excluded some


@pytest.mark.parametrize("row", TABLE_1, ids=[r.name for r in TABLE_1])
def test_sc21_table_1_within_15_percent(row):
    est, tflops = reproduce(row)
    assert est.fits
    assert abs(tflops / row.published_tflops - 1) <= 0.15, f"{row.name}: {tflops:.1f} vs {row.published_tflops}"


def test_sc21_figure_12_interleaving_gap_shrinks_with_batch():
    rows = figure_12()
    gaps = [inter / plain for _, inter, plain in rows]
    assert all(g > 1 for g in gaps)  # interleaved is faster at every batch size
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < gaps[0]
    assert all(math.isfinite(x) for row in rows for x in row)



def _built_params(config) -> int:
    from parallel3d.models import GPTModel

    return sum(p.numel() for p in GPTModel(config).parameters())


@pytest.mark.parametrize("config", [
    gpt2_config("tiny"),
    gpt2_config("tiny", num_query_groups=2, ffn_hidden_size=96, untie_embeddings_and_output_weights=True),
    llama_config("tiny"),
    llama_config("tiny", hidden_size=96, num_attention_heads=6, num_query_groups=3, kv_channels=32),
], ids=["gpt2", "gpt2-gqa-untied", "llama", "llama-kv-channels"])
def test_planner_and_builder_describe_one_model(config):
    """ModelSpec.from_config counts the parameters the builder allocates and the FLOPs training reports."""
    spec = ModelSpec.from_config(config)
    assert spec.total_params() == _built_params(config)
    assert model_flops(spec, 8) == config.num_floating_point_operations(8)


def test_swiglu_without_ffn_hidden_size_prices_the_mlp_training_builds():
    """tools/plan.py --swiglu without --ffn-hidden-size: LLaMA's width, as TransformerConfig fills it (not 4h)."""
    config = llama_config("tiny", hidden_size=96, num_attention_heads=6, num_query_groups=3)
    spec = ModelSpec(num_layers=2, hidden_size=96, num_attention_heads=6, seq_length=32, vocab_size=1000,
                     num_query_groups=3, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    assert spec.ffn == config.ffn_hidden_size == 256  # 4h would be 384
    assert spec.total_params() == _built_params(config)
    assert model_flops(spec, 8) == config.num_floating_point_operations(8)


def test_hopper_prices_a_collective_beside_a_gemm_as_exposed_and_the_search_tries_tp_without_sp():
    """On Hopper a collective beside a persistent cuBLAS GEMM waits for it (BENCHMARKS.md, "Tensor parallelism:
    the link"): the planner counts it whole there, hidden behind the GEMM only where the cluster says so;
    the search offers TP with and without SP (SP for its memory, without for its speed where it fits)."""
    tp2 = Layout(tensor_model_parallel_size=2, micro_batch_size=4, global_batch_size=16)
    sp, no_sp = dataclasses.replace(tp2, sequence_parallel=True), tp2
    hopper = dataclasses.replace(get_cluster("h100-sxm"), host_layer_us=0.0)  # the GPU's side alone: see below
    overlapping = dataclasses.replace(hopper, comm_overlaps_gemm=True)
    for layout in (sp, no_sp):
        assert estimate(GPT_1_3B, layout, hopper).step_time_s > estimate(GPT_1_3B, layout, overlapping).step_time_s
    assert estimate(GPT_1_3B, sp, hopper).peak_memory_gib < estimate(GPT_1_3B, no_sp, hopper).peak_memory_gib
    layouts = candidates(GPT_1_3B, hopper, 2, Layout(global_batch_size=16), (4,))
    assert {layout.sequence_parallel for layout in layouts if layout.tp == 2} == {True, False}


def test_a_rank_whose_gpu_outruns_the_host_waits_for_its_launches():
    """The host's launch time per layer (ClusterSpec.host_layer_us; BENCHMARKS.md, issue 26's third lease): at TP=2
    + SP, micro-batch 4, a GPT-1.3B rank's GPU work is shorter than its host's launches, and the step takes the
    host's time; at micro-batch 8 (the same tokens) the GPU is the slower again; one GPU is GPU-bound."""
    hopper = get_cluster("h100-sxm")
    gpu_only = dataclasses.replace(hopper, host_layer_us=0.0)
    tp2_sp = Layout(tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=4, global_batch_size=16)
    host_bound = estimate(GPT_1_3B, tp2_sp, hopper)
    host_time = 24 * 4 * hopper.host_layer_us * 1e-6  # layers x microbatches
    assert host_bound.host_wait_s > 0 and any("host-bound" in w for w in host_bound.warnings)
    assert host_bound.step_time_s > estimate(GPT_1_3B, tp2_sp, gpu_only).step_time_s
    assert host_bound.step_time_s >= host_time
    mbs8 = estimate(GPT_1_3B, dataclasses.replace(tp2_sp, micro_batch_size=8), hopper)
    assert mbs8.host_wait_s == 0 and mbs8.tokens_per_s_per_gpu > host_bound.tokens_per_s_per_gpu
    one_gpu = Layout(micro_batch_size=4, global_batch_size=16)
    assert estimate(GPT_1_3B, one_gpu, hopper).step_time_s == estimate(GPT_1_3B, one_gpu, gpu_only).step_time_s


def test_cuda_graphs_take_the_host_out_of_a_host_bound_step():
    """--enable-cuda-graph: a layer's launches are two replays, so the host-bound TP=2 + SP step becomes the GPU's
    (the planner then predicted the measured rate within 1%, BENCHMARKS.md); a layout graphs cannot hold is
    refused by name."""
    hopper = get_cluster("h100-sxm")
    tp2_sp = Layout(tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=4, global_batch_size=16)
    graphed = estimate(GPT_1_3B, dataclasses.replace(tp2_sp, enable_cuda_graph=True), hopper)
    gpu_only = estimate(GPT_1_3B, tp2_sp, dataclasses.replace(hopper, host_layer_us=0.0))
    assert graphed.host_wait_s == 0 and not any("host-bound" in w for w in graphed.warnings)
    assert graphed.step_time_s == gpu_only.step_time_s < estimate(GPT_1_3B, tp2_sp, hopper).step_time_s
    assert "CUDA graphs" in graphed.layout.describe(GPT_1_3B)
    pipelined = Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=4,
                       global_batch_size=16, enable_cuda_graph=True)
    pipelined.check(GPT_1_3B)  # 1F1B: each forward in flight replays a slot of its own
    with pytest.raises(ValueError, match="--enable-cuda-graph needs a 1F1B or interleaved schedule"):
        dataclasses.replace(pipelined, pipeline_schedule="zb-h1").check(GPT_1_3B)


def test_the_search_offers_cuda_graphs_where_training_can_use_them():
    """TP layouts with and without graphs are both candidates (the host-bound TP step then ranks with graphs),
    with dropout too, none with a zero-bubble schedule or recomputation, which graphs cannot hold."""
    hopper = get_cluster("h100-sxm")
    base = Layout(global_batch_size=16)
    found = candidates(GPT_1_3B, hopper, 4, base)
    graphed = [layout for layout in found if layout.enable_cuda_graph]
    assert graphed and all(layout.tp > 1 and layout.pipeline_schedule is None and layout.recompute_granularity is None
                           for layout in graphed)
    assert any(layout.pp > 1 for layout in graphed)
    eager = {dataclasses.replace(layout, enable_cuda_graph=True) for layout in found
             if layout.tp > 1 and layout.pipeline_schedule is None and layout.recompute_granularity is None}
    assert set(graphed) == eager
    with_dropout = dataclasses.replace(GPT_1_3B, hidden_dropout=0.1)
    assert any(layout.enable_cuda_graph for layout in candidates(with_dropout, hopper, 2, base))


def test_the_planner_prices_the_copy_engine_gathers_only_where_training_runs_them():
    """The SP input gathers on the copy engines cost copy_engine_gather_cost of their NCCL time, under SP with
    graphs (training's rule, symmetric_memory.gathers_run); eager, or turned off, they cost what they did."""
    cluster = dataclasses.replace(get_cluster("h100-sxm"), copy_engine_gather_cost=0.25)
    base = Layout(tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=4, global_batch_size=16,
                  enable_cuda_graph=True)
    on = estimate(GPT_1_3B, base, cluster)
    off = estimate(GPT_1_3B, dataclasses.replace(base, tp_symmetric_gathers=False), cluster)
    unpriced = estimate(GPT_1_3B, base, dataclasses.replace(cluster, copy_engine_gather_cost=1.0))
    assert base.symmetric_gathers and on.tp_comm_s < off.tp_comm_s
    assert unpriced.tp_comm_s == pytest.approx(off.tp_comm_s)  # on Hopper every input gather was exposed
    eager = dataclasses.replace(base, enable_cuda_graph=False)
    assert not eager.symmetric_gathers
    assert estimate(GPT_1_3B, eager, cluster).tp_comm_s == pytest.approx(
        estimate(GPT_1_3B, dataclasses.replace(eager, tp_symmetric_gathers=False), cluster).tp_comm_s)
