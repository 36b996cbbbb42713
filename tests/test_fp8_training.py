"""FP8 training (torch._scaled_mm's numerics, emulated on the CPU) in 3D layouts equals one process with the same
FP8 settings; delayed scaling's state resumes exactly; conversion exports the weights only.

The sweep trains the harness's GPT (tests/gpt_harness.py) with fp32 parameters and FP8 GEMMs (the
``--bf16`` rule is the application's: the library quantizes whatever dtype it gets, and fp32 keeps
the comparison at fp32 resolution), one launch of 8 gloo processes: TP=2 with sequence parallelism,
PP=2 (1F1B, the zero-bubble ZB-H1 with its deferred weight-gradient GEMMs, interleaved), DP=2 with
ZeRO-1 or overlapped reduction, full recompute, tied embeddings (gpt2), and each recipe.

Tolerance. Across layouts fp32 sums run in another order (row-parallel partial sums over TP, the DP
gradient sum), so values differ in their last bits (relative ~1e-7). FP8 rounds onto a grid of
relative spacing u = 2^-3 (e4m3) or 2^-2 (e5m2): an input within 1e-7 of a rounding boundary rounds
to the neighbouring FP8 value, a chance of ~1e-7 / u per element, ~1 element per step of this model's
~1e6 quantized elements. Such a flip moves one element by u of itself, one of the T = 256 tokens'
contributions to a weight gradient: up to u / T ~ 1e-3 of the gradient. So:

- iteration 1 (identical weights everywhere; only the in-step sums differ, and they flip elements too: with
  torch 2.13's CPU kernels one gpt2 layout's first gradient norm moved by 1.1e-4 and an amax by 5e-3):
  loss within 1e-4, gradient norm within 2e-3, relative (one flip moves the norm by up to ~1e-3, as
  below). A scale that is not the full tensor's (a TP shard's own amax) moves the first gradient norm
  by ~7e-3;
- later iterations (weights differ in their last bits): loss within 1e-4, gradient norm within
  1e-2, relative: one process whose weights are perturbed by 1e-7 relative moves by as much
  (measured: 1e-3 on the gradient norm, 2e-5 on the loss);
- weights after 3 steps within 1e-4 absolute. The sweep uses SGD: Adam's first updates are
  lr * g / (|g| + eps), the sign of g where |g| >> eps, so a flip that changes a small gradient's sign moves
  that weight by 2 lr; SGD moves it by lr times the gradient difference (lr 1e-2 x ~1e-3);
- delayed scaling's amax history: see ``_check_history``.
"""
import io

import pytest
import torch


from gpt_harness import full_weights, layout_args, shards_against, train  # noqa: E402
from parallel3d import parallel_state as ps  # noqa: E402
from parallel3d.tensor_parallel.fp8 import is_fp8_state_key  # noqa: E402
from parallel3d.testing import run_distributed  # noqa: E402

