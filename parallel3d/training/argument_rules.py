"""The value rules of validate_args (arguments.py) that need no layout: ranges, finiteness, the optimizer and LR
schedule, Megatron's refused combinations, the flags a combination leaves without effect; and how a refusal
before any work is printed.

Each rule returns its problems instead of raising at the first one, so one launch reports every bad value
of a command line (``ArgumentError.problems``). A flag that does nothing in its combination is not an
error where Megatron accepts it: it gets one warning line, from rank 0.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Callable, Optional, Sequence

from parallel3d.pipeline.forward_backward import INTERLEAVED


class ArgumentError(ValueError):
    """One or more bad arguments; ``problems`` lists them, one line each."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def raise_problems(problems: Sequence[str]) -> None:
    if problems:
        raise ArgumentError(*problems)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def notice(message: str, kind: str = "notice") -> None:
    """A setting changed for the user, or one without effect: said once (rank 0; torchrun sets RANK before init)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{kind}: {message}", file=sys.stderr, flush=True)


def report_bad_input(error: BaseException) -> int:
    """Print a refusal made before any work and return the process's exit code.

    Every rank of a launch checks the same command line, so rank 0 alone prints an argument error (one
    line per problem) and exits 2; another rank exits 0 without a word, and torchrun reports one failed
    process instead of one per rank. An error of a rank's own machine (a file, a package, a checkpoint)
    may differ from rank 0's: the first process of each node prints it, naming its rank."""
    rank, local_rank = os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0")
    lines = str(error).splitlines() or [type(error).__name__]
    if rank == "0":
        sys.stderr.write("".join(f"error: {line}\n" for line in lines))  # one write: ranks' lines never interleave
    elif isinstance(error, ArgumentError):
        return 0
    elif local_rank == "0":
        sys.stderr.write("".join(f"error: rank {rank}: {line}\n" for line in lines))
    sys.stderr.flush()
    return 2


# Range rules per flag: (flags, test, what the value must be). Optional flags (default None) are only
# checked when given. Checked first, so later arithmetic (modulo, division) never sees a zero.
_RANGES: tuple[tuple[tuple[str, ...], Callable[[float], bool], str], ...] = (
    (("micro_batch_size", "global_batch_size", "train_iters", "num_layers", "hidden_size", "num_attention_heads",
      "seq_length", "make_vocab_size_divisible_by", "log_interval", "eval_interval", "lr_decay_iters",
      "ffn_hidden_size", "kv_channels", "num_query_groups", "max_position_embeddings", "recompute_num_layers",
      "num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size",
      "microbatch_group_size_per_vp_stage", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
      "ddp_bucket_size", "exit_interval", "save_interval", "lr_wsd_decay_iters", "vocab_size", "train_samples",
      "lr_decay_samples", "lr_wsd_decay_samples", "cuda_graph_warmup_steps"),
     lambda v: v >= 1, ">= 1"),
    (("lr", "min_lr", "lr_warmup_iters", "weight_decay", "sgd_momentum", "num_workers", "eval_iters",
      "skip_nonfinite_iters", "max_consecutive_skipped_iters", "lr_warmup_samples"),
     lambda v: v >= 0, ">= 0"),
    (("clip_grad",), lambda v: v >= 0, ">= 0 (0 turns clipping off)"),
    (("seed",), lambda v: 0 <= v < 2 ** 31, "in [0, 2**31) (numpy seeds the data order with it)"),
    (("rotary_base", "norm_epsilon", "adam_eps", "init_method_std", "loss_scale", "peak_tflops",
      "distributed_timeout_minutes"),
     lambda v: v > 0, "> 0"),
    (("attention_dropout", "hidden_dropout", "adam_beta1", "adam_beta2", "lr_warmup_fraction"),
     lambda v: 0 <= v < 1, "in [0, 1)"),
    (("rotary_percent",), lambda v: 0 < v <= 1, "in (0, 1]"),
)
_SPLIT = re.compile(r"\s*\d*\.?\d+\s*([,/]\s*\d*\.?\d+\s*){0,2}")


def split_weights(split: str) -> list[float]:
    return [float(x) for x in re.split(r"[,/]", split)]


def range_problems(args: argparse.Namespace) -> list[str]:
    """Every value out of its range, every non-finite number (``--lr inf`` passes ">= 0"), a malformed --split."""
    problems = [f"{flag(name)} must be a finite number, got {value}" for name, value in sorted(vars(args).items())
                if isinstance(value, float) and not math.isfinite(value)]
    bad = {p.split()[0] for p in problems}
    for names, ok, need in _RANGES:
        for name in names:
            value = getattr(args, name, None)
            if value is not None and flag(name) not in bad and not ok(value):
                problems.append(f"{flag(name)} must be {need}, got {value}")
    if not _SPLIT.fullmatch(args.split) or not any(w > 0 for w in split_weights(args.split)):
        problems.append(f"--split {args.split!r} must be 1 to 3 non-negative weights (train,valid,test) with a "
                        "positive sum, e.g. 969,30,1")
    return problems


def refused_combinations(args: argparse.Namespace) -> list[str]:
    """Combinations Megatron's validate_args refuses (asserts), refused here with the fix."""
    problems = []
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        given = "--lr-warmup-iters" if args.lr_warmup_iters else "--lr-warmup-samples"
        problems.append(f"--lr-warmup-fraction and {given} both set the warmup: give one (Megatron refuses both)")
    # Megatron-Core's TransformerConfig: full recomputation needs both, selective takes neither.
    full_only = ("recompute_method", "recompute_num_layers")
    if args.recompute_granularity == "selective":
        problems += [f"{flag(n)} {getattr(args, n)} applies to --recompute-granularity full only; selective "
                     f"recomputation takes no method or layer count (Megatron refuses it): drop {flag(n)}"
                     for n in full_only if getattr(args, n) is not None]
    missing = [flag(n) for n in full_only if args.recompute_granularity == "full" and getattr(args, n) is None]
    if missing:
        problems.append(f"--recompute-granularity full needs {' and '.join(missing)} (Megatron refuses it without): "
                        "e.g. --recompute-method uniform --recompute-num-layers 1 recomputes every layer")
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 are exclusive")
    if args.group_query_attention and args.num_query_groups is None:
        problems.append("--group-query-attention needs --num-query-groups")
    return problems


