"""Command-line arguments with Megatron-LM's names, checked before any work starts.

``parse_args()`` returns an argparse Namespace whose option names are
Megatron-LM's (``--tensor-model-parallel-size``, ``--micro-batch-size``, ...), so
launch scripts move over unchanged. ``validate_args(args, world_size)`` derives
the data-parallel size and the number of microbatches and rejects layouts that
cannot exist, with the numbers in the message. Every rank runs the same checks
on the same input; ``argument_rules.report_bad_input`` prints them once, from rank 0.
"""
from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, Optional, Sequence

from parallel3d.training.argument_rules import (  # noqa: F401 - ArgumentError is this module's API too
    ArgumentError,
    environment_problems,
    flag,
    ineffective_flags,
    notice as _notice,
    check_optimizer_and_schedule,
    raise_problems,
    range_problems,
    refused_combinations,
    report_bad_input,
)
from parallel3d.training.arguments_help import add_help
from parallel3d.training.fp8_args import add_fp8_args, fp8_ineffective, fp8_problems
from parallel3d.training.megatron_args import (
    ATTENTION_BACKENDS,
    REFUSED_TOKENIZERS,
    MegatronFlagError,
    add_megatron_args,
    check_megatron_args,
    check_refusals,
    resolve_cuda_graph_flags,
)
from parallel3d.device import default_backend
from parallel3d.models.config import cuda_graph_blockers, megatron_ffn_hidden_size
from parallel3d.parallel_state import check_virtual_pipeline_size, data_parallel_size, model_parallel_sizes
from parallel3d.pipeline.forward_backward import default_schedule_name, schedule_group_size
from parallel3d.pipeline.registry import SCHEDULE_NAMES, V_SHAPED, check_schedule_args, splits_backward


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
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default="auto")
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
    g.add_argument("--compile", action="store_true", help="torch.compile each transformer layer "
                   "(the tensor-parallel linears stay eager); off by default: BENCHMARKS.md has the measurements")
    g.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend with --compile (torchtitan's compile.backend)")
    g.add_argument("--enable-cuda-graph", action="store_true", help="capture each transformer layer's forward "
                   "and backward as CUDA graphs and replay them (Megatron's; CUDA, bf16/fp32; not with "
                   "dropout, recompute, FP8, --compile or a zero-bubble --pipeline-schedule). The default where "
                   "TP > 1 on GPUs and nothing of these applies; --cuda-graph-impl none turns it off")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="eager training steps before the capture (Megatron's)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", "--microbatch-group-size-per-vp-stage",
                   dest="microbatch_group_size_per_vp_stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    # Megatron's layout flags (parallel3d.pipeline.layout); --pipeline-split is ours.
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="Megatron's layout string, e.g. 'Et|(tt|)*6L' (E embedding, t layer, L loss, | stage)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer of the first stage when splitting layers (Megatron's)")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as a layer of the last stage when splitting (Megatron's)")
    g.add_argument("--pipeline-split", choices=["balanced", "even"], default="balanced",
                   help="without a layout: balance the stages by FLOPs, counting the output layer and loss "
                        "(default), or give every stage the same number of layers (Megatron's default)")
    # Megatron picks its schedule from the layout and has no zero-bubble one: this flag is ours.
    g.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, default=None,
                   help="pipeline schedule (default: 1f1b, interleaved-1f1b with virtual stages); zb-v and "
                        "dualpipev hold two chunks per rank in a V (virtual size 2 implied)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-tp-symmetric-gathers", dest="tp_symmetric_gathers", action="store_false",
                   help="the sequence-parallel all-gathers and reduce-scatters in NCCL's own buffers, not "
                        "symmetric windows "
                        "(which, with NCCL >= 2.28 and the layers replayed as CUDA graphs, run on the copy "
                        "engines beside the GEMMs; eager layers always use NCCL's own buffers)")
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
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long a rank waits in a collective or pipeline transfer before it reports the rank "
                        "it waited for and exits (torch's default is 30 min; fractions allowed)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    g.add_argument("--train-iters", type=int, default=None, help="iterations to train (default 100 unless "
                   "--train-samples is given)")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear")  # Megatron's default
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
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="keep training through a non-finite loss or gradient norm")
    g.add_argument("--skip-nonfinite-iters", type=int, default=0,
                   help="parallel3d's own (Megatron has none): skip the update of up to N iterations whose loss or "
                        "gradient norm is not finite, then stop; 0 stops at the first")
    g.add_argument("--max-consecutive-skipped-iters", type=int, default=100,
                   help="parallel3d's own: stop after N iterations in a row skipped by the fp16 loss scaler or the "
                        "non-finite check (0: never)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save a checkpoint and exit 0 (all ranks agree)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX, or a weighted blend: 0.3 PREFIX_A 0.7 PREFIX_B")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", choices=["byte", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                                                *REFUSED_TOKENIZERS], default=None,
                   help="default: GPT2BPETokenizer with --vocab-file/--merge-file, else byte")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--dataloader-type", choices=["single", "cyclic"], default="single")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-json", default=None, help="append one JSON object per logged iteration")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default from the card)")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-progress-bar", action="store_true")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """One line, once per launch (argparse's would print the whole usage, on every rank)."""
        self.exit(report_bad_input(ArgumentError(f"{message} (--help lists the options)")))


