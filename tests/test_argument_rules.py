"""Argument errors of a whole command line at once, printed once per launch (issue 30 item 7); combinations
Megatron refuses, flags a combination leaves without effect (issue 29 item 11); pre-flight checks of the
machine (issue 29 item 17)."""
import os

import pytest

from parallel3d.training.argument_rules import report_bad_input
from parallel3d.training.arguments import ArgumentError, parse_args, validate_args


def _problems(argv, world=1):
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(argv), world)
    return info.value.problems


def test_bounds_are_checked_in_validation():
    """The script's one-line refusal is tests/test_arguments.py's (a process each); these bounds are the same
    rule in validate_args, checked here without a process."""
    assert _problems(["--make-vocab-size-divisible-by", "0", "--eval-iters", "-1"]) == [
        "--make-vocab-size-divisible-by must be >= 1, got 0", "--eval-iters must be >= 0, got -1"]


def test_every_bad_value_of_a_command_line_is_reported_at_once():
    problems = _problems(["--micro-batch-size", "0", "--lr", "-1", "--bf16", "--fp16", "--seed", "-3",
                          "--tensor-model-parallel-size", "3"], world=2)
    assert problems[0].startswith("world size (2) is not divisible by --tensor-model-parallel-size (3)")
    assert problems[1:] == ["--micro-batch-size must be >= 1, got 0", "--lr must be >= 0, got -1.0",
                            "--seed must be in [0, 2**31) (numpy seeds the data order with it), got -3",
                            "--bf16 and --fp16 are exclusive"]


def test_a_refusal_is_printed_by_rank_0_only(capsys, monkeypatch):
    error = ArgumentError("--lr must be >= 0, got -1.0", "--bf16 and --fp16 are exclusive")
    monkeypatch.setenv("RANK", "0")
    assert report_bad_input(error) == 2
    assert capsys.readouterr().err == "error: --lr must be >= 0, got -1.0\nerror: --bf16 and --fp16 are exclusive\n"
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert report_bad_input(error) == 0 and capsys.readouterr().err == ""  # rank 0 carries the failure
    # a rank's own machine may differ from rank 0's: the first process of each node says it
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert report_bad_input(FileNotFoundError("no file /data/x.bin")) == 2
    assert capsys.readouterr().err == "error: rank 4: no file /data/x.bin\n"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert report_bad_input(FileNotFoundError("no file /data/x.bin")) == 2 and capsys.readouterr().err == ""


