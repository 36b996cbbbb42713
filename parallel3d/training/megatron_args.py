"""Megatron-LM's flags beyond the core set: each works with Megatron's meaning or is refused, naming the
nearest supported alternative. Nothing is accepted and silently ignored.

``add_megatron_args(parser)`` adds them (build_parser calls it); ``check_megatron_args(args)`` applies
aliases, derives sample-based training and refuses what parallel3d does not do (validate_args calls it,
once the data-parallel size and the microbatch count are known).
"""
from __future__ import annotations

import argparse
from typing import Optional

# Flags of Megatron-LM's scripts that parallel3d does not implement -> what to use instead.
# Parsed with nargs="*", so any value a script passes is consumed and the refusal names the flag.
REFUSED: dict[str, str] = {
    "--context-parallel-size": "context parallelism is not implemented; for long sequences use --sequence-parallel "
                               "with --tensor-model-parallel-size, and --recompute-granularity",
    "--expert-model-parallel-size": "mixture-of-experts is not implemented; train a dense model (--ffn-hidden-size)",
    "--num-experts": "mixture-of-experts is not implemented; train a dense model (--ffn-hidden-size)",
    "--moe-router-topk": "mixture-of-experts is not implemented; train a dense model (--ffn-hidden-size)",
    "--moe-grouped-gemm": "mixture-of-experts is not implemented; train a dense model (--ffn-hidden-size)",
    "--overlap-param-gather": "the distributed optimizer all-gathers parameters right after its step; "
                              "--overlap-grad-reduce overlaps the gradient reduction with backward",
    "--use-torch-fsdp2": "FSDP is not implemented; --use-distributed-optimizer shards the optimizer state (ZeRO-1)",
    "--tp-comm-overlap": "Transformer Engine's userbuffers overlap is not here; parallel3d overlaps by default: "
                         "the sequence-parallel all-gathers run in NCCL symmetric windows on the copy engines "
                         "beside the GEMMs (--no-tp-symmetric-gathers turns that off), and --enable-cuda-graph "
                         "replays the layers (BENCHMARKS.md, issue 26). Omit the flag",
    "--ckpt-format": "parallel3d has one checkpoint format (a safetensors file per TP/PP rank, Megatron's directory "
                     "names); omit the flag. tools/convert_checkpoint.py converts to and from Hugging Face",
    "--use-dist-ckpt": "parallel3d has one checkpoint format; omit the flag (see --ckpt-format)",
    "--async-save": "saves are synchronous and atomic (a killed save leaves the previous one); omit the flag",
    "--mock-data": "omit --data-path instead: parallel3d then trains on the Python documentation (pydoc_data), "
                   "nothing downloaded",
    "--data-cache-path": "dataset indices are built in memory at start-up, nothing is cached; omit the flag",
    "--use-legacy-models": "parallel3d's GPT follows Megatron-Core's model (--use-mcore-models); omit the flag",
    "--apply-query-key-layer-scaling": "not implemented (an fp16 overflow workaround); use --bf16",
    "--log-params-norm": "not logged; --log-interval logs loss, grad norm, lr, throughput, MFU and memory",
    "--log-num-zeros-in-grad": "not logged; --log-interval logs loss, grad norm, lr, throughput, MFU and memory",
    "--log-timers-to-tensorboard": "timers are not logged; --tensorboard-dir gets iteration time and throughput",
    "--timing-log-level": "timers are not logged; each interval logs the iteration time",
    "--tensorboard-log-interval": "TensorBoard is written every --log-interval",
    "--cuda-graph-retain-backward-graph": "the layers' graphs are captured without retaining the backward graph "
                                          "(every layer here is graph-safe); omit the flag",
    "--cuda-graph-use-single-mempool": "it applies to --cuda-graph-impl full_iteration, which is not implemented; "
                                       "omit the flag",
}
# Megatron flags whose meaning is what parallel3d always does: accepted, and their help says why.
ALREADY_SO: dict[str, str] = {
    "--use-mcore-models": "parallel3d's GPT is built like Megatron-Core's; the only model there is",
    "--log-throughput": "tokens/s and TFLOP/s per GPU are logged every --log-interval",
    "--log-validation-ppl-to-tensorboard": "validation perplexity goes to --tensorboard-dir with the loss",
    "--log-memory-to-tensorboard": "peak memory goes to --tensorboard-dir every --log-interval",
    # same dest as --no-check-for-nan-in-loss-and-grad, registered earlier: its default (True) stands
    "--check-for-nan-in-loss-and-grad": "on by default; --no-check-for-nan-in-loss-and-grad turns it off",
}
# --tokenizer-type values of Megatron that have no reader here.
REFUSED_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                      "NullTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase")
# Megatron's --attention-backend values -> the implementation here. torch's SDPA picks flash / cuDNN /
# memory-efficient kernels itself ("auto", "flash", "fused"); "unfused" is the explicit-softmax path.
ATTENTION_BACKENDS = {"auto": "sdpa", "flash": "sdpa", "fused": "sdpa", "sdpa": "sdpa", "unfused": "local",
                      "local": "local"}