def build_parser(extra_args_provider: Optional[Callable[[argparse.ArgumentParser], None]] = None
                 ) -> argparse.ArgumentParser:
    p = _Parser(description="parallel3d training (Megatron-LM argument names)", allow_abbrev=False)
    _add_model_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_logging_and_checkpoint_args(p)
    add_megatron_args(p)
    add_fp8_args(p)
    if extra_args_provider is not None:
        extra_args_provider(p)
    add_help(p)
    return p


@functools.lru_cache(maxsize=1)
def _parser_defaults() -> dict:
    """Every core option's default, to tell the flags a command line gave (ineffective_flags)."""
    return vars(build_parser().parse_args([]))


def parse_args(argv: Optional[Sequence[str]] = None, defaults: Optional[dict] = None,
               extra_args_provider: Optional[Callable[[argparse.ArgumentParser], None]] = None
               ) -> argparse.Namespace:
    parser = build_parser(extra_args_provider)
    if defaults:
        parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def _check_pipeline_schedule(name: Optional[str], pp: int, vp: Optional[int]) -> Optional[int]:
    """The virtual pipeline size the schedule needs (2 for a V); an error where they disagree."""
    if name is None:
        return vp
    if (pp == 1) != (name == "no-pipelining"):
        raise ArgumentError(f"--pipeline-schedule {name} does not fit --pipeline-model-parallel-size {pp}")
    if name in V_SHAPED:
        if vp not in (None, 2):
            raise ArgumentError(f"--pipeline-schedule {name} holds two chunks per rank in a V: "
                                f"--virtual-pipeline-model-parallel-size must be 2 (or unset), got {vp}")
        return 2
    if name == "auto" and vp not in (None, 2):
        raise ArgumentError(f"--pipeline-schedule auto runs one chunk per rank, or two in a V: "
                            f"--virtual-pipeline-model-parallel-size must be 2 or unset, got {vp}")
    if name == "interleaved-1f1b" and vp is None:
        raise ArgumentError("--pipeline-schedule interleaved-1f1b needs --virtual-pipeline-model-parallel-size > 1")
    if name not in ("interleaved-1f1b", "auto") and vp is not None:
        raise ArgumentError(f"--pipeline-schedule {name} runs one chunk per rank; drop the virtual pipeline size {vp}")
    return vp


