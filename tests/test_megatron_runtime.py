"""Megatron's run-time semantics and the conveniences (issue 14, items 6-8, 9's run-time flags, 12, 13, 15-17):
first launch with a missing --load, --finetune, the LR schedule on resume, --no-save-optim, --use-checkpoint-args,
--exit-duration-in-mins, wandb, progress bars, the loss plot, --log-json record types, no deprecation warnings,
and examples/pretrain_gpt.py without torchrun."""
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

from parallel3d import progress
from parallel3d.training.log_sinks import check_logging_available
from parallel3d.training.resume import CheckedScheduler, ScheduleMismatchError
from parallel3d.training.training_guards import DurationLimit
from parallel3d.training.arguments import parse_args, validate_args
from parallel3d.training.checkpoint_args import apply_checkpoint_args
from parallel3d.distributed import OptimizerParamScheduler
from parallel3d.testing import run_distributed
from parallel3d.tools import plot_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear"]
RUN = ["--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--lr-warmup-iters", "0"]


def _pretrain(tmp_path, *argv, ok=True):
    """examples/pretrain_gpt.py as a plain `python3` command: no torchrun, no RANK in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PARALLEL3D_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-3000:]
    return out


def test_first_launch_resume_schedule_finetune_and_no_save_optim(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    base = SHAPE + RUN + ["--save", ckpt, "--load", ckpt, "--log-json", str(tmp_path / "log.jsonl")]
    out = _pretrain(tmp_path, *base, "--train-iters", "2")
    assert "running as a single process" in out  # item 12: no torchrun needed
    # item 6 (--save created the directory just before: empty, so "holds no checkpoint")
    assert f"notice: --load {ckpt} holds no checkpoint: starting from scratch" in out
    assert "saved checkpoint of iteration 2" in out
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert {r["type"] for r in records} == {"train", "eval"}  # item 17: kept apart
    assert all(("eval_loss" in r) == (r["type"] == "eval") for r in records)
    # Megatron's end of pretrain(): after the last save, the validation set and the test set once more
    assert [(r["split"], r["iteration"]) for r in records if r["type"] == "eval"] == [
        ("validation", 2), ("validation", 2), ("test", 2)]
    assert out.index("saved checkpoint of iteration 2") < out.index("validation at the end of training, iteration 2") \
        < out.index("test at the end of training, iteration 2")

    # item 8: a longer --train-iters changes the decay length: refused, naming both values in iterations
    out = _pretrain(tmp_path, *base, "--train-iters", "4", ok=False)
    assert "--lr-decay-iters: checkpoint 2, this run 4" in out and "--override-opt_param-scheduler" in out
    out = _pretrain(tmp_path, *base, "--train-iters", "3", "--use-checkpoint-opt_param-scheduler")
    assert "loaded" in out and "iteration      3/3" in out
    # nothing left: said, not silent (the checkpoint now carries the 2-iteration schedule it kept)
    out = _pretrain(tmp_path, *base, "--train-iters", "3", "--use-checkpoint-opt_param-scheduler")
    assert "nothing to train" in out and "--finetune" in out

    # item 7: --finetune loads the weights only and trains from iteration 0
    out = _pretrain(tmp_path, *base, "--train-iters", "2", "--finetune", "--no-save-optim")
    assert "--finetune: loaded the weights" in out and "iteration      1/2" in out
    # a checkpoint saved with --no-save-optim resumes only with --no-load-optim
    out = _pretrain(tmp_path, *base, "--train-iters", "3", ok=False)
    assert "saved without optimizer state (--no-save-optim): resume with --no-load-optim" in out
    out = _pretrain(tmp_path, *base, "--train-iters", "3", "--no-load-optim")
    assert "iteration      3/3" in out

    # --use-checkpoint-args: the shape comes from the checkpoint, not restated
    args = parse_args(["--load", ckpt, "--use-checkpoint-args"])
    apply_checkpoint_args(args)
    args = validate_args(args, 1)
    assert (args.num_layers, args.hidden_size, args.normalization, args.swiglu, args.position_embedding_type,
            args.disable_bias_linear, args.tokenizer_type) == (2, 32, "RMSNorm", True, "rope", True, "byte")
    out = _pretrain(tmp_path, "--load", ckpt, "--use-checkpoint-args", "--train-iters", "4", "--no-load-optim",
                    "--seq-length", "32", *RUN)
    assert "--use-checkpoint-args: from" in out and "iteration      4/4" in out


def test_exit_on_missing_checkpoint(tmp_path):
    out = _pretrain(tmp_path, *SHAPE, "--load", str(tmp_path / "none"), "--exit-on-missing-checkpoint", ok=False)
    assert "does not exist yet (--exit-on-missing-checkpoint)" in out and "iteration" not in out.split("error")[0]


def _scheduler(decay_iters, gbs=4):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return OptimizerParamScheduler(opt, 0.0, 1.0, 0.1, 2 * gbs, decay_iters * gbs, "cosine", 0.01, 0.01,
                                   decay_iters * gbs, "constant")


def test_checked_scheduler_follows_megatrons_three_rules():
    args = validate_args(parse_args(["--global-batch-size", "4", "--micro-batch-size", "4"]), 1)
    saved = _scheduler(10).state_dict() | {"num_steps": 20}
    mine = _scheduler(20)
    with pytest.raises(ScheduleMismatchError, match="--lr-decay-iters: checkpoint 10, this run 20"):
        CheckedScheduler(mine, args).load_state_dict(saved)
    args.override_opt_param_scheduler = True
    CheckedScheduler(mine, args).load_state_dict(saved)
    assert (mine.lr_decay_steps, mine.num_steps) == (80, 20)  # this run's schedule at the checkpoint's step
    args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler = False, True
    CheckedScheduler(mine, args).load_state_dict(saved)
    assert (mine.lr_decay_steps, mine.num_steps) == (40, 20)


def test_exit_duration_limit():
    assert not DurationLimit(None).reached()
    assert not DurationLimit(5.0).reached()
    import time

    assert DurationLimit(0.01, start=time.monotonic() - 1.0).reached()


def _logger_args(**extra):
    args = validate_args(parse_args(["--train-iters", "4", "--log-interval", "2"]), 1)
    vars(args).update(extra)
    return args


def test_wandb_gets_train_and_eval_records(monkeypatch):
    calls = []
    run = types.SimpleNamespace(log=lambda values, step: calls.append((step, values)), finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from parallel3d.training import TrainingLogger

    logger = TrainingLogger(_logger_args(wandb_project="p3d", wandb_exp_name="run1"))
    logger.record({"lm loss": 2.0}, False)
    logger.log(2, 1e-3, 1.0, None)
    logger.log_eval(2, {"lm loss": 1.5})
    logger.close()
    assert calls[0]["project"] == "p3d" and calls[0]["name"] == "run1"
    assert calls[1][0] == 2 and calls[1][1]["train/loss"] == 2.0 and calls[2][1]["eval/eval_loss"] == 1.5


def test_wandb_missing_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install wandb"):
        check_logging_available(_logger_args(wandb_project="p3d"))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("PARALLEL3D_NO_PROGRESS", raising=False)
    assert progress.make_bar(10, "x", stream=io.StringIO()) is None
    term = _Terminal()
    bar = progress.make_bar(10, "tokenizing", stream=term, initial=4)
    bar.update(2)
    progress.emit(bar, "a log line", stream=term)
    bar.close()
    text = term.getvalue()
    assert "tokenizing" in text and "6/10" in text and "<" in text and "a log line" in text  # "<" = the ETA
    monkeypatch.setenv("PARALLEL3D_NO_PROGRESS", "1")
    assert progress.make_bar(10, "x", stream=_Terminal()) is None


def test_training_logger_draws_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    monkeypatch.delenv("PARALLEL3D_NO_PROGRESS", raising=False)
    from parallel3d.training import TrainingLogger

    for stream, has_bar in ((_Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stdout", stream)
        logger = TrainingLogger(_logger_args(), start_iteration=2)
        logger.record({"lm loss": 2.0}, False)
        logger.log(3, 1e-3, 1.0, None)
        logger.close()
        text = stream.getvalue()
        assert "iteration      3/4 | loss 2.0000" in text
        assert ("3/4 [" in text) == has_bar, text


def test_plot_log_draws_train_and_eval_curves(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [
        {"type": "train", "iteration": 1, "loss": 3.0}, {"type": "train", "iteration": 2, "loss": 2.5},
        {"type": "eval", "iteration": 2, "eval_loss": 2.7}, {"iteration": 3, "eval_loss": 2.6}]) + "\n")
    assert plot_log.read_log(str(log)) == ({1: 3.0, 2: 2.5}, {2: 2.7, 3: 2.6})
    pytest.importorskip("matplotlib")
    assert plot_log.main([str(log), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert plot_log.main([str(tmp_path / "bad.jsonl")]) == 1


def _tp_collectives_warnings(rank, world_size):
    from parallel3d import parallel_state
    from parallel3d.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        fc1 = ColumnParallelLinear(8, 16, sequence_parallel=True)
        fc2 = RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel=True)
        x = torch.randn(4, 2, 8, requires_grad=True)
        fc2(fc1(x)[0])[0].sum().backward()
        parallel_state.destroy_model_parallel()
    return [f"{w.category.__name__}: {w.message}" for w in caught
            if issubclass(w.category, (DeprecationWarning, FutureWarning))]


def test_tensor_parallel_collectives_emit_no_deprecation_warnings():
    """torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning per call)."""
    for found in run_distributed(_tp_collectives_warnings, 2, timeout=120):
        assert found == [], found


def test_tensorboard_gets_megatrons_tag_names(monkeypatch):
    """Issue 30 item 6: the tags were the log-json keys ("loss", "lr"); Megatron's dashboards read "lm loss",
    "learning-rate", "lm loss validation", ... and their "vs samples" twins."""
    scalars = []

    class Writer:
        def __init__(self, log_dir):
            scalars.append(("dir", log_dir, None))

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    from parallel3d.training import TrainingLogger

    args = _logger_args(tensorboard_dir="tb")
    logger = TrainingLogger(args)
    logger.record({"lm loss": 2.0}, False)
    logger.log(2, 1e-3, 0.5, None, consumed_samples=64)
    logger.log_eval(2, {"lm loss": 1.5}, consumed_samples=64)
    logger.close()
    got = {tag: (value, step) for tag, value, step in scalars}
    assert got["dir"] == ("tb", None)
    assert got["lm loss"] == (2.0, 2) and got["lm loss vs samples"] == (2.0, 64)
    assert got["learning-rate"] == (1e-3, 2) and got["grad-norm"] == (0.5, 2)
    assert got["batch-size"] == (args.global_batch_size, 2)
    assert got["lm loss validation"] == (1.5, 2) and got["lm loss validation vs samples"] == (1.5, 64)
    assert abs(got["lm loss validation ppl"][0] - math.exp(1.5)) < 1e-9
    assert "loss" not in got and "lr" not in got and "loss-scale" not in got  # fp32: no loss scale


def test_tensorboard_missing_is_refused_before_training(monkeypatch):
    """Issue 30 item 6: --tensorboard-dir without tensorboard printed a line and trained without the logs."""
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ImportError, match=r"--tensorboard-dir needs the tensorboard package: pip install tensorboard"):
        check_logging_available(_logger_args(tensorboard_dir="tb"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # a library caller of pretrain: refused too
    from parallel3d.training import TrainingLogger
    with pytest.raises(ImportError, match="--tensorboard-dir needs the tensorboard package"):
        TrainingLogger(_logger_args(tensorboard_dir="tb"))


def test_the_log_starts_at_iteration_1_and_rates_no_gpu_on_cpu(tmp_path, capsys):
    """Issue 30 item 12: the demo's curve began at iteration 25, and CPU logs said `0.0 TFLOP/s/GPU`."""
    from gpt_harness import layout_args, train

    args = layout_args("gpt2", iters=6, extra=["--log-interval", "5", "--log-json", str(tmp_path / "log.jsonl")])
    train(args)
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [r["iteration"] for r in records] == [1, 5, 6]
    from parallel3d.training import TrainingLogger

    logger = TrainingLogger(_logger_args())
    logger.record({"lm loss": 2.0}, False)
    logger.log(2, 1e-3, 1.0, None)
    logger.close()
    line = capsys.readouterr().out
    assert "iteration      2/4" in line and "TFLOP/s" not in line and "tokens/s | mem" in line


def test_reported_losses_average_as_megatron_reports_them():
    """LossAverager: a plain loss is the mean over microbatches; Megatron's (sum, count) pairs
    (--calculate-per-token-loss) are token-weighted over the batch, not a mean of microbatch means."""
    from parallel3d.training import LossAverager

    plain = [{"lm loss": torch.tensor(1.0)}, {"lm loss": 3.0}]
    assert LossAverager()(plain) == {"lm loss": 2.0}
    pairs = [{"lm loss": (torch.tensor(6.0), torch.tensor(2))}, {"lm loss": (torch.tensor(2.0), torch.tensor(6))}]
    assert LossAverager()(pairs) == {"lm loss": 1.0}  # 8 / 8 tokens; the microbatch means' mean would be 5/3
    assert LossAverager()([{"lm loss": (torch.tensor(0.0), torch.tensor(0))}]) == {"lm loss": 0.0}  # all masked

