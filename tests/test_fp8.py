"""The FP8 linear (parallel3d/tensor_parallel/fp8.py) against an explicit quantize-dequantize reference,
delayed scaling's history and scales, and the refusals.

The reference is written here from the definition, without torchao: q(t) = fp8(clamp(t * s)) with
s = fp8_max / amax (per tensor, or per row along the GEMM's contracted dimension for rowwise), and
a GEMM of dequantized operands q / s in fp32. The layer's emulated GEMMs do the same arithmetic, so
they agree to fp32 rounding of the matmul (1e-6 relative here).
"""
import pytest
import torch

pytest.importorskip("torchao")

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


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
def test_weight_cache_is_bit_identical_and_refreshes_after_the_step(recipe, layer, monkeypatch):
    """Each weight is quantized once per step (per GEMM role under rowwise), not per micro-batch and GEMM;
    outputs and gradients equal the uncached path's bit for bit, across optimizer steps."""
    from parallel3d.tensor_parallel.fp8 import WEIGHT, Fp8Scaling

    torch.manual_seed(0)
    batches = [torch.randn(6, 24) * (1 + m) for m in range(3)]
    go = torch.randn(6, 40) * 1e-3
    runs = {}
    for cache in (True, False):
        torch.manual_seed(1)
        lin = layer(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=False)
        lin.fp8_scaling.cache_weights = cache
        quantized = []
        original = Fp8Scaling._operand

        def counting(self, t, role, gemm, *rest):
            if role == WEIGHT:
                quantized.append(gemm)
            return original(self, t, role, gemm, *rest)

        monkeypatch.setattr(Fp8Scaling, "_operand", counting)
        runs[cache] = _run_steps(lin, batches, go, steps=3), quantized
        monkeypatch.setattr(Fp8Scaling, "_operand", original)
    (cached, n_cached), (fresh, n_fresh) = runs[True], runs[False]
    assert len(cached) == len(fresh)
    for i, (a, b) in enumerate(zip(cached, fresh)):
        assert torch.equal(a, b), f"tensor {i} differs"
    assert len(n_fresh) == 3 * 3 * 2  # steps x micro-batches x (fprop, dgrad)
    assert n_cached == (["fprop", "dgrad"] if recipe == "rowwise" else ["fprop"]) * 3  # once a step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lean_quantize_gives_torchaos_bits(dtype):
    """amax by the infinity norm and the cast without an fp32 copy give the bits of torchao's
    abs().amax() and to_fp8_saturated(t.float() * scale): saturation, inf, NaN, subnormals included."""
    from parallel3d.tensor_parallel.fp8 import Fp8Scaling

    torch.manual_seed(0)
    t = torch.cat([torch.randn(64, 32) * 10.0 ** e for e in range(-6, 6, 2)]).to(dtype)
    t[0, :4] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
    lean, plain = (Fp8Scaling(Fp8Recipe(recipe="rowwise"), 0, None, lean_quantize=on) for on in (True, False))
    for axis in (None, 0, 1):
        amax = lean._local_amax(t, axis)
        assert torch.equal(amax, plain._local_amax(t, axis)) and amax.dtype == torch.float32
        for fp8 in (E4M3, E5M2):
            for scale in (torch.tensor(3.0e2), torch.tensor(7.3), (torch.finfo(fp8).max / amax.clamp(min=1e-12))):
                a, b = lean._cast(t, scale, fp8), plain._cast(t, scale, fp8)
                assert a.dtype == fp8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    t[1, 1] = float("nan")
    assert lean._local_amax(t, None).isnan() and plain._local_amax(t, None).isnan()


@pytest.mark.parametrize("switch", ["lean_quantize", "reuse_grad_output"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_speedup_switch_trains_a_bf16_linear_bit_for_bit(recipe, switch):
    """A speed-up (Fp8Scaling's switch) on or off: the same outputs and gradients, bit for bit."""
    torch.manual_seed(0)
    batches = [torch.randn(6, 24, dtype=torch.bfloat16) * (1 + m) for m in range(2)]
    go = (torch.randn(6, 40) * 1e-3).to(torch.bfloat16)
    runs = []
    for on in (True, False):
        torch.manual_seed(1)
        lin = ColumnParallelLinear(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=True, params_dtype=torch.bfloat16)
        setattr(lin.fp8_scaling, switch, on)
        runs.append(_run_steps(lin, batches, go, steps=2))
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"tensor {i} differs"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_wgrad_takes_dgrads_fp8_grad_output(recipe, monkeypatch):
    """Tensorwise and delayed quantize grad_output once per backward (dgrad's copy serves wgrad); rowwise
    twice, its axes differ."""
    from parallel3d.tensor_parallel.fp8 import GRAD_OUTPUT, Fp8Scaling

    quantized = []
    original = Fp8Scaling._operand

    def counting(self, t, role, gemm, *rest):
        quantized.extend([gemm] if role == GRAD_OUTPUT else [])
        return original(self, t, role, gemm, *rest)

    monkeypatch.setattr(Fp8Scaling, "_operand", counting)
    lin = RowParallelLinear(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=False)
    lin(torch.randn(6, 24, requires_grad=True))[0].backward(torch.randn(6, 40))
    assert quantized == (["dgrad", "wgrad"] if recipe == "rowwise" else ["dgrad"])


def _merged_amax_reduce(rank, world_size):
    """TP=2: per recipe, layer and weight cache, training with the amax all-reduces of a GEMM merged
    against one per operand: (whether every tensor is equal, FP8 collectives merged, unmerged)."""
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
            for cache in (True, False):
                runs, counts = [], []
                for merge in (True, False):
                    torch.manual_seed(1)
                    lin = layer(24, 40, fp8=Fp8Recipe(recipe=recipe), bias=False)
                    lin.fp8_scaling.cache_weights, lin.fp8_scaling.merge_amax_reduce = cache, merge
                    torch.manual_seed(2 + rank)  # each rank its own input shard / gradient slice
                    batches = [torch.randn(6, in_size) * (1 + m) for m in range(2)]
                    go = torch.randn(6, lin.output_size_per_partition if layer is ColumnParallelLinear else 40)
                    labels.clear()
                    runs.append(_run_steps(lin, batches, go * 1e-3, steps=2))
                    counts.append(len(labels))
                same = all(torch.equal(a, b) for a, b in zip(*runs))
                out[(recipe, layer.__name__, cache)] = (same, counts[0], counts[1])
    fp8_module.tp_collective = original
    return out


def test_merged_amax_all_reduce_gives_the_same_numbers_with_fewer_collectives():
    """Where a GEMM's two operands both need their TP-wide amax (a row-parallel fprop; rowwise's
    column-parallel dgrad) one all-reduce carries both: the same maxima, fewer collectives."""
    from parallel3d.testing import run_distributed

    for result in run_distributed(_merged_amax_reduce, 2, timeout=120):
        for (recipe, layer, cache), (same, merged, unmerged) in result.items():
            where = f"{recipe} {layer} cache={cache}"
            assert same, where
            fewer = layer == "RowParallelLinear" or recipe == "rowwise"
            assert (merged < unmerged) if fewer else (merged == unmerged), (where, merged, unmerged)


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
