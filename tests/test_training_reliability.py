"""The training loop under faults: non-finite steps, endless fp16 skipping, a hung rank, SIGTERM, errors.

In-process tests run pretrain() at world size 1 on a tiny GPT; the multi-process ones run
examples/pretrain_gpt.py under torchrun (gloo CPU ranks) with a timeout, and kill every
process they started (SIGSTOPped ones included) in a ``finally``.
"""
import contextlib
import io
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from functools import partial

import pytest
import torch

import torchrun

from parallel3d.training import checkpointing
from parallel3d.training.arguments import parse_args, validate_args
from parallel3d.training import gpt, pretrain
from parallel3d.training.training_guards import StepGuard, TrainingError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")

VOCAB, SEQ = 64, 8
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", str(SEQ),
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1000", "--eval-interval", "1000",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress-bar"]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256):
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        t = self.tokens[i]
        return {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(SEQ), "position_ids": torch.arange(SEQ)}


def _nan_at(calls: set, data_iterator, model):
    """The GPT forward step (parallel3d.training.gpt), with the loss of the listed microbatch calls (0-based) made NaN."""
    output, loss_func = gpt.forward_step(False, data_iterator, model)
    n = _nan_at.count = getattr(_nan_at, "count", 0) + 1

    def poisoned(out):
        loss, reduced = loss_func(out)
        if n - 1 in calls:
            loss = loss * float("nan")
            reduced = {"lm loss": loss.detach()}
        return loss, reduced

    return output, poisoned