def _given(args: argparse.Namespace, defaults: dict, *names: str) -> list[str]:
    """The flags among ``names`` whose value is not the parser's default."""
    return [flag(n) for n in names if n in defaults and getattr(args, n, None) != defaults[n]]


def ineffective_flags(args: argparse.Namespace, defaults: dict) -> list[str]:
    """Flags the combination leaves without effect (Megatron ignores them without a word): one warning each."""
    fp16_dynamic = args.fp16 and args.loss_scale is None
    rules = (
        (not args.group_query_attention, ("num_query_groups",), "only --group-query-attention uses it"),
        (args.recompute_granularity is None, ("recompute_method", "recompute_num_layers"),
         "without --recompute-granularity full nothing is recomputed"),
        (not args.load, ("finetune", "no_load_optim", "no_load_rng"), "there is no --load"),
        (not args.save, ("save_interval", "no_save_optim"), "there is no --save"),
        (not fp16_dynamic, ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"),
         "they tune dynamic loss scaling, which only --fp16 without --loss-scale uses"),
        (args.optimizer != "adam", ("adam_beta1", "adam_beta2", "adam_eps"), f"--optimizer is {args.optimizer}"),
        (args.optimizer != "sgd", ("sgd_momentum",), f"--optimizer is {args.optimizer}"),
        (not args.check_for_nan_in_loss_and_grad, ("skip_nonfinite_iters",),
         "--no-check-for-nan-in-loss-and-grad turns the non-finite check off"),
        (not (args.virtual_pipeline_model_parallel_size or args.num_layers_per_virtual_pipeline_stage)
         or args.pipeline_schedule not in (None, INTERLEAVED), ("microbatch_group_size_per_vp_stage",),
         "only the interleaved schedule (a virtual pipeline) groups microbatches"),
    )
    warnings = []
    for applies, fields, why in rules:
        names = _given(args, defaults, *fields) if applies else []
        if names:
            warnings.append(f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect: {why}")
    weights = split_weights(args.split) + [0.0, 0.0]
    if args.eval_iters and _SPLIT.fullmatch(args.split) and weights[1] == 0:
        warnings.append(f"--eval-iters {args.eval_iters} has no effect: --split {args.split} gives the validation "
                        "set no weight, so nothing is evaluated")
    return warnings


def check_optimizer_and_schedule(args: argparse.Namespace) -> None:
    """The optimizer's and LR schedule's rules, in the flags' own units (iterations), before any work
    (after the rules above: it derives --lr-decay-iters and a fraction's warmup)."""
    problem = _optimizer_and_schedule_problem(args)
    if problem:
        raise ArgumentError(problem)


def _optimizer_and_schedule_problem(args: argparse.Namespace) -> Optional[str]:
    if args.min_lr > args.lr:
        return f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})"
    if args.loss_scale is not None and not (args.fp16 or args.bf16):
        return f"--loss-scale ({args.loss_scale}) applies to --fp16 or --bf16 training only"
    if args.fp16 and args.loss_scale is None:
        if not 0 < args.min_loss_scale <= args.initial_loss_scale:
            return (f"--min-loss-scale ({args.min_loss_scale}) must be in (0, --initial-loss-scale "
                    f"({args.initial_loss_scale})]")
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(args, name) < 1:
                return f"{flag(name)} must be >= 1 with dynamic fp16 loss scaling, got {getattr(args, name)}"
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    warmup, decay = args.lr_warmup_iters, args.lr_decay_iters
    source = (f"--lr-warmup-fraction {args.lr_warmup_fraction} x --lr-decay-iters {decay} = {warmup}"
              if args.lr_warmup_fraction is not None else f"--lr-warmup-iters ({warmup})")
    if args.lr_decay_style != "constant" and warmup >= decay:
        return (f"{source} must be < --lr-decay-iters ({decay}; default --train-iters) for "
                f"--lr-decay-style {args.lr_decay_style}: lower the warmup or raise --lr-decay-iters")
    if args.lr_decay_style == "WSD":
        wsd = args.lr_wsd_decay_iters
        if wsd is None or wsd > decay - warmup:
            return (f"--lr-decay-style WSD needs --lr-wsd-decay-iters in [1, --lr-decay-iters - warmup "
                    f"= {decay - warmup}], got {wsd}")
    return None


def environment_problems(args: argparse.Namespace) -> list[str]:
    """What this machine must offer the arguments, checked before the process group starts."""
    problems = []
    if args.distributed_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            problems.append("--distributed-backend nccl needs CUDA GPUs and torch sees none "
                            "(torch.cuda.is_available() is False): use --distributed-backend gloo, or omit the flag")
    if args.log_json:
        folder = os.path.dirname(os.path.abspath(args.log_json))
        if os.path.isdir(args.log_json):
            problems.append(f"--log-json {args.log_json} is a directory: give a file path, e.g. "
                            f"{args.log_json}/log.jsonl")
        elif not os.path.isdir(folder):
            problems.append(f"--log-json {args.log_json}: the directory {folder} does not exist")
        elif not os.access(args.log_json if os.path.exists(args.log_json) else folder, os.W_OK):
            problems.append(f"--log-json {args.log_json} is not writable")
    return problems