def test_an_unknown_flag_is_one_line_not_the_usage(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        parse_args(["--no-such-flag", "3"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --no-such-flag 3 (--help lists the options)\n")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        parse_args(["--no-such-flag", "3"])
    assert info.value.code == 0 and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- issue 29 item 11


@pytest.mark.parametrize("argv,message", [
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"],
     "--lr-warmup-fraction and --lr-warmup-iters both set the warmup: give one (Megatron refuses both)"),
    (["--train-samples", "100", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "5"],
     "--lr-warmup-fraction and --lr-warmup-samples both set the warmup"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"],
     "--recompute-method block applies to --recompute-granularity full only"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 applies to --recompute-granularity full only"),
    (["--recompute-granularity", "full"],
     "--recompute-granularity full needs --recompute-method and --recompute-num-layers (Megatron refuses it"),
    (["--recompute-granularity", "full", "--recompute-method", "block"],
     "--recompute-granularity full needs --recompute-num-layers (Megatron refuses it"),
])
def test_combinations_megatron_refuses_are_refused(argv, message):
    assert any(p.startswith(message) for p in _problems(argv)), _problems(argv)


@pytest.mark.parametrize("argv,warning", [
    (["--num-query-groups", "2"], "--num-query-groups has no effect: only --group-query-attention uses it"),
    (["--recompute-method", "block"], "--recompute-method has no effect: without --recompute-granularity full"),
    (["--finetune"], "--finetune has no effect: there is no --load"),
    (["--save-interval", "5"], "--save-interval has no effect: there is no --save"),
    (["--bf16", "--min-loss-scale", "4"], "--min-loss-scale has no effect: they tune dynamic loss scaling"),
    (["--hysteresis", "4", "--loss-scale-window", "50"], "--loss-scale-window, --hysteresis have no effect"),
    (["--optimizer", "sgd", "--adam-beta1", "0.8"], "--adam-beta1 has no effect: --optimizer is sgd"),
    (["--sgd-momentum", "0.5"], "--sgd-momentum has no effect: --optimizer is adam"),
    (["--no-check-for-nan-in-loss-and-grad", "--skip-nonfinite-iters", "2"],
     "--skip-nonfinite-iters has no effect: --no-check-for-nan-in-loss-and-grad"),
    (["--split", "100,0,0", "--eval-iters", "2"],
     "--eval-iters 2 has no effect: --split 100,0,0 gives the validation set no weight"),
])
def test_flags_without_effect_in_their_combination_are_warned_once(argv, warning, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    validate_args(parse_args(argv), 1)
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and f"warning: {warning}" in err, err
    monkeypatch.setenv("RANK", "1")
    validate_args(parse_args(argv), 1)
    assert capsys.readouterr().err == ""


def test_a_plain_command_line_gets_no_warning(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    validate_args(parse_args(["--fp16", "--min-loss-scale", "4", "--save", "x", "--save-interval", "5",
                              "--group-query-attention", "--num-query-groups", "2"]), 1)
    assert "warning" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- issue 29 item 17


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_refused(value):
    assert _problems([f"--lr={value}"])[0] == f"--lr must be a finite number, got {float(value)}"
    assert _problems([f"--clip-grad={value}"])[0] == f"--clip-grad must be a finite number, got {float(value)}"


def test_nccl_without_cuda_is_refused_before_init(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _problems(["--distributed-backend", "nccl"]) == [
        "--distributed-backend nccl needs CUDA GPUs and torch sees none (torch.cuda.is_available() is False): use "
        "--distributed-backend gloo, or omit the flag"]


def test_a_bad_log_json_path_is_refused_before_init(tmp_path):
    missing = str(tmp_path / "no" / "log.jsonl")
    assert _problems(["--log-json", missing]) == [
        f"--log-json {missing}: the directory {os.path.dirname(missing)} does not exist"]
    assert _problems(["--log-json", str(tmp_path)])[0].startswith(f"--log-json {tmp_path} is a directory")
    validate_args(parse_args(["--log-json", str(tmp_path / "log.jsonl")]), 1)


def _fits(argv, world=1, capacity=64 * 2 ** 30, host=64 * 2 ** 30):
    from parallel3d.training import gpt  # its --sample-prompt / --sample-tokens
    from parallel3d.training.preflight import check_fits

    args = validate_args(parse_args(["--vocab-size", "256"] + argv, extra_args_provider=gpt.add_sampling_args),
                         world)
    try:
        check_fits(args, gpt.transformer_config_from_args(args), (capacity, "64.0 GiB of the test device"),
                   host)
    except ArgumentError as e:
        return e.problems
    return []


def test_absurd_sizes_are_refused_before_init_with_the_estimate_and_what_fits():
    """Issue 29 item 17: these failed after init, on every rank, with raw allocator errors."""
    (wide,) = _fits(["--hidden-size", "65536", "--num-attention-heads", "64"])
    assert wide.startswith("this layout needs at least ") and "more than the 64.0 GiB of the test device" in wide
    assert "the weights, gradients and optimizer state alone need" in wide and "model-parallel ranks" in wide
    (deep,) = _fits(["--num-layers", "100000"])
    assert "the weights, gradients and optimizer state alone need" in deep
    (batch,) = _fits(["--micro-batch-size", "100000", "--global-batch-size", "100000"])
    fits = int(batch.split("--micro-batch-size ")[-1].split()[0])
    assert batch.endswith(f"--micro-batch-size {fits} fits by the estimate") and 1 <= fits < 100000
    assert _fits(["--micro-batch-size", str(fits), "--global-batch-size", str(fits)]) == []
    (long_run,) = _fits(["--train-iters", str(10 ** 10), "--micro-batch-size", "1", "--global-batch-size", "1"])
    assert long_run == (f"--train-iters {10 ** 10} x global batch 1 = {10 ** 10:,} samples: their data index alone "
                        "needs 298.0 GiB (32 bytes a sample), more than the host's 64.0 GiB per process; at most "
                        "about 2,147,483,648 iterations fit")
    assert _fits([]) == []  # the defaults fit
    sample = ["--position-embedding-type", "rope", "--sample-prompt", "x", "--sample-tokens"]
    (tokens,) = _fits(sample + [str(10 ** 9)])
    # 4 layers x 2 (k, v) x 128 channels x 4 bytes a token
    assert tokens == ("--sample-tokens 1000000000 needs a KV cache of 3,814.7 GiB for the --sample-prompt "
                      "continuation, more than the 64.0 GiB of the test device; at most about 16,777,216 tokens fit")
    assert _fits(sample + ["16777216"]) == []
    # the machine's own memory where none is given (host memory on CPU processes)
    from parallel3d.training import gpt
    from parallel3d.training.preflight import check_fits

    args = validate_args(parse_args(["--vocab-size", "256", "--hidden-size", "65536", "--num-attention-heads", "64"],
                                    extra_args_provider=gpt.add_sampling_args), 1)
    with pytest.raises(ArgumentError, match="GiB host memory per process"):
        check_fits(args, gpt.transformer_config_from_args(args))