def _train(argv, nan_calls=()):
    args = validate_args(parse_args(TINY + ["--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "8"]
                                    + argv, extra_args_provider=gpt.add_sampling_args), 1)
    config = gpt.transformer_config_from_args(args)
    partition = gpt.layer_partition(args, config)
    _nan_at.count = 0
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            result = pretrain(args, partial(gpt.model_provider, config, partition),
                              partial(_nan_at, set(nan_calls)), lambda n: (Tokens(), None, None), model_config=config)
    finally:
        sys.stdout.write(out.getvalue())
    return result, out.getvalue()


def _weights(result):
    return [p.detach().clone() for p in result["model"][0].parameters()]


# ---------------------------------------------------------------- 6: no silent NaN


def test_nonfinite_loss_stops_by_default_naming_iteration_and_stage(tmp_path):
    # 2 microbatches per iteration: call 4 is iteration 3's first microbatch
    with pytest.raises(TrainingError) as info:
        _train(["--train-iters", "6", "--save", str(tmp_path), "--save-interval", "1"], nan_calls={4})
    text = str(info.value)
    assert text.startswith("iteration 3: non-finite lm loss nan, grad norm nan"), text
    assert "pipeline stage 0 (rank 0" in text and "Nothing of this iteration was saved" in text, text
    assert checkpointing.read_latest_iteration(str(tmp_path)) == 2  # the NaN state never became the latest


def test_skip_nonfinite_iters_skips_the_update_and_counts(tmp_path):
    result, out = _train(["--train-iters", "5", "--skip-nonfinite-iters", "1"], nan_calls={4})
    assert result["iteration"] == 5
    assert result["optimizer"].num_steps == 4  # iteration 3's update was skipped
    assert all(torch.isfinite(w).all() for w in _weights(result))
    assert "iteration 3: non-finite lm loss nan, grad norm nan: update skipped (1 of --skip-nonfinite-iters 1)" in out
    with pytest.raises(TrainingError, match=r"iteration 4: .*\(2 non-finite iterations, more than "
                                            r"--skip-nonfinite-iters 1\)"):
        _train(["--train-iters", "5", "--skip-nonfinite-iters", "1"], nan_calls={4, 6})


def test_no_check_for_nan_keeps_going_as_before():
    result, _ = _train(["--train-iters", "4", "--no-check-for-nan-in-loss-and-grad"], nan_calls={2})
    assert result["iteration"] == 4 and math.isnan(result["losses"][1]["lm loss"])


def test_nonfinite_check_adds_no_host_sync():
    """The guard reads host floats only: it never touches a tensor on the default (finite) path."""
    args = parse_args(TINY)
    guard = StepGuard(validate_args(args, 1))
    assert guard.check(1, {"lm loss": 2.0}, 1.5, False, model=[]) is False  # model unused unless a step is bad


# ---------------------------------------------------------------- 7: fp16 that skips forever


def test_fp16_skipping_every_step_stops_after_max_consecutive_skipped_iters():
    with pytest.raises(TrainingError, match=r"iteration 5: the last 5 iterations were all skipped with fp16 loss "
                                            r"scale 1e\+30 .*--max-consecutive-skipped-iters"):
        _train(["--fp16", "--loss-scale", "1e30", "--train-iters", "50", "--max-consecutive-skipped-iters", "5"])
    assert parse_args([]).max_consecutive_skipped_iters == 100


def test_occasional_fp16_skips_do_not_stop():
    """Dynamic scaling from 2**20 skips a run of early steps, fewer than the limit, then trains."""
    result, _ = _train(["--fp16", "--initial-loss-scale", str(2.0 ** 20), "--train-iters", "20",
                        "--max-consecutive-skipped-iters", "19"])
    assert result["iteration"] == 20 and result["optimizer"].num_steps >= 1


def test_gradients_underflowing_to_zero_stop_the_run():
    """fp16 with a loss scale so small the scaled loss underflows: the norm is exactly 0 at every step."""
    from parallel3d.training.training_guards import ZERO_GRAD_STOP_ITERS
    with pytest.raises(TrainingError, match=rf"iteration {ZERO_GRAD_STOP_ITERS}: the gradient norm was exactly 0 "
                                            rf"for the last {ZERO_GRAD_STOP_ITERS} iterations \(fp16 loss scale "
                                            r"1e-10: .*--loss-scale"):
        _train(["--fp16", "--loss-scale", "1e-10", "--train-iters", "50"])
    guard = StepGuard(validate_args(parse_args(TINY), 1))
    for it in range(1, 3 * ZERO_GRAD_STOP_ITERS):  # zeros that are not consecutive never stop a run
        guard.check(it, {"lm loss": 2.0}, 0.0 if it % ZERO_GRAD_STOP_ITERS else 1.0, False, model=[])


# ---------------------------------------------------------------- multi-process helpers


def _launch(nproc: int, argv: list, tmp_path, extra_env=None):
    return torchrun.start(nproc, SCRIPT, argv, tmp_path, extra_env)


_workers, _wait_for, _alive, _cleanup = torchrun.workers, torchrun.wait_for, torchrun.alive, torchrun.cleanup


# ---------------------------------------------------------------- 8: a hung rank


def test_hung_rank_is_named_by_every_rank_within_the_timeout(tmp_path):
    """4 pipeline stages, 3 s timeout; rank 2 is SIGSTOPped mid-training: the others exit, naming it."""
    timeout_s = 3.0
    agent = _launch(4, TINY + ["--pipeline-model-parallel-size", "4", "--num-layers", "4", "--train-iters", "100000",
                               "--log-interval", "1", "--distributed-timeout-minutes", str(timeout_s / 60)], tmp_path)
    workers = {}
    try:
        _wait_for(tmp_path / "out.txt", "iteration      3/", agent, 180)
        workers = _workers(agent)
        assert sorted(workers) == [0, 1, 2, 3], workers
        os.kill(workers[2], signal.SIGSTOP)
        stopped_at = time.monotonic()
        others = [workers[r] for r in (0, 1, 3)]
        while any(_alive(p) for p in others) and time.monotonic() < stopped_at + timeout_s + 30:
            time.sleep(0.2)
        assert not any(_alive(p) for p in others), "a live rank did not exit within the timeout + 30 s"
    finally:
        _cleanup(agent, workers.values())
    err = (tmp_path / "err.txt").read_text()
    for rank in (0, 1, 3):
        lines = [line for line in err.splitlines() if line.startswith(f"error: rank {rank}: ")]
        assert len(lines) == 1, err[-4000:]
        assert "timed out after 3 s" in lines[0] or "failed (" in lines[0], lines[0]
        assert "rank 2 reported no communication failure" in lines[0], lines[0]
    assert 'pretrain_gpt.py", line' not in err  # one line per rank, no worker traceback


# ---------------------------------------------------------------- 9: SIGTERM


def test_sigterm_saves_and_exits_zero_and_resume_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--log-interval", "1", "--exit-signal-handler",
                   "--save", str(ckpt), "--save-interval", "1000", "--lr-decay-style", "constant"]
    agent = _launch(2, argv + ["--train-iters", "100000"], tmp_path)
    workers = {}
    try:
        _wait_for(tmp_path / "out.txt", "iteration      3/", agent, 180)
        workers = _workers(agent)
        os.kill(workers[1], signal.SIGTERM)  # one rank only: the flag is agreed across ranks
        time.sleep(0.3)
        with contextlib.suppress(ProcessLookupError):  # a late second signal, unless rank 0 has already exited
            os.kill(workers[0], signal.SIGTERM)
        rc = agent.wait(timeout=120)
    finally:
        _cleanup(agent, workers.values())
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, (tmp_path / "err.txt").read_text()[-3000:]
    saved = checkpointing.read_latest_iteration(str(ckpt))
    assert f"exiting after iteration {saved}: received SIGTERM" in out, out[-2000:]
    assert f"saved checkpoint of iteration {saved}" in out and saved >= 3

    # a shorter --train-iters than the saved job's: Megatron's rule wants the schedule's source named
    agent = _launch(2, argv + ["--load", str(ckpt), "--train-iters", str(saved + 2),
                               "--use-checkpoint-opt_param-scheduler"], tmp_path)
    try:
        rc = agent.wait(timeout=180)
    finally:
        _cleanup(agent, [])
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, (tmp_path / "err.txt").read_text()[-3000:]
    assert f"loaded {ckpt} at iteration {saved}" in out and f"iteration {saved + 2:6d}/{saved + 2}" in out, out