class MegatronFlagError(ValueError):
    pass


# Megatron's --cuda-graph-impl values; "local" (Megatron-Core's own) and "transformer_engine" (TE's
# make_graphed_callables) both capture each layer's forward and backward, which is what parallel3d does.
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")


def add_megatron_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM: checkpoints and resume")
    g.add_argument("--finetune", action="store_true",
                   help="load the model weights only (no optimizer, LR schedule or RNG state) and start at iteration "
                        "0 with fresh data positions")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model shape and TP/PP layout from the --load checkpoint instead of restating them")
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, use this run's LR schedule flags, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler",
                   action="store_true", help="on resume, keep the checkpoint's LR schedule and ignore this run's flags")
    g.add_argument("--no-save-optim", action="store_true",
                   help="save the model without optimizer and LR scheduler state (resume then needs --no-load-optim)")
    g.add_argument("--no-save-rng", action="store_true", help="save no RNG state (resume then needs --no-load-rng)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop if --load holds no checkpoint, instead of starting from scratch")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit once training has run this many minutes")
    g = p.add_argument_group("Megatron-LM: sample-based training")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on this many samples (instead of --train-iters; needed by --rampup-batch-size)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="LR decay length in samples "
                   "(sample-based training; default --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="LR warmup length in samples (sample-based)")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="WSD annealing length in samples (sample-based)")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES samples (with --train-samples)")
    g = p.add_argument_group("Megatron-LM: aliases, tokenizer files, wandb")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json (with --merge-file: GPT2BPETokenizer)")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt (with --vocab-file)")
    g.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="= --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="no learned position table: valid with rotary embeddings only")
    g.add_argument("--use-flash-attn", action="store_true", help="= --attention-backend flash (torch SDPA)")
    g.add_argument("--openai-gelu", action="store_true", help="GeLU's tanh approximation (HF GPT-2's gelu_new)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local: parallel3d's layers and fused kernels (transformer_engine is refused)")
    g.add_argument("--wandb-project", default=None, help="log to this Weights & Biases project (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run's name")
    g.add_argument("--wandb-save-dir", default=None, help="wandb's local directory (default: wandb's own)")
    g = p.add_argument_group("Megatron-LM: CUDA graphs (--enable-cuda-graph, in the model flags, is the short form)")
    g.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default=None,
                   help="local / transformer_engine: each transformer layer captured after --cuda-graph-warmup-steps "
                        "steps and replayed, as --enable-cuda-graph; none: eager layers; full_iteration is refused. "
                        "Unset: graphs in TP > 1 runs on GPUs that a graph can hold (Megatron's default is none)")
    g.add_argument("--external-cuda-graph", action="store_true",
                   help="= --cuda-graph-impl transformer_engine (Megatron's deprecated form)")
    g.add_argument("--cuda-graph-modules", nargs="*", default=None, help="what each layer's graph holds: the "
                   "whole layer (none given, or 'full'); attn / mlp / moe ... are refused")
    g.add_argument("--cuda-graph-scope", nargs="*", default=None, help="Megatron's deprecated --cuda-graph-modules")
    g.add_argument("--inference-cuda-graph-scope", choices=("none", "layer", "block"), default=None,
                   help="none: generation runs eagerly (layer and block are refused)")
    g = p.add_argument_group("Megatron-LM flags that are true here already")
    for flag, why in ALREADY_SO.items():
        g.add_argument(flag, action="store_true", help=f"accepted: {why}")
    g = p.add_argument_group("Megatron-LM flags parallel3d refuses (each names its alternative)")
    for flag, alternative in REFUSED.items():
        g.add_argument(flag, nargs="*", default=None, help=f"refused: {alternative}")


def _refuse(flag: str, why: str) -> None:
    raise MegatronFlagError(f"{flag} is not supported by parallel3d: {why}")


def check_refusals(args: argparse.Namespace) -> None:
    for flag, alternative in REFUSED.items():
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            _refuse(flag, alternative)
    if args.transformer_impl == "transformer_engine":
        _refuse("--transformer-impl transformer_engine", "parallel3d's own fused kernels (csrc/) take Transformer "
                "Engine's place; use --transformer-impl local or omit the flag")
    if args.tokenizer_type in REFUSED_TOKENIZERS:
        _refuse(f"--tokenizer-type {args.tokenizer_type}", "use --tokenizer-type HuggingFaceTokenizer with the "
                "model's tokenizer.json, GPT2BPETokenizer with --vocab-file/--merge-file, or byte")


