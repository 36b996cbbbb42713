"""tools/plan.py: search, evaluate, --json, and one clear line for a bad layout."""
import json
import os
import subprocess
import sys

from parallel3d.tools import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
       "--vocab-size", "50257"]


def test_search_json_lists_fitting_layouts_fastest_first(capsys):
    assert plan.main(GPT + ["--global-batch-size", "64", "--cluster", "h100-sxm", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = out["layouts"]
    assert out["num_gpus"] == 8 and 1 <= len(layouts) <= 3
    for d in layouts:
        assert d["fits"] and d["num_gpus"] == 8
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                    "step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "peak_memory_gb"):
            assert key in d
    assert [d["step_time_s"] for d in layouts] == sorted(d["step_time_s"] for d in layouts)


def test_evaluate_mode_prints_breakdowns_and_the_timeline(capsys):
    argv = GPT + ["--global-batch-size", "32", "--micro-batch-size", "4", "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "6", "--num-gpus", "2", "--cluster", "h200"]
    assert plan.main(argv) == 0
    text = capsys.readouterr().out
    assert "TP=1 PP=2 V=2 DP=1 mbs=4" in text and "interleaved-1f1b" in text
    assert "step breakdown" in text and "bubble" in text and "memory stage 1" in text
    assert "rank 1" in text and "F0.1" in text  # the text timeline of the simulated schedule


def test_evaluate_a_zero_bubble_schedule_draws_its_weight_gradients(capsys):
    argv = GPT + ["--global-batch-size", "32", "--micro-batch-size", "4", "--pipeline-model-parallel-size", "4",
                  "--pipeline-schedule", "zb-h2", "--num-gpus", "4", "--cluster", "h100-sxm"]
    assert plan.main(argv) == 0
    text = capsys.readouterr().out
    assert "TP=1 PP=4 zb-h2" in text and "schedule zb-h2" in text
    assert "W0.0" in text and "B0.0" in text  # W steps of the split backward, on the text grid


def test_evaluate_json_has_one_layout(capsys):
    argv = GPT + ["--global-batch-size", "32", "--micro-batch-size", "4", "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", "--num-gpus", "4", "--json"]
    assert plan.main(argv) == 0
    (d,) = json.loads(capsys.readouterr().out)["layouts"]
    assert (d["tensor_model_parallel_size"], d["data_parallel_size"], d["num_microbatches"]) == (2, 2, 4)


def test_evaluate_prices_training_default_of_cuda_graphs_for_tensor_parallelism(capsys):
    """A TP layout is evaluated as training runs it: its layers replayed as CUDA graphs where a graph holds the run
    (arguments.py; Megatron's default dropout, 0.1 as pretrain_gpt.py's, included), eager with --cuda-graph-impl
    none."""
    argv = GPT + ["--global-batch-size", "32", "--micro-batch-size", "4", "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", "--num-gpus", "4", "--cluster", "h100-sxm", "--json"]
    found = {}
    for name, extra in (("default", ["--hidden-dropout", "0"]), ("none", ["--hidden-dropout", "0", "--cuda-graph-impl",
                        "none"]), ("dropout", []), ("local", ["--hidden-dropout", "0", "--cuda-graph-impl", "local"])):
        assert plan.main(argv + extra) == 0
        (found[name],) = json.loads(capsys.readouterr().out)["layouts"]
    assert found["default"]["enable_cuda_graph"] and found["local"]["enable_cuda_graph"]
    assert found["dropout"]["enable_cuda_graph"] and not found["none"]["enable_cuda_graph"]
    assert found["default"]["step_time_s"] == found["local"]["step_time_s"] < found["none"]["step_time_s"]


def test_bad_layout_is_one_clear_line():
    argv = GPT + ["--global-batch-size", "32", "--tensor-model-parallel-size", "3", "--num-gpus", "6"]
    r = subprocess.run([sys.executable, "tools/plan.py"] + argv, cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tensor-model-parallel-size 3 must divide --num-attention-heads" in lines[0]


def test_unknown_cluster_is_one_clear_line(capsys):
    assert plan.main(GPT + ["--global-batch-size", "32", "--cluster", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown cluster 'tpu'" in err[0]


# A Megatron-LM pretrain command line as pasted from a launch script (issue 30 item 8).
PRETRAIN = GPT + ["--max-position-embeddings", "2048", "--attention-backend", "auto", "--train-iters", "500",
                  "--fp16", "--lr", "6e-5", "--lr-warmup-fraction", ".001", "--save", "ckpt", "--load", "ckpt",
                  "--data-path", "my_text_document", "--split", "949,50,1", "--global-batch-size", "32",
                  "--micro-batch-size", "4", "--pipeline-model-parallel-size", "2",
                  "--virtual-pipeline-model-parallel-size", "2", "--num-gpus", "2", "--json"]


def test_a_pasted_pretrain_command_line_is_planned(capsys):
    assert plan.main(PRETRAIN) == 0
    (d,) = json.loads(capsys.readouterr().out)["layouts"]
    assert (d["pipeline_model_parallel_size"], d["virtual_pipeline_model_parallel_size"]) == (2, 2)
    plain = [a for a in PRETRAIN if a not in ("--fp16",)]
    for cut in ("--train-iters", "--lr", "--lr-warmup-fraction", "--save", "--load", "--data-path", "--split"):
        i = plain.index(cut)
        plain = plain[:i] + plain[i + 2:]
    assert plan.main(plain) == 0  # the training-only flags change nothing
    assert json.loads(capsys.readouterr().out)["layouts"] == [d]


def test_a_typo_among_pretrain_flags_is_still_refused():
    r = subprocess.run([sys.executable, "tools/plan.py"] + PRETRAIN + ["--trian-iters", "5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and "unrecognized arguments: --trian-iters 5" in r.stderr



def test_fp8_is_noted_as_not_modelled(capsys):
    assert plan.main(PRETRAIN + ["--bf16", "--fp8-format", "hybrid"]) == 0
    assert "--fp8-format hybrid not modelled: the plan prices bf16 GEMMs" in capsys.readouterr().err


def test_a_recompute_method_the_planner_does_not_price_is_noted(capsys):
    full = ["--recompute-granularity", "full", "--recompute-method"]
    assert plan.main(PRETRAIN + full + ["uniform", "--recompute-num-layers", "1"]) == 0
    assert "recompute" not in capsys.readouterr().err  # every layer recomputed: what the plan prices
    assert plan.main(PRETRAIN + full + ["block", "--recompute-num-layers", "2"]) == 0
    assert "--recompute-method / --recompute-num-layers (full recompute is priced per layer)" in capsys.readouterr().err