def test_sigterm_to_the_launcher_saves_the_last_iteration(tmp_path):
    """The documented launcher path (docs/reliability.md): torchrun forwards SIGTERM to every worker, which
    finish the iteration, save it and exit 0 within torchrun's 30 s shutdown (torchrun itself exits 1)."""
    ckpt = tmp_path / "ckpt"
    agent = _launch(2, TINY + ["--tensor-model-parallel-size", "2", "--log-interval", "1", "--exit-signal-handler",
                               "--save", str(ckpt), "--save-interval", "1000", "--train-iters", "100000"], tmp_path)
    workers = {}
    try:
        _wait_for(tmp_path / "out.txt", "iteration      3/", agent, 180)
        workers = _workers(agent)
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
    finally:
        _cleanup(agent, workers.values())
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    saved = checkpointing.read_latest_iteration(str(ckpt))
    assert saved and saved >= 3, err[-3000:]
    assert f"exiting after iteration {saved}: received SIGTERM" in out and f"saved checkpoint of iteration {saved}" \
        in out, out[-2000:]
    assert "error: rank" not in err, err[-3000:]  # the workers ended cleanly; torchrun's own status (1) is torch's


# ---------------------------------------------------------------- 6, 21, 22 through the real script


def test_nan_run_exits_nonzero_with_one_line_per_rank_and_keeps_the_good_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    agent = _launch(2, TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "20", "--lr", "1e6",
                               "--save", str(ckpt), "--save-interval", "1"], tmp_path)
    try:
        rc = agent.wait(timeout=180)
    finally:
        _cleanup(agent, [])
    err = (tmp_path / "err.txt").read_text()
    assert rc != 0
    lines = [line for line in err.splitlines() if line.startswith("error: rank ")]
    assert len(lines) == 2 and all("non-finite" in line and "pipeline stage" in line for line in lines), err[-3000:]
    bad = int(lines[0].split("iteration ")[1].split(":")[0])
    assert checkpointing.read_latest_iteration(str(ckpt)) == bad - 1
    assert 'pretrain_gpt.py", line' not in err


def test_growing_dp_on_resume_suggests_no_load_rng(tmp_path):
    ckpt = tmp_path / "ckpt"
    base = TINY + ["--train-iters", "2", "--save", str(ckpt), "--lr-decay-style", "constant"]
    for nproc, extra, want_rc in ((1, [], 0), (2, ["--load", str(ckpt), "--train-iters", "3"], 1),
                                  (2, ["--load", str(ckpt), "--train-iters", "3", "--no-load-rng"], 0)):
        agent = _launch(nproc, base + extra, tmp_path)
        try:
            rc = agent.wait(timeout=180)
        finally:
            _cleanup(agent, [])
        err = (tmp_path / "err.txt").read_text()
        assert (rc == 0) == (want_rc == 0), err[-3000:]
        if want_rc:
            rank1 = [line for line in err.splitlines() if line.startswith("error: rank 1: ")]
            assert len(rank1) == 1 and "missing RNG state" in rank1[0] and "--no-load-rng" in rank1[0], err[-3000:]
            assert 'pretrain_gpt.py", line' not in err  # one line per rank, no traceback
    assert checkpointing.read_latest_iteration(str(ckpt)) == 3


def test_debug_env_shows_the_traceback(tmp_path):
    argv = TINY + ["--train-iters", "3", "--lr", "1e6"]
    agent = _launch(1, argv, tmp_path, extra_env={"PARALLEL3D_DEBUG": "1"})
    try:
        rc = agent.wait(timeout=120)
    finally:
        _cleanup(agent, [])
    err = (tmp_path / "err.txt").read_text()
    assert rc != 0 and "Traceback" in err and "TrainingError: iteration" in err, err[-3000:]


def test_generate_error_after_init_is_one_line(tmp_path):
    """tools/generate.py: a shard that disappears after the up-front checks is one line, not a traceback."""
    _train(["--train-iters", "1", "--save", str(tmp_path / "ckpt")])
    shard = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00_000" / "model.safetensors"
    shard.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "PARALLEL3D_DEBUG"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load", str(tmp_path / "ckpt"),
                           "--prompt-ids", "1,2", "--max-new-tokens", "2", "--output-json", str(tmp_path / "o.json")],
                          capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: rank 0: ") and "model.safetensors" in lines[0], lines[0]