def resolve_cuda_graph_flags(args: argparse.Namespace) -> None:
    """Megatron's CUDA-graph flags -> ``args.enable_cuda_graph`` (per-layer graphs), with Megatron's own
    refusals of contradictory combinations and ours of the scopes not implemented. Called once, by validate_args."""
    impl = args.cuda_graph_impl
    if args.enable_cuda_graph and args.external_cuda_graph:
        raise MegatronFlagError("--enable-cuda-graph and --external-cuda-graph cannot be given together (Megatron "
                                "refuses it too): give one")
    if (args.enable_cuda_graph or args.external_cuda_graph) and impl is not None:
        raise MegatronFlagError(f"--cuda-graph-impl {impl} with --enable-cuda-graph or --external-cuda-graph: give "
                                "one of them (Megatron refuses both together)")
    if impl == "full_iteration":
        _refuse("--cuda-graph-impl full_iteration", "a whole iteration in one graph is not implemented; "
                "--cuda-graph-impl local captures each transformer layer")
    if args.cuda_graph_modules is not None and args.cuda_graph_scope is not None:
        raise MegatronFlagError("--cuda-graph-scope is Megatron's old name of --cuda-graph-modules: give one")
    modules = args.cuda_graph_modules if args.cuda_graph_modules is not None else args.cuda_graph_scope
    partial = [m for m in modules or [] if m != "full"]
    if partial:
        _refuse(f"--cuda-graph-modules {' '.join(partial)}", "each graph here holds a whole transformer layer "
                "(Megatron's default: omit the flag, or give 'full')")
    if args.inference_cuda_graph_scope not in (None, "none"):
        _refuse(f"--inference-cuda-graph-scope {args.inference_cuda_graph_scope}", "generation runs eagerly; omit "
                "the flag")
    # unset (None) leaves the choice to validate_args' default: graphs where TP > 1 on GPUs can hold them
    args.enable_cuda_graph = args.enable_cuda_graph or args.external_cuda_graph or impl not in (None, "none")