def _layout_rule(rule: Callable[..., Any], *sizes: Any) -> Any:
    """parallel_state's layout rule, its message naming the flags (one rule for the API and the CLI)."""
    try:
        return rule(*sizes, flag=flag)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def _cuda_graph_rules(args: argparse.Namespace) -> None:
    """Per-layer CUDA graphs: refused where a graph cannot hold the run; where no flag decides
    (--cuda-graph-impl unset), on in every TP > 1 or FP8 run on GPUs that a graph can hold. There the eager
    step is bound by the host's launches and the graphs measured faster (every TP layout: BENCHMARKS.md, issue
    26; FP8, each recipe: issue 28's eleventh lease); bf16 on one GPU gained nothing. --cuda-graph-impl none
    keeps the layers eager."""
    zero_bubble = splits_backward(args.pipeline_schedule, args.pipeline_model_parallel_size)
    if args.enable_cuda_graph:
        if zero_bubble:
            raise ArgumentError(f"--enable-cuda-graph with --pipeline-schedule {args.pipeline_schedule}: its W split "
                                "runs each weight gradient outside its layer's backward, which a graph holds whole; "
                                "use 1F1B or interleaved 1F1B (omit --pipeline-schedule), or drop the graphs")
        import torch

        if not torch.cuda.is_available():
            raise ArgumentError("--enable-cuda-graph (or --cuda-graph-impl) needs a CUDA device (no GPU is visible): "
                                "omit the flag")
        return
    if args.cuda_graph_impl is not None:  # --cuda-graph-impl none
        return
    blockers = cuda_graph_blockers(args.hidden_dropout, args.attention_dropout, args.recompute_granularity,
                                   args.compile)
    on_gpus = (args.distributed_backend or default_backend()) == "nccl"
    host_bound = args.tensor_model_parallel_size > 1 or args.fp8 is not None
    args.enable_cuda_graph = host_bound and on_gpus and not zero_bubble and not blockers


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive DP size, virtual size and microbatch count; refuse impossible settings.

    A refusal is one ArgumentError whose ``problems`` each name a flag, its value and what it must be
    (every problem of the independent value rules at once; the dependent ones after, one by one). The rules of
    the process layout and the batch live here (the layout's shared with parallel_state); how the
    model splits over it (layers over the pipeline stages, heads / groups / FFN / sequence over TP)
    is the model config's rule (models/config.py), checked when the application builds it from
    these arguments, before any work.
    """
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    args.world_size = world_size
    # Every problem of these independent rules at once; the rules after them do arithmetic on the values.
    problems = range_problems(args) + refused_combinations(args) + environment_problems(args)
    try:
        args.data_parallel_size = _layout_rule(data_parallel_size, world_size, model_parallel_sizes(args))
    except ArgumentError as e:
        problems[:0] = e.problems
    try:
        check_refusals(args)
        resolve_cuda_graph_flags(args)
    except MegatronFlagError as e:
        problems.append(str(e))
    problems += fp8_problems(args)
    raise_problems(problems)
    for warning in ineffective_flags(args, _parser_defaults()) + fp8_ineffective(args, _parser_defaults()):
        _notice(warning, "warning")

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
    if vp == 1:
        args.virtual_pipeline_model_parallel_size = vp = None
    _layout_rule(check_virtual_pipeline_size, pp, vp)
    vp = args.virtual_pipeline_model_parallel_size = _check_pipeline_schedule(args.pipeline_schedule, pp, vp)

    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        raise ArgumentError(f"--global-batch-size ({args.global_batch_size}) is not divisible by "
                            f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                            f"({args.data_parallel_size}) = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    # The schedule's own rules (microbatches per stage, chunks per rank) are the schedule's: checked here,
    # before any work, and told in the flags that set the microbatch count.
    name = args.pipeline_schedule or default_schedule_name(pp, vp)
    # 'auto' over two chunks chooses among the V-shaped schedules (placement_of): ZB-V's rules apply.
    checked = "zb-v" if name == "auto" and vp is not None else name
    try:
        check_schedule_args(checked, pp, args.num_microbatches, vp or 1,
                            schedule_group_size(checked, args.microbatch_group_size_per_vp_stage))
    except ValueError as e:
        raise ArgumentError(f"--pipeline-schedule {name}: {e} (microbatches per step = --global-batch-size "
                            f"{args.global_batch_size} / (--micro-batch-size {args.micro_batch_size} x "
                            f"data-parallel size {args.data_parallel_size}): change --global-batch-size in "
                            f"multiples of {per_step})") from None
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # nothing to split: Megatron also turns it off, with a warning
        _notice("--sequence-parallel has no effect with --tensor-model-parallel-size 1: turned off")
    if args.compile:
        import torch._dynamo  # only here: argument parsing stays light without --compile

        if args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ArgumentError(f"--compile-backend {args.compile_backend!r} is not a torch.compile backend; use "
                                f"one of {', '.join(torch._dynamo.list_backends())} (default inductor)")
    _cuda_graph_rules(args)
    if not args.group_query_attention:
        args.num_query_groups = None
    if args.ffn_hidden_size is None:  # Megatron's default width, --swiglu's too (not the library's LLaMA rule)
        args.ffn_hidden_size = megatron_ffn_hidden_size(args.hidden_size, args.swiglu)
        if args.ffn_hidden_size == 0:
            raise ArgumentError(f"--swiglu with --hidden-size {args.hidden_size}: Megatron's default "
                                "--ffn-hidden-size (2/3 of 4 x hidden size, rounded down to a multiple of 64) is 0; "
                                "give --ffn-hidden-size")
    try:
        check_megatron_args(args)
    except MegatronFlagError as e:
        raise ArgumentError(str(e)) from None
    check_optimizer_and_schedule(args)
    if args.save_interval is None and args.save is not None:
        args.save_interval = args.train_iters
    return args
