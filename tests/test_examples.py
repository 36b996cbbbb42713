"""The examples a newcomer runs first keep working."""
import os
import subprocess
import sys

import pytest

from parallel3d.training import gpt
from parallel3d.training.arguments import ArgumentError, parse_args, validate_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(nproc: int, script: str, *args: str, timeout: int = 240) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_custom_model_tp_example_matches_dense():
    out = _torchrun(4, "examples/custom_model_tp.py")
    assert "TP=4: matches the dense model" in out, out
    assert "TP=2 x PP=2: matches the dense model" in out, out  # the model contract is all a chunk implements


def test_demo_command_trains_saves_and_samples(tmp_path):
    """README's first command, shortened: TP2 x PP2 (interleaved) x DP2 on 8 CPU processes."""
    # PARALLEL3D_NO_VENV: this interpreter already has everything (test_packaging covers the .venv set-up)
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLEL3D_CACHE=str(tmp_path / "cache"), PARALLEL3D_NO_VENV="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--train-iters", "4",
                           "--lr-warmup-iters", "1", "--log-interval", "2", "--eval-interval", "2",
                           "--sample-tokens", "8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    # a failing rank's own lines come before torchrun's summary of all eight: show both
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-8000:]
    assert "world 8 = TP 2 x PP 2 (virtual 2) x DP 2" in out
    assert "built the default dataset" in out and "iteration      4/4" in out, out[-3000:]
    assert "saved checkpoint of iteration 4" in out
    assert "sample (greedy" in out
    assert (tmp_path / "demo_checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "4"


def _demo():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import demo

    return demo


@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 4, 8])
def test_demo_arguments_fit_each_machine(gpus, tmp_path):
    """The demo's flags pass validate_args for its process count: CPU model on a CPU, GPT-2 small on GPUs."""
    demo = _demo()
    nproc, argv = demo.demo_args(gpus, [], str(tmp_path))
    args = validate_args(parse_args(argv, extra_args_provider=gpt.add_sampling_args), nproc)
    assert (args.num_layers, args.hidden_size) == ((12, 768) if gpus else (4, 128))
    assert args.bf16 == bool(gpus) and args.save == str(tmp_path / "demo_checkpoint")
    assert nproc == {0: 8, 1: 1, 2: 2, 3: 2, 4: 4, 8: 8}[gpus]
    if gpus:  # ~2 minutes on one H100: GPT-2 small's shape, 500 iterations of 128 x 512 tokens
        assert (args.num_attention_heads, args.seq_length, args.global_batch_size) == (12, 512, 128)
        assert (args.train_iters, args.lr_warmup_iters) == (500, 50)


def test_demo_with_few_iterations_scales_its_warmup(tmp_path):
    """python3 examples/demo.py --train-iters 10 used to fail 8 times over (warmup 20 >= decay 10)."""
    demo = _demo()
    nproc, argv = demo.demo_args(0, ["--train-iters", "10"], str(tmp_path))
    args = validate_args(parse_args(argv, extra_args_provider=gpt.add_sampling_args), nproc)
    assert (args.train_iters, args.lr_warmup_iters) == (10, 1)
    _, argv = demo.demo_args(0, ["--train-iters", "10", "--lr-warmup-iters", "30"], str(tmp_path))
    with pytest.raises(ArgumentError, match=r"--lr-warmup-iters \(30\) must be < --lr-decay-iters \(10"):
        validate_args(parse_args(argv, extra_args_provider=gpt.add_sampling_args), nproc)