def _apply_aliases(args: argparse.Namespace) -> None:
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.no_position_embedding and args.position_embedding_type != "rope":
        _refuse("--no-position-embedding without rotary embeddings", "a model needs positions: add "
                "--position-embedding-type rope (or --use-rotary-position-embeddings)")
    if args.use_flash_attn:
        args.attention_backend = "flash"
    args.attention_backend = ATTENTION_BACKENDS[args.attention_backend]
    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file or args.merge_file else "byte"
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise MegatronFlagError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file "
                                "(merges.txt)")
    if (args.vocab_file or args.merge_file) and args.tokenizer_type != "GPT2BPETokenizer":
        raise MegatronFlagError(f"--vocab-file/--merge-file are GPT2BPETokenizer's files, but --tokenizer-type is "
                                f"{args.tokenizer_type}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise MegatronFlagError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
                                "exclusive: take the LR schedule from this run's flags or from the checkpoint")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise MegatronFlagError(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    if args.wandb_exp_name and not args.wandb_project:
        raise MegatronFlagError("--wandb-exp-name needs --wandb-project")


def _rampup_sizes(args: argparse.Namespace) -> list[int]:
    """Every global batch size the rampup passes through, checked as Megatron does."""
    start, incr, samples = args.rampup_batch_size
    per_step = args.micro_batch_size * args.data_parallel_size
    diff = args.global_batch_size - start
    if start < 1 or incr < 1 or samples < 0 or diff < 0 or diff % incr:
        raise MegatronFlagError(f"--rampup-batch-size {start} {incr} {samples}: need START >= 1, INCREMENT >= 1 and "
                                f"--global-batch-size ({args.global_batch_size}) - START a multiple of INCREMENT")
    sizes = list(range(start, args.global_batch_size + 1, incr))
    bad = [s for s in sizes if s % per_step]
    if bad:
        raise MegatronFlagError(f"--rampup-batch-size passes through global batch {bad[0]}, not divisible by "
                                f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                                f"({args.data_parallel_size}) = {per_step}")
    return sizes


def current_global_batch_size(args: argparse.Namespace, consumed_samples: int) -> int:
    """Megatron's RampupBatchsizeNumMicroBatches: the global batch after ``consumed_samples`` samples."""
    if args.rampup_batch_size is None:
        return args.target_global_batch_size
    start, incr, samples = args.rampup_batch_size
    if consumed_samples > samples:
        return args.target_global_batch_size
    increments = (args.target_global_batch_size - start) // incr
    if increments == 0:
        return start
    return start + int(consumed_samples / (samples / increments)) * incr


def update_num_microbatches(args: argparse.Namespace, consumed_samples: int) -> None:
    """Set this iteration's global batch and microbatch count (a no-op without --rampup-batch-size)."""
    if args.rampup_batch_size is None:
        return
    args.global_batch_size = current_global_batch_size(args, consumed_samples)
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def samples_consumed(args: argparse.Namespace, iterations: int) -> int:
    """The samples the first ``iterations`` iterations consume: the rampup's growing batches, then full ones."""
    if args.rampup_batch_size is None:
        return iterations * args.target_global_batch_size
    consumed, done = 0, 0
    while done < iterations and consumed <= args.rampup_batch_size[2]:
        consumed += current_global_batch_size(args, consumed)
        done += 1
    return consumed + (iterations - done) * args.target_global_batch_size


def _iterations_for_samples(args: argparse.Namespace) -> int:
    """Megatron's update_train_iters: the rampup's iterations, then full batches; a partial last batch is dropped."""
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    iterations, consumed = 0, 0
    while consumed <= args.rampup_batch_size[2] and consumed <= args.train_samples:
        consumed += current_global_batch_size(args, consumed)
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def _derive_sample_based(args: argparse.Namespace) -> None:
    """--train-samples: iterations from samples; the LR schedule stays in samples (scheduler_steps)."""
    args.target_global_batch_size = args.global_batch_size
    if args.train_samples is None:
        sample_flags = [f for f, v in (("--lr-decay-samples", args.lr_decay_samples),
                                       ("--lr-warmup-samples", args.lr_warmup_samples or None),
                                       ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples),
                                       ("--rampup-batch-size", args.rampup_batch_size)) if v is not None]
        if sample_flags:
            raise MegatronFlagError(f"{', '.join(sample_flags)} belong to sample-based training: give --train-samples "
                                    "(Megatron refuses them with --train-iters too)")
        if args.train_iters is None:
            args.train_iters = 100
        return
    if args.train_iters is not None:
        raise MegatronFlagError("give --train-iters or --train-samples, not both")
    iteration_flags = [f for f, v in (("--lr-decay-iters", args.lr_decay_iters),
                                      ("--lr-warmup-iters", args.lr_warmup_iters or None),
                                      ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters)) if v is not None]
    if iteration_flags:
        raise MegatronFlagError(f"{', '.join(iteration_flags)} belong to iteration-based training; with "
                                "--train-samples use --lr-decay-samples / --lr-warmup-samples / --lr-wsd-decay-samples")
    if args.rampup_batch_size is not None:
        sizes = _rampup_sizes(args)
        per_step = args.micro_batch_size * args.data_parallel_size
        if args.virtual_pipeline_model_parallel_size and sizes[0] // per_step < args.pipeline_model_parallel_size:
            raise MegatronFlagError(f"--rampup-batch-size starts at {sizes[0]} samples = {sizes[0] // per_step} "
                                    f"microbatches, fewer than the {args.pipeline_model_parallel_size} pipeline stages "
                                    "interleaving needs")
    args.train_iters = _iterations_for_samples(args)
    if args.train_iters < 1:
        raise MegatronFlagError(f"--train-samples ({args.train_samples}) is less than one global batch "
                                f"({args.global_batch_size})")
    decay = args.lr_decay_samples or args.train_samples
    warmup = int(args.lr_warmup_fraction * decay) if args.lr_warmup_fraction is not None else args.lr_warmup_samples
    if args.lr_decay_style != "constant" and warmup >= decay:
        raise MegatronFlagError(f"LR warmup ({warmup} samples) must be shorter than --lr-decay-samples ({decay}; "
                                "default --train-samples)")
    update_num_microbatches(args, 0)


def scheduler_steps(args: argparse.Namespace) -> dict[str, Optional[int]]:
    """The LR schedule's lengths in samples (the unit of OptimizerParamScheduler, as in Megatron)."""
    gbs = args.target_global_batch_size
    if args.train_samples is not None:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples
        return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": args.train_samples,
                "wsd_decay_steps": args.lr_wsd_decay_samples}
    # Megatron: a --lr-warmup-fraction of the decay samples, not of whole iterations (no rounding)
    warmup = (args.lr_warmup_fraction * args.lr_decay_iters * gbs if args.lr_warmup_fraction is not None
              else args.lr_warmup_iters * gbs)
    return {"lr_warmup_steps": warmup, "lr_decay_steps": args.lr_decay_iters * gbs,
            "wd_incr_steps": args.train_iters * gbs,
            "wsd_decay_steps": (args.lr_wsd_decay_iters or 0) * gbs or None}


def check_megatron_args(args: argparse.Namespace) -> None:
    """Refusals, aliases and sample-based training; needs data_parallel_size and global_batch_size."""
    check_refusals(args)
    _apply_aliases(args)
    _derive_sample_based(args)