FP8 = {
    "delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max"),
    "tensorwise": dict(fp8="hybrid", fp8_recipe="tensorwise"),
    "rowwise": dict(fp8="e4m3", fp8_recipe="rowwise"),
}
SGD = ["--optimizer", "sgd"]
# (family, FP8 recipe, TP, PP, V, SP, extra flags); world size 8, DP = 8 / (TP * PP) = 2
LAYOUTS = [
    ("gpt2", "delayed", 2, 2, 1, True, SGD + ["--use-distributed-optimizer", "--recompute-granularity", "full",
                                              "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ("gpt2", "tensorwise", 2, 2, 1, True, SGD + ["--pipeline-schedule", "zb-h1", "--overlap-grad-reduce"]),
    ("llama", "rowwise", 2, 2, 2, True, SGD + ["--use-distributed-optimizer"]),
]


def fp8_args(family, recipe, *layout, extra=(), world=1, **kw):
    """The harness's arguments with the FP8 fields set after validation (fp32 parameters: see above)."""
    args = layout_args(family, *layout, extra=list(extra), world=world, **kw)
    for k, v in FP8[recipe].items():
        setattr(args, k, v)
    return args


def fp8_state(result):
    """{global name: tensor} of every FP8 state buffer of this rank's chunks."""
    return {chunk.module.global_parameter_name(name): t.detach().clone()
            for chunk in result["model"] for name, t in chunk.module.state_dict().items() if is_fp8_state_key(name)}


def _reference(family, recipe):
    result = train(fp8_args(family, recipe, extra=SGD))
    return result["losses"], result["grad_norms"], full_weights(result), fp8_state(result)


def _rel(got, want):
    return abs(got - want) / max(abs(want), 1e-12)


def _check_history(got, want, dp, where):
    """Delayed scaling's amax history [input, weight, grad_output] x [newest .. oldest] against one process's.

    Each rank's loss is divided by its own microbatch count, so a DP=k rank's gradients, and their
    amaxes, are k times one process's (the DP average divides them back): the quantized values are the
    same, as the scales follow the amaxes. Every iteration, the first too, sees the FP8 rounding flips
    above: a flipped element moves the next layers' activations and gradients by up to u of that token's:
    5e-2 (5e-3 measured at iteration 1). A TP shard's or DP rank's own amax, unreduced, differs by up to
    the whole spread of the tensor."""
    want = want.clone()
    want[2] *= dp
    rel = (got - want).abs() / want.abs().clamp(min=1e-30)
    assert rel.max() <= 5e-2, f"{where}: {got} vs {want}"


def _sweep(rank, world_size, refs_bytes):
    refs = torch.load(io.BytesIO(refs_bytes), weights_only=True)
    done = []
    for family, recipe, tp, pp, vp, sp, extra in LAYOUTS:
        args = fp8_args(family, recipe, tp, pp, vp, sp, extra=extra, world=world_size)
        ps.initialize_model_parallel(tp, pp, args.virtual_pipeline_model_parallel_size)
        where = f"[{family} {recipe} TP={tp} PP={pp} V={vp} SP={sp} {' '.join(extra)}]"
        try:
            result = train(args)
            ref_losses, ref_norms, ref_weights, ref_state = refs[f"{family}/{recipe}"]
            for it, (got, want, norm, ref_norm) in enumerate(zip(result["losses"], ref_losses, result["grad_norms"],
                                                                 ref_norms)):
                loss_tol, norm_tol = (1e-4, 2e-3) if it == 0 else (1e-4, 1e-2)
                assert _rel(got["lm loss"], want["lm loss"]) <= loss_tol, f"{where} iteration {it + 1}: {got} vs {want}"
                assert _rel(norm, ref_norm) <= norm_tol, f"{where} iteration {it + 1} grad norm: {norm} vs {ref_norm}"
            for name, got, want in shards_against(result, ref_weights):
                err = (got - want).abs().max().item()
                assert err <= 1e-4, f"{where} weight {name} differs from the single process by {err:.3g}"
            state = fp8_state(result)
            assert (len(state) > 0) == (recipe == "delayed")
            dp = world_size // (tp * pp)
            for name, got in state.items():
                if name.endswith("amax_history"):
                    _check_history(got, ref_state[name], dp, f"{where} {name}")
        finally:
            ps.destroy_model_parallel()
        done.append(where)
    return done


def test_fp8_layouts_train_like_a_single_process():
    refs = {f"{f}/{r}": _reference(f, r) for f, r, *_ in LAYOUTS}
    buffer = io.BytesIO()  # bytes, not tensors: each tensor would travel as a file descriptor
    torch.save(refs, buffer)
    results = run_distributed(_sweep, 8, args=(buffer.getvalue(),), timeout=600)
    assert all(len(r) == len(LAYOUTS) for r in results)


# ---------------------------------------------------------------- checkpoints


SMALL = ["--global-batch-size", "4"]  # 2 microbatches: these tests check state, not layouts


def _delayed(iters, **kw):
    return fp8_args("gpt2", "delayed", iters=iters, extra=SMALL, **kw)


def _resume(rank, world_size, save):
    """Straight, first half + save, resumed: at TP=2 + SP, DP=2 with ZeRO-1 (world 4)."""
    from safetensors.torch import load_file

    out = {}
    for name in ("straight", "first", "resumed"):
        args = _delayed(4, tp=2, sp=True, world=world_size)
        args.use_distributed_optimizer = True
        if name == "first":  # a job of 4 iterations stopped after 2 (the straight run's LR schedule)
            args.save, args.save_interval, args.exit_interval = save, 2, 2
        if name == "resumed":
            args.load = save
        ps.initialize_model_parallel(2, 1)
        try:
            result = train(args)
            out[name] = ([d["lm loss"] for d in result["losses"]], result["grad_norms"], fp8_state(result),
                         full_weights_of_shards(result))
            if name == "first":
                tp_rank = ps.get_tensor_model_parallel_rank()
                saved = load_file(f"{save}/iter_0000002/mp_rank_{tp_rank:02d}_000/model.safetensors")
                out["saved"] = {k[len("model0."):]: v for k, v in saved.items() if is_fp8_state_key(k)}
        finally:
            ps.destroy_model_parallel()
    return out


def full_weights_of_shards(result):
    return {n: p.detach().clone() for n, p in result["model"][0].module.named_parameters()}


def test_delayed_scaling_resumes_exactly(tmp_path):
    """4 iterations straight equal 2, save, load, 2 more, at TP=2 + SP and DP=2 with ZeRO-1: losses,
    gradient norms, weights and the FP8 amax history and scales, bit for bit, on every rank. The
    history (4 steps, 'max') is what the resumed steps scale by, and each TP rank's file holds it."""
    for r in run_distributed(_resume, 4, args=(str(tmp_path / "ckpt"),), timeout=300):
        (straight, first, resumed), saved = (r["straight"], r["first"], r["resumed"]), r["saved"]
        assert set(saved) == set(first[2]) and all(torch.equal(saved[k], v) for k, v in first[2].items())
        assert any(saved[k][:, 1].abs().max() > 0 for k in saved if k.endswith("amax_history"))  # 2 steps of it
        assert first[0] == straight[0][:2] and resumed[0] == straight[0][2:]
        assert resumed[1] == straight[1][2:]
        for name, got in resumed[2].items():
            assert torch.equal(got, straight[2][name]), name
        for name, got in resumed[3].items():
            assert torch.equal(got, straight[3][name]), name


def test_conversion_exports_weights_only_and_fp8_state_is_optional_on_load(tmp_path):
    """An FP8 (delayed) checkpoint converts to Hugging Face and to a parallel3d checkpoint with its weights only;
    a run without FP8 loads it and a run with FP8 loads the converted one, each with a warning."""
    import warnings

    from parallel3d.tools.convert_checkpoint import convert
    from parallel3d.training.checkpoint_integrity import CheckpointWarning
    from safetensors.torch import load_file

    args = _delayed(2)
    args.save, args.save_interval = str(tmp_path / "fp8"), 2
    trained = train(args)
    convert("parallel3d", "hf", str(tmp_path / "fp8"), str(tmp_path / "hf"))
    hf = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert hf and not [k for k in hf if "fp8" in k or "amax" in k or k.endswith(".scale")]
    weights = full_weights(trained)
    assert torch.equal(hf["transformer.h.0.mlp.c_fc.weight"].t(), weights["decoder.layers.0.mlp.linear_fc1.weight"])
    convert("parallel3d", "parallel3d", str(tmp_path / "fp8"), str(tmp_path / "copy"))
    converted = load_file(str(tmp_path / "copy" / "iter_0000002" / "mp_rank_00_000" / "model.safetensors"))
    assert converted and not [k for k in converted if is_fp8_state_key(k)]

    for load, fp8, says in ((str(tmp_path / "fp8"), False, "does not use"),
                            (str(tmp_path / "copy"), True, "starts afresh")):
        args = layout_args("gpt2", iters=2, extra=SMALL) if not fp8 else _delayed(2)
        args.load, args.no_load_optim, args.no_load_rng, args.finetune = load, True, True, True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = train(args)
        assert any(issubclass(w.category, CheckpointWarning) and says in str(w.message) for w in caught), \
            [str(w.message) for w in caught]
        assert len(resumed["losses"]) == 2


def test_the_training_log_names_the_fp8_recipe(monkeypatch):
    from parallel3d.training import training

    lines = []
    monkeypatch.setattr(training, "print_rank_0", lambda *a, **k: lines.append(" ".join(map(str, a))))
    train(fp8_args("llama", "rowwise", iters=2, extra=SMALL))
    fp8_lines = [line for line in lines if line.startswith("FP8 ")]
    assert len(fp8_lines) == 1, lines
    assert fp8_lines[0].startswith("FP8 e4m3 (e4m3), recipe rowwise, wgrad in FP8; output layer and embeddings "
                                   "in high precision. Eager, small micro-batches wait on the host's launches"), fp8_lines


@pytest.mark.parametrize("extra", [["--bf16"], ["--use-distributed-optimizer"]])
def test_weight_cache_sees_the_optimizers_updates(extra, monkeypatch):
    """The optimizers write the updated weights where autograd's version counter does not see it (bf16
    parameters through ``.data``, ZeRO through the parameter buffer) and then bump the versions: training
    with the FP8 weight cache equals training without it, bit for bit."""
    from functools import partialmethod

    from parallel3d.tensor_parallel.fp8 import Fp8Scaling

    runs = []
    for cache in (True, False):
        with monkeypatch.context() as m:
            m.setattr(Fp8Scaling, "__init__", partialmethod(Fp8Scaling.__init__, cache_weights=cache))
            result = train(fp8_args("gpt2", "tensorwise", extra=SGD + SMALL + extra))  # 2 micro-batches, 3 steps
        assert all(s.cache_weights == cache for s in result["model"][0].modules() if isinstance(s, Fp8Scaling))
        runs.append((result["losses"], full_weights(result)))
    (losses, weights), (want_losses, want_weights) = runs
    assert losses == want_losses
    for name, w in want_weights.items():
        assert torch.equal(weights[name], w), name
