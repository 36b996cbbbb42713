"""The FP8 linear (parallel3d/tensor_parallel/fp8.py) against an explicit quantize-dequantize reference,
delayed scaling's history and scales, and the refusals.

The reference is written here from the definition: q(t) = fp8(clamp(t * s)) with
s = fp8_max / amax (per tensor, or per row along the GEMM's contracted dimension for rowwise), and
a GEMM of dequantized operands q / s in fp32. The layer's emulated GEMMs do the same arithmetic, so
they agree to fp32 rounding of the matmul (1e-6 relative here).
"""
import pytest
import torch

from parallel3d.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from parallel3d.tensor_parallel.fp8 import Fp8ConfigError, Fp8Recipe, is_fp8_state_key, update_fp8_scaling  # noqa: E402
from parallel3d.models import TransformerConfig  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def qdq(t, dtype, axis=None, scale=None):
    """Quantize-dequantize by the definition (fp32)."""
    t = t.float()
    if scale is None:
        amax = t.abs().amax() if axis is None else t.abs().amax(dim=axis, keepdim=True)
        scale = (torch.finfo(dtype).max / amax.double()).float()
    fmax = torch.finfo(dtype).max
    return (t * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def reference(x, w, b, go, fmt, recipe, wgrad=True):
    """(out, grad_x, grad_w, grad_b) of one linear's three GEMMs in FP8, from the definition."""
    gdt = E5M2 if fmt == "hybrid" else E4M3
    ax = {"rowwise": (1, 1, 1, 0, 0, 0)}.get(recipe, (None,) * 6)  # x, w (fprop); go, w (dgrad); go, x (wgrad)
    out = qdq(x, E4M3, ax[0]) @ qdq(w, E4M3, ax[1]).t() + (0 if b is None else b)
    gx = qdq(go, gdt, ax[2]) @ qdq(w, E4M3, ax[3])
    gw = qdq(go, gdt, ax[4]).t() @ qdq(x, E4M3, ax[5]) if wgrad else go.t() @ x
    return out, gx, gw, None if b is None else go.sum(0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
def test_fp8_linear_equals_quantize_dequantize_reference(recipe, fmt, layer):
    torch.manual_seed(0)
    lin = layer(24, 40, fp8=Fp8Recipe(format=fmt, recipe=recipe), bias=layer is ColumnParallelLinear)
    with torch.no_grad():
        if lin.bias is not None:
            lin.bias.normal_()
    x = torch.randn(6, 2, 24, requires_grad=True)
    go = torch.randn(6, 2, 40) * 1e-3  # a gradient's size: e5m2 rounds it, scaled, without flushing to zero
    out, _ = lin(x)
    out.backward(go)
    want = reference(x.detach().reshape(-1, 24), lin.weight.detach(), None if lin.bias is None else lin.bias.detach(),
                     go.reshape(-1, 40), fmt, recipe)
    for name, got, ref in zip(("output", "input grad", "weight grad", "bias grad"),
                              (out.reshape(-1, 40), x.grad.reshape(-1, 24), lin.weight.grad,
                               None if lin.bias is None else lin.bias.grad), want):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item(), msg=name)
    # and it is FP8: the high-precision GEMM is not what came out
    assert (out.reshape(-1, 40) - (x @ lin.weight.t()).reshape(-1, 40)
            - (0 if lin.bias is None else lin.bias)).abs().max() > 1e-4


def test_no_fp8_wgrad_keeps_the_weight_gradient_in_high_precision():
    torch.manual_seed(0)
    lin = ColumnParallelLinear(24, 40, fp8=Fp8Recipe(recipe="tensorwise", wgrad=False), bias=False)
    x, go = torch.randn(12, 24, requires_grad=True), torch.randn(12, 40)
    lin(x)[0].backward(go)
    _, gx, gw, _ = reference(x.detach(), lin.weight.detach(), None, go, "hybrid", "tensorwise", wgrad=False)
    torch.testing.assert_close(lin.weight.grad, gw, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, gx, rtol=1e-6, atol=1e-7)


def test_main_grad_and_deferred_wgrad_take_the_fp8_gemm():
    """The fused main_grad path adds the FP8 wgrad into main_grad; a zero-bubble B defers it to W."""
    from parallel3d.tensor_parallel import wgrad_store

    torch.manual_seed(0)
    lin = ColumnParallelLinear(24, 40, fp8=Fp8Recipe(recipe="rowwise"), bias=False, gradient_accumulation_fusion=True)
    x, go = torch.randn(12, 24), torch.randn(12, 40)
    _, _, want, _ = reference(x, lin.weight.detach(), None, go, "hybrid", "rowwise")
    lin.weight.main_grad = torch.ones(40, 24)
    lin(x)[0].backward(go)
    torch.testing.assert_close(lin.weight.main_grad, want + 1, rtol=1e-6, atol=1e-6)
    lin.weight.main_grad.zero_()
    deferred = []
    with wgrad_store.deferring([lin.weight], deferred):
        lin(x)[0].backward(go)
    assert len(deferred) == 1 and lin.weight.main_grad.abs().max() == 0
    wgrad_store.run_deferred(deferred)
    torch.testing.assert_close(lin.weight.main_grad, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_delayed_scaling_history_and_scales(algo):
    """Step 1 scales by the tensors' own amaxes; each step's amaxes (max over microbatches) enter the
    history once per step; later steps quantize with fp8_max / amax(history) / 2**margin."""
    torch.manual_seed(0)
    recipe = Fp8Recipe(format="hybrid", recipe="delayed", amax_history_len=2, amax_compute_algo=algo, margin=1)
    lin = ColumnParallelLinear(16, 8, fp8=recipe, bias=False)
    amaxes = []
    for step, size in enumerate((1.0, 4.0, 2.0)):
        state = lin.fp8_scaling
        scale_before = state.scale.clone()
        xs = [torch.randn(5, 16) * size * (1 + m) for m in range(2)]  # two microbatches
        go = torch.randn(5, 8) * 1e-3
        for x in xs:
            x.requires_grad_(True)
            lin(x)[0].backward(go)
        if step > 0:  # the GEMMs used the scales of the history before this step
            x, s_in, s_w, s_go = xs[1], scale_before[0], scale_before[1], scale_before[2]
            want, gx, _, _ = reference_scaled(x.detach(), lin.weight.detach(), go, s_in, s_w, s_go)
            torch.testing.assert_close(x.grad, gx, rtol=1e-6, atol=1e-9)
        amax = torch.stack([max(x.detach().abs().max() for x in xs), lin.weight.detach().abs().max(),
                            go.abs().max()]).float()
        amaxes.insert(0, amax)
        update_fp8_scaling([lin], None)
        history = torch.stack(amaxes[:2] + [torch.zeros(3)] * (2 - len(amaxes[:2])), dim=1)
        torch.testing.assert_close(state.amax_history, history)
        use = history[:, 0] if algo == "most_recent" else history.amax(dim=1)
        fp8_max = torch.tensor([448.0, 448.0, 57344.0])
        torch.testing.assert_close(state.scale, fp8_max / use / 2)
    lin.eval()
    with torch.no_grad():  # an evaluation forward records nothing
        lin(torch.randn(5, 16) * 100)
    assert lin.fp8_scaling.amax_pending.abs().max() == 0


def reference_scaled(x, w, go, s_in, s_w, s_go):
    out = qdq(x, E4M3, scale=s_in) @ qdq(w, E4M3, scale=s_w).t()
    gx = qdq(go, E5M2, scale=s_go) @ qdq(w, E4M3, scale=s_w)
    return out, gx, None, None


def test_delayed_state_is_in_the_state_dict_and_other_recipes_add_none():
    lin = RowParallelLinear(16, 8, fp8=Fp8Recipe(recipe="delayed", amax_history_len=3))
    keys = [k for k in lin.state_dict() if is_fp8_state_key(k)]
    assert sorted(keys) == ["fp8_scaling.amax_history", "fp8_scaling.scale"]
    assert not [k for k in RowParallelLinear(16, 8, fp8=Fp8Recipe(recipe="tensorwise")).state_dict()
                if "fp8" in k]
    other = RowParallelLinear(16, 8, fp8=Fp8Recipe(recipe="delayed", amax_history_len=3))
    state = lin.state_dict()
    state["fp8_scaling.amax_history"] = torch.rand(3, 3)
    other.load_state_dict(state)
    assert other.fp8_scaling.has_history and torch.equal(other.fp8_scaling.amax_history,
                                                          state["fp8_scaling.amax_history"])


@pytest.mark.parametrize("fields, message", [
    (dict(fp8="e5m2"), "fp8='e5m2' is not an FP8 format"),
    (dict(fp8="hybrid", fp8_recipe="mxfp8"), "fp8_recipe='mxfp8' is not supported"),
    (dict(fp8="hybrid", fp8_recipe="blockwise"), "fp8_recipe='blockwise' is not supported"),
    (dict(fp8="hybrid", fp8_amax_history_len=0), "fp8_amax_history_len must be a positive integer"),
    (dict(fp8="hybrid", fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo='mean'"),
])
def test_config_refuses_what_fp8_does_not_do(fields, message):
    with pytest.raises(Fp8ConfigError, match=message):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=8,
                          **fields)


def test_model_runs_fp8_in_the_layers_and_bf16_in_the_output_layer():
    from parallel3d.models import GPTModel

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=8,
                               fp8="hybrid", fp8_recipe="tensorwise")
    model = GPTModel(config)
    fp8 = {n for n, m in model.named_modules() if getattr(m, "fp8_scaling", None) is not None}
    assert fp8 == {f"decoder.layers.{i}.{n}" for i in range(2)
                   for n in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                             "mlp.linear_fc2")}


# ---------------------------------------------------------------- training flags

def _validate(argv):
    from parallel3d.training.arguments import parse_args, validate_args

    tiny = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16"]
    return validate_args(parse_args(tiny + list(argv)), 1)


def test_fp8_flags_reach_the_model_config_with_megatrons_defaults():
    from parallel3d.training import gpt

    args = _validate(["--bf16", "--fp8-format", "hybrid"])
    assert (args.fp8, args.fp8_recipe, args.fp8_margin, args.fp8_amax_history_len, args.fp8_amax_compute_algo,
            args.fp8_wgrad) == ("hybrid", "delayed", 0, 1, "most_recent", True)
    args = _validate(["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-margin", "1",
                      "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max", "--no-fp8-wgrad"])
    args.vocab_size = 100
    config = gpt.transformer_config_from_args(args)
    assert config.fp8_settings == Fp8Recipe(format="e4m3", recipe="delayed", margin=1, amax_history_len=16,
                                            amax_compute_algo="max", wgrad=False)
    assert "recipe delayed (amax history 16, max, margin 1" in config.fp8_settings.describe()
    assert _validate(["--bf16"]).fp8 is None


@pytest.mark.parametrize("argv, message", [
    (["--fp8-format", "hybrid"], "--fp8-format hybrid needs --bf16"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 is not supported"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], "--fp8-recipe blockwise is not supported"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-param-gather"], "--fp8-param-gather is not supported"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-dot-product-attention"],
     "--fp8-dot-product-attention is not supported"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-multi-head-attention"], "--fp8-multi-head-attention is not supported"),
    (["--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16"], "--first-last-layers-bf16 is not supported"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len must be >= 1"),
    (["--bf16", "--fp4-format", "e2m1"], "--fp4-format is not supported"),
])
def test_fp8_refusals_name_the_flag(argv, message):
    from parallel3d.training.arguments import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        _validate(argv)


def test_delayed_only_flags_warn_under_other_recipes(capsys):
    _validate(["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "8"])
    assert "--fp8-amax-history-len has no effect: they tune --fp8-recipe delayed, not tensorwise" in \
        capsys.readouterr().err
    _validate(["--bf16", "--no-fp8-wgrad"])
    assert "--no-fp8-wgrad has no effect without --fp8-format" in capsys.readouterr().err


def _run_steps(lin, batches, go, steps):
    """(outputs, input grads, weight grads) of ``steps`` optimizer steps (SGD, in place), each over the
    micro-batches ``batches``; delayed scaling's update after each step."""
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    got = []
    for _ in range(steps):
        opt.zero_grad()
        for x in batches:
            x = x.clone().requires_grad_(True)
            out, _ = lin(x)
            out.backward(go)
            got += [out.detach(), x.grad]
        got.append(lin.weight.grad.clone())
        opt.step()
        update_fp8_scaling([lin], None)
    return got


def _counting_quantize(monkeypatch, role):
    """The layouts in which ``role`` gets quantized, in call order (Fp8Scaling._quantize wrapped)."""
    from parallel3d.tensor_parallel.fp8 import Fp8Scaling

    layouts = []
    original = Fp8Scaling._quantize

    def counting(self, t, r, layout, *rest, **kw):
        layouts.extend([layout] if r == role else [])
        return original(self, t, r, layout, *rest, **kw)

    monkeypatch.setattr(Fp8Scaling, "_quantize", counting)
    return layouts


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
def test_weight_cache_is_bit_identical_and_refreshes_after_the_step(recipe, layer, monkeypatch):
    """Each weight is quantized once per step (both layouts from one read; rowwise once per GEMM, its axes
    differ), not per micro-batch and GEMM; outputs and gradients equal the uncached path's bit for bit,
    across optimizer steps."""
    from parallel3d.tensor_parallel.fp8 import WEIGHT

    torch.manual_seed(0)
    batches = [torch.randn(6, 24) * (1 + m) for m in range(3)]
    go = torch.randn(6, 40) * 1e-3
    runs = {}
    for cache in (True, False):
        torch.manual_seed(1)
        lin = layer(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=False)
        lin.fp8_scaling.cache_weights = cache
        with monkeypatch.context() as m:
            quantized = _counting_quantize(m, WEIGHT)
            runs[cache] = _run_steps(lin, batches, go, steps=3), quantized
    (cached, n_cached), (fresh, n_fresh) = runs[True], runs[False]
    assert len(cached) == len(fresh)
    for i, (a, b) in enumerate(zip(cached, fresh)):
        assert torch.equal(a, b), f"tensor {i} differs"
    assert n_fresh == ["row", "col"] * 3 * 3  # steps x micro-batches x (fprop, dgrad)
    assert n_cached == (["row", "col"] if recipe == "rowwise" else ["both"]) * 3  # once a step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantization_gives_torchaos_bits(dtype):
    """fp8_ops' amax, scale and cast (both layouts) give the bits of torchao's float8 (the well-kept
    library whose numbers these are): tensor_to_amax, amax_to_scale and to_fp8_saturated; saturation, inf,
    NaN, zeros and subnormals included."""
    torchao_utils = pytest.importorskip("torchao.float8.float8_utils")
    from parallel3d.fused.fp8_cast import amax_to_scale
    from parallel3d.tensor_parallel.fp8_ops import local_amax, quantize

    torch.manual_seed(0)
    t = torch.cat([torch.randn(64, 32) * 10.0 ** e for e in range(-6, 6, 2)]).to(dtype)
    t[0, :4] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
    for axis in (None, 0, 1):
        amax = local_amax(t, axis)
        want = t.abs().amax() if axis is None else t.abs().amax(dim=axis, keepdim=True)
        assert torch.equal(amax, want.float()) and amax.dtype == torch.float32
        for fp8 in (E4M3, E5M2):
            scale = amax_to_scale(amax, fp8)
            assert torch.equal(scale, torchao_utils.amax_to_scale(amax, fp8))
            want = torchao_utils.to_fp8_saturated(t.float() * scale, fp8)
            layout = "row" if axis != 0 else "col"
            row, col = quantize(t, fp8, "both" if axis is None else layout, scale=scale)
            got = row.data if row is not None else col.data.t()
            assert got.dtype == fp8 and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            if axis is None:
                assert torch.equal(col.data.t().view(torch.uint8), want.view(torch.uint8))
                assert col.data.is_contiguous()
    t[1, 1] = float("nan")
    assert local_amax(t).isnan()


def test_scaled_mm_equals_torchaos_emulated_gemm():
    """The emulated GEMM of two operands equals torchao's Float8TrainingTensor mm (emulate=True) on the same
    bytes and scales, tensorwise and rowwise."""
    tt = pytest.importorskip("torchao.float8.float8_training_tensor")
    from parallel3d.tensor_parallel.fp8_ops import local_amax, quantize, scaled_mm

    torch.manual_seed(0)
    x, w = torch.randn(12, 24), torch.randn(40, 24)
    config = tt.ScaledMMConfig(emulate=True)
    mm_config = tt.LinearMMConfig(config, config, config)
    for axis in (None, 1):
        x8, _ = quantize(x, E4M3, "row", amax=local_amax(x, axis))
        w8, _ = quantize(w, E4M3, "row", amax=local_amax(w, axis))
        got = scaled_mm(x8, w8, torch.float32, fast_accum=False, emulate=True)
        dim = None if axis is None else -1
        a = tt.Float8TrainingTensor(x8.data, x8.scale, torch.float32, mm_config, tt.GemmInputRole.INPUT, dim)
        b = tt.Float8TrainingTensor(w8.data, w8.scale, torch.float32, mm_config, tt.GemmInputRole.WEIGHT, dim)
        assert torch.equal(got, torch.mm(a, b.t())), axis


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_wgrad_takes_dgrads_fp8_grad_output(recipe, monkeypatch):
    """Tensorwise and delayed quantize grad_output once per backward, both layouts from one read (dgrad's
    and wgrad's operands); rowwise twice, its axes differ; without FP8 wgrad, dgrad's layout only."""
    from parallel3d.tensor_parallel.fp8 import GRAD_OUTPUT

    for wgrad in (True, False):
        with monkeypatch.context() as m:
            quantized = _counting_quantize(m, GRAD_OUTPUT)
            lin = RowParallelLinear(24, 40, fp8=Fp8Recipe(recipe=recipe, wgrad=wgrad), bias=False)
            lin(torch.randn(6, 24, requires_grad=True))[0].backward(torch.randn(6, 40))
        want = ["row", "col"] if recipe == "rowwise" else ["both"]
        assert quantized == (want if wgrad else want[:1] if recipe == "rowwise" else ["row"]), wgrad


def _amax_reduces(rank, world_size):
    """TP=2: per recipe, layer and weight cache, two steps' outputs and gradients and the FP8 collectives'
    labels: (cached equals uncached, the labels of each)."""
    from contextlib import contextmanager

    from parallel3d import parallel_state as ps
    from parallel3d.tensor_parallel import fp8 as fp8_module

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    labels = []
    original = fp8_module.tp_collective

    @contextmanager
    def counting(what, group):
        labels.append(what)
        with original(what, group):
            yield

    fp8_module.tp_collective = counting
    out = {}
    for recipe in ("tensorwise", "rowwise", "delayed"):
        for layer, in_size in ((ColumnParallelLinear, 24), (RowParallelLinear, 12)):
            runs, seen = [], []
            for cache in (True, False):
                torch.manual_seed(1)
                lin = layer(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=False)
                lin.fp8_scaling.cache_weights = cache
                torch.manual_seed(2 + rank)  # each rank its own input shard / gradient slice
                batches = [torch.randn(6, in_size) * (1 + m) for m in range(2)]
                go = torch.randn(6, lin.output_size_per_partition if layer is ColumnParallelLinear else 40)
                labels.clear()
                runs.append(_run_steps(lin, batches, go * 1e-3, steps=1))
                seen.append(list(labels))
            out[(recipe, layer.__name__)] = (all(torch.equal(a, b) for a, b in zip(*runs)), seen[0], seen[1])
    fp8_module.tp_collective = original
    return out


def test_tp_amax_all_reduces_one_per_gemm_at_most():
    """Where a GEMM's two operands both need their TP-wide amax (a row-parallel fprop; rowwise's
    column-parallel dgrad) one all-reduce carries both; the cached weight needs none after its first
    GEMM of the step. Cached and uncached give the same numbers."""
    from parallel3d.testing import run_distributed

    for result in run_distributed(_amax_reduces, 2, timeout=120):
        for (recipe, layer), (same, cached, fresh) in result.items():
            where = f"{recipe} {layer}"
            assert same, where
            merged = [x for x in cached + fresh if "," in x]
            assert merged if layer == "RowParallelLinear" or recipe == "rowwise" else not merged, (where, cached)
            # two micro-batches: at most fprop and dgrad each carry one collective
            assert len(cached) <= len(fresh) <= 4, (where, cached, fresh)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
def test_weight_cache_in_place_for_cuda_graphs(recipe, layer):
    """Under CUDA graphs a replay reads the cached operands' tensors it captured: ``refresh_weight`` (called by
    training/cuda_graphs.py before each replay, as here) quantizes a changed weight into those very tensors."""
    torch.manual_seed(0)
    batches = [torch.randn(6, 24) * (1 + m) for m in range(3)]
    go = torch.randn(6, 40) * 1e-3
    runs, addresses = {}, set()
    for in_place in (True, False):
        torch.manual_seed(1)
        lin = layer(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=False)
        scaling, forward = lin.fp8_scaling, lin.forward
        scaling.cache_weights = scaling.weight_cache_in_place = in_place

        def refreshed(x, scaling=scaling, forward=forward, lin=lin, in_place=in_place):
            if in_place:
                scaling.refresh_weight(lin.weight)
                addresses.add(tuple(t.data_ptr() for gemm in ("fprop", "dgrad") for t in scaling._weight_cache[gemm]))
            return forward(x)

        lin.forward = refreshed
        runs[in_place] = _run_steps(lin, batches, go, steps=3)
    for i, (a, b) in enumerate(zip(runs[True], runs[False], strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs"
    assert len(addresses) == 1, "a refresh put the weight's operands into new tensors, which no graph reads"


def test_graph_capture_keeps_the_steps_amaxes_and_needs_delayed_history():
    """The capture's warm-up runs forward and backward on made-up inputs: the step's pending amaxes stay as
    they were, and the next training forward records the weight's amax. Delayed scaling without a history is
    refused (the graphs would hold the first step's current-scaling path)."""
    from parallel3d.tensor_parallel.fp8 import WEIGHT, fp8_graph_capture, local_amax

    lin = ColumnParallelLinear(16, 8, fp8=Fp8Recipe(recipe="delayed"), bias=False)
    with pytest.raises(RuntimeError, match="no amax history yet"), fp8_graph_capture([lin]):
        pass
    lin(torch.randn(4, 16))[0].sum().backward()
    update_fp8_scaling([lin], None)
    before = lin.fp8_scaling.amax_pending.clone()
    with fp8_graph_capture([lin]):
        lin(100 * torch.randn(4, 16))[0].sum().backward()
    assert torch.equal(lin.fp8_scaling.amax_pending, before), "the capture's made-up inputs entered the step's amaxes"
    lin.fp8_scaling.refresh_weight(lin.weight)
    assert lin.fp8_scaling.amax_pending[WEIGHT] == local_amax(lin.weight.detach())


def test_weights_made_in_inference_mode_are_quantized_afresh():
    """An inference tensor has no version counter, so an in-place change could not be seen: not cached."""
    with torch.inference_mode():
        lin = ColumnParallelLinear(24, 40, fp8=Fp8Recipe(recipe="tensorwise"), bias=False)
        x = torch.randn(6, 24)
        before = lin(x)[0]
        lin.weight.mul_(2.0)
        after = lin(x)[0]
    assert not lin.fp8_scaling._weight_cache
    torch.testing.assert_close(after, 2 * before)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
def test_fprop_keeps_the_inputs_wgrad_operand(recipe, layer, monkeypatch):
    """With a tensor-scaled FP8 wgrad, fprop quantizes the input once in both layouts and backward keeps that
    transpose instead of the input: the input is not saved, wgrad quantizes nothing, and outputs and
    gradients equal the path that quantizes the input again in wgrad, bit for bit. Rowwise keeps the input."""
    from parallel3d.tensor_parallel.fp8 import INPUT, Fp8Scaling

    torch.manual_seed(0)
    batches = [torch.randn(6, 24) * (1 + m) for m in range(2)]
    go = torch.randn(6, 40) * 1e-3
    runs, holds_input = {}, {}
    for keep in (True, False):
        torch.manual_seed(1)
        lin = layer(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=False)
        with monkeypatch.context() as m:
            if not keep:
                m.setattr(Fp8Scaling, "keeps_input_operand", lambda self: False)
            layouts = _counting_quantize(m, INPUT)
            runs[keep] = _run_steps(lin, batches, go, steps=2), list(layouts)
            x, packed = torch.randn(6, 24, requires_grad=True), []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
                lin(x)
            holds_input[keep] = any(t.data_ptr() == x.data_ptr() for t in packed)
    (kept, kept_layouts), (again, again_layouts) = runs[True], runs[False]
    for i, (a, b) in enumerate(zip(kept, again)):
        assert torch.equal(a, b), f"tensor {i} differs"
    per_microbatch = 2 * 2  # steps x micro-batches
    if recipe == "rowwise":
        assert kept_layouts == again_layouts == ["row", "col"] * per_microbatch
        assert holds_input[True]
    else:
        assert kept_layouts == ["both"] * per_microbatch and again_layouts == ["row", "col"] * per_microbatch
        assert not holds_input[True] and holds_input[False]  # the bf16 input is not held for backward
