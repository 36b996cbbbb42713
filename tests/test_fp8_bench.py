"""The CPU-testable parts of the FP8 benchmarks (bench/single_gpu_bench.py --fp8, bench/fp8_convergence.py):
the bf16 peer trains the preset's shape, the convergence data is the corpus in byte tokens, and the
verdict compares the last interval both runs logged."""
import importlib.util
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import fp8_convergence  # noqa: E402
import gpt_bench  # noqa: E402
import single_gpu_bench  # noqa: E402
from launch import PLAIN  # noqa: E402


def _plain_parse_args():
    if PLAIN is None:
        pytest.skip("plain_gpt_bench.py is in neither ../shared/anchors nor .whl/anchors of this checkout")
    spec = importlib.util.spec_from_file_location("plain_gpt_bench", PLAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


@pytest.mark.parametrize("preset", ["gpt-1.3b", "llama-1b", "llama-3b"])
def test_plain_peer_builds_the_preset_shape(preset):
    """plain_gpt_bench.py gets gpt_bench's preset as its own flags (it has no llama-3b preset)."""
    from parallel3d.training import gpt

    plain = _plain_parse_args()(single_gpu_bench.plain_flags(preset))
    _, args = gpt_bench.bench_args(["--preset", preset], world=1)
    ours = gpt.transformer_config_from_args(args)
    shape = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")
    assert [getattr(plain, k) for k in shape] == [getattr(ours, k) for k in shape]
    assert (plain.seq_length, plain.vocab_size, plain.micro_batch_size) == (
        args.seq_length, args.vocab_size, args.micro_batch_size)
    assert (plain.swiglu, plain.rmsnorm, plain.rope, plain.no_bias, plain.untie_embeddings) == (
        ours.swiglu, ours.normalization == "RMSNorm", ours.position_embedding_type == "rope",
        not ours.add_bias_linear, ours.untie_embeddings_and_output_weights)


def test_convergence_corpus_is_byte_tokens_of_its_documents(tmp_path):
    from parallel3d.data import IndexedDataset
    from pydoc_data.topics import topics

    prefix, info = fp8_convergence.build_corpus("pydoc", str(tmp_path), 0.05)
    data = IndexedDataset(prefix)
    first = next(p.strip() for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip())
    assert len(data) == info["documents"] and sum(len(data[i]) for i in range(len(data))) == info["tokens"]
    assert np.array_equal(np.asarray(data[0]), np.array(list(first.encode("utf-8")) + [256]))
    assert 0.05 * 2 ** 20 <= info["tokens"] < 0.05 * 2 ** 20 + max(len(data[i]) for i in range(len(data)))


def test_convergence_refuses_a_run_that_would_repeat_its_data():
    """The first 2,000-step run read a 10.7 M-token corpus 2.3 times (memorisation, not convergence): refused
    before training, naming the fix; the Python-source corpus on the GPU machine (about 54 M tokens) is enough."""
    import argparse

    a = argparse.Namespace(train_iters=2000, global_batch_size=24, cpu_smoke=False)
    with pytest.raises(SystemExit, match="would repeat it. Use --corpus python"):
        fp8_convergence.check_no_repeat(a, {"corpus": "stdlib", "tokens": 10_670_833})
    fp8_convergence.check_no_repeat(a, {"corpus": "python", "tokens": 54_000_000})
    args = fp8_convergence.train_args(argparse.Namespace(**vars(a), micro_batch_size=24, lr=6e-4, seed=1,
                                                         log_interval=50, eval_interval=500), "p", "log.json")
    assert args[args.index("--split") + 1] == "95,5,0"


def test_convergence_verdict_compares_the_last_interval_both_runs_logged():
    result = {"runs": {"bf16": {"train_loss": {"50": 3.0, "100": 2.0}},
                       "fp8 tensorwise": {"train_loss": {"50": 3.01, "100": 2.03}},
                       "fp8 delayed": {"train_loss": {"50": 3.015}},  # cut short by its timeout
                       "fp8 rowwise": {"train_loss": {}}}}  # failed before its first log
    final = fp8_convergence.compare(result)
    assert set(final) == {"fp8 tensorwise", "fp8 delayed"}
    assert final["fp8 tensorwise"]["iteration"] == 100
    assert final["fp8 tensorwise"]["relative_difference"] == pytest.approx(0.015)
    assert not final["fp8 tensorwise"]["within_goal"]
    assert final["fp8 delayed"]["iteration"] == 50 and final["fp8 delayed"]["within_goal"]


def test_fp8_without_runs_the_first_recipe_without_each_speedup():
    """--fp8-without NAME: after the first recipe's run, that recipe with --fp8-disable NAME, compared
    with the run with all speed-ups; each name is one gpt_bench knows."""
    import argparse

    a = argparse.Namespace(iters=2, warmup=1, cpu_smoke=False, recipes=["tensorwise", "rowwise"], titan_bf16=False,
                           fp8_without=sorted(gpt_bench.FP8_SPEEDUPS))
    runs = {label: (peer, args) for label, peer, _, args, _ in single_gpu_bench.fp8_runs("llama-3b", a)}
    for name in gpt_bench.FP8_SPEEDUPS:
        peer, args = runs[f"parallel3d FP8 tensorwise without {name}"]
        assert peer == "parallel3d FP8 tensorwise" and args[-2:] == ["--fp8-disable", name]
        bench, _ = gpt_bench.bench_args(args, world=1)
        assert bench.fp8_disable == [name]
    assert not any("rowwise without" in label for label in runs)
