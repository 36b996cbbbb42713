"""Command-line arguments with Megatron-LM's names, checked before any work starts.

``parse_args()`` returns an argparse Namespace whose option names are
Megatron-LM's (``--tensor-model-parallel-size``, ``--micro-batch-size``, ...), so
launch scripts move over unchanged. ``validate_args(args, world_size)`` derives
the data-parallel size and the number of microbatches and rejects layouts that
cannot exist, with the numbers in the message. Every rank runs the same checks
on the same input, so every rank exits with the same message.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4h (LLaMA's rule with --swiglu)")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--attention-backend", choices=["sdpa", "local"], default="sdpa")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false", help="the fused wgrad GEMM into main_grad (CUDA kernels only)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--microbatch-group-size-per-vp-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's all-reduce while backward runs")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="elements per gradient bucket (40M default)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with GPUs, gloo without")
    g.add_argument("--no-deallocate-pipeline-outputs", dest="deallocate_pipeline_outputs", action="store_false",
                   help="keep the data of activations sent to the next stage (GPT stage outputs are residual "
                        "adds, so freeing them is safe and the default)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine"],
                   default="exponential")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="fixed fp16 loss scale; default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--seed", type=int, default=1234)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX, or a weighted blend: 0.3 PREFIX_A 0.7 PREFIX_B")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", choices=["byte", "HuggingFaceTokenizer"], default="byte")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--dataloader-type", choices=["single", "cyclic"], default="single")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--log-json", default=None, help="append one JSON object per logged iteration")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default from the card)")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-progress-bar", action="store_true")


def build_parser(extra_args_provider: Optional[Callable[[argparse.ArgumentParser], None]] = None
                 ) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="parallel3d training (Megatron-LM argument names)",
                                allow_abbrev=False)
    _add_model_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_logging_and_checkpoint_args(p)
    if extra_args_provider is not None:
        extra_args_provider(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None, defaults: Optional[dict] = None,
               extra_args_provider: Optional[Callable[[argparse.ArgumentParser], None]] = None
               ) -> argparse.Namespace:
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    return parser.parse_args(argv)


class ArgumentError(ValueError):
    pass


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive DP size, virtual size and microbatch count; refuse impossible settings."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ArgumentError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) "
                            "must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ArgumentError(f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
                            f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)

    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.virtual_pipeline_model_parallel_size is not None:
            raise ArgumentError("give --num-layers-per-virtual-pipeline-stage or "
                                "--virtual-pipeline-model-parallel-size, not both")
        per_stage = args.num_layers // pp if args.num_layers % pp == 0 else None
        if per_stage is None or per_stage % args.num_layers_per_virtual_pipeline_stage != 0:
            raise ArgumentError(
                f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) must be a multiple "
                f"of --num-layers-per-virtual-pipeline-stage ({args.num_layers_per_virtual_pipeline_stage})")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    vp = args.virtual_pipeline_model_parallel_size
    if vp is not None and vp <= 1:
        args.virtual_pipeline_model_parallel_size = vp = None
    if vp is not None and pp == 1:
        raise ArgumentError(f"virtual pipeline stages ({vp}) need --pipeline-model-parallel-size > 1")
    stages = pp * (vp or 1)
    explicit = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    if not explicit and args.num_layers % stages != 0:
        raise ArgumentError(f"--num-layers ({args.num_layers}) is not divisible by the number of (virtual) "
                            f"pipeline stages ({pp} x {vp or 1} = {stages})")

    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        raise ArgumentError(f"--global-batch-size ({args.global_batch_size}) is not divisible by "
                            f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                            f"({args.data_parallel_size}) = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    if vp is not None and args.num_microbatches < pp:
        raise ArgumentError(f"interleaved pipelining needs at least --pipeline-model-parallel-size ({pp}) "
                            f"microbatches per step, got {args.num_microbatches} (= global batch "
                            f"{args.global_batch_size} / (micro batch {args.micro_batch_size} x DP "
                            f"{args.data_parallel_size})); raise --global-batch-size to a multiple of {per_step} "
                            f">= {per_step * pp}")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # nothing to split: Megatron also turns it off
    if args.sequence_parallel and args.seq_length % tp != 0:
        raise ArgumentError(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                            f"--tensor-model-parallel-size ({tp})")
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are exclusive")
    if args.group_query_attention and args.num_query_groups is None:
        raise ArgumentError("--group-query-attention needs --num-query-groups")
    if not args.group_query_attention:
        args.num_query_groups = None
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.save_interval is None and args.save is not None:
        args.save_interval = args.train_iters
    if args.recompute_granularity == "full" and args.recompute_method is None:
        args.recompute_method = "uniform"
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    for name in ("micro_batch_size", "train_iters", "log_interval", "eval_interval", "seq_length"):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args
