"""Pretrain a GPT (GPT-2 or LLaMA family) under any TP x PP (x virtual) x DP layout.

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --num-layers-per-virtual-pipeline-stage 1 --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 32 \
        --train-iters 200 --lr 3e-3 --save ckpt

Options are Megatron-LM's (``python examples/pretrain_gpt.py --help``). Without
``--data-path`` it trains on the Python documentation that ships with Python
(``pydoc_data.topics``), tokenized to bytes; nothing is downloaded. GPUs use
nccl, CPUs gloo. ``--sample-prompt TEXT`` prints a greedy continuation from the
trained model at the end (models.generation, as tools/generate.py). The model's config, layer split,
model provider and forward step are the library's (parallel3d.training.gpt).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
if __name__ == "__main__":
    from parallel3d.bootstrap import reexec_unless_ready  # noqa: E402
    reexec_unless_ready(__file__)  # this Python lacks torch & co: run inside .venv, as the demo does

import torch.distributed as dist

from parallel3d.models import TransformerConfig  # noqa: E402
from parallel3d import fused, parallel_state  # noqa: E402
from parallel3d.training.arguments import ArgumentError, parse_args, validate_args  # noqa: E402
from parallel3d.training.argument_rules import report_bad_input  # noqa: E402
from parallel3d.training.preflight import check_fits  # noqa: E402
from parallel3d.training.checkpoint_args import apply_checkpoint_args, take_checkpoint_split  # noqa: E402
from parallel3d.training.checkpoint_integrity import CheckpointError  # noqa: E402
from parallel3d.training.gpt import (  # noqa: E402
    add_sampling_args,
    check_data_fits_vocab,
    forward_step,
    layer_partition,
    model_provider,
    transformer_config_from_args,
)
from parallel3d.training.log_sinks import check_logging_available  # noqa: E402
from parallel3d.data import (  # noqa: E402
    IndexedDatasetBuilder,
    best_fitting_dtype,
    build_tokenizer,
    build_train_valid_test_datasets,
)
from parallel3d.models.generation import generate  # noqa: E402
from parallel3d.lifetime import exit_after_run, exit_with_launcher  # noqa: E402
from parallel3d.training import initialize_distributed, is_last_rank, pretrain, print_rank_0  # noqa: E402
from parallel3d.training.training_config import TrainingConfig  # noqa: E402
from parallel3d.training.training_guards import errors_as_one_line  # noqa: E402


def print_once(message: str, file=sys.stdout) -> None:
    """Rank 0's line (torchrun sets RANK before any process group exists)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=file, flush=True)


# --------------------------------------------------------------------------------------- data


def default_data_prefix(tokenizer, tokenizer_id: str) -> str:
    """Tokenize the Python documentation topics once per node (local rank 0) into a Megatron indexed dataset."""
    cache = os.environ.get("PARALLEL3D_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "parallel3d"))
    prefix = os.path.join(cache, f"pydoc_topics_{tokenizer_id}_text_document")
    # Each node's first process builds it (PARALLEL3D_CACHE may be node-local); on a shared cache two nodes
    # write identical files through renames of per-process temporaries.
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    if local_rank == 0 and not os.path.exists(prefix + ".idx"):
        from pydoc_data.topics import topics

        os.makedirs(cache, exist_ok=True)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=best_fitting_dtype(tokenizer.vocab_size))
        # One document per paragraph: ~80 topics would leave the 1/1000 test split empty.
        paragraphs = [p.strip() for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip()]
        for text in paragraphs:
            tokens = tokenizer.tokenize(text) + [tokenizer.eod]
            builder.add_document(tokens, [len(tokens)])
        builder.finalize(prefix + ".idx")  # .bin/.idx appear by rename: never half-written
        print(f"built the default dataset {prefix} from pydoc_data.topics ({len(paragraphs)} documents)", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return prefix


# --------------------------------------------------------------------------------------- sampling


def sample_continuation(model: list, tokenizer, config: TransformerConfig, prompt: str,
                        num_tokens: int) -> tuple[str, int]:
    """(text, tokens generated): a greedy continuation through the pipeline with models.generation
    (KV cache; the code path of tools/generate.py). A learned position table bounds prompt +
    continuation: the prompt keeps its last tokens that fit and the continuation stops at the table's end."""
    ids = tokenizer.tokenize(prompt) or [tokenizer.eod]
    if config.position_embedding_type == "learned_absolute":
        ids = ids[-config.max_position_embeddings:]
        num_tokens = min(num_tokens, config.max_position_embeddings + 1 - len(ids))
    tokens, _ = generate(model, ids, num_tokens)
    return tokenizer.detokenize(tokens), num_tokens


# --------------------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    exit_with_launcher()  # a worker must not outlive a killed torchrun (parallel3d/lifetime.py)
    args = parse_args(argv, extra_args_provider=add_sampling_args)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if args.use_checkpoint_args:
            changed = apply_checkpoint_args(args)
            print_once(f"--use-checkpoint-args: from {args.load}: {', '.join(changed) or 'nothing to change'}")
        validate_args(args, world_size)
        check_logging_available(args)
        if args.sample_tokens < 0:
            raise ArgumentError(f"--sample-tokens must be >= 0, got {args.sample_tokens}")
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, vocab_file=args.vocab_file,
                                    merge_file=args.merge_file)
        args.vocab_size = args.vocab_size or tokenizer.vocab_size
        if args.vocab_size < tokenizer.vocab_size:
            raise ArgumentError(f"--vocab-size ({args.vocab_size}) is smaller than the tokenizer's "
                                f"({tokenizer.vocab_size})")
        config = transformer_config_from_args(args)  # validates heads, groups, dims against TP
        check_fits(args, config)  # absurd sizes: the planner's estimate, before init
        training_config = TrainingConfig.from_args(args)
        partition = layer_partition(args, config)
        took = take_checkpoint_split(args, partition)  # a converted checkpoint's split, not the default's
        if took:
            print_once(took)
            partition = layer_partition(args, config)
        if args.data_path:
            check_data_fits_vocab(args.data_path, args.vocab_size, f"--tokenizer-type {args.tokenizer_type}")
    except (ArgumentError, ValueError, FileNotFoundError, ImportError, CheckpointError) as e:
        # Every rank checks the same input before any collective: rank 0 says it (a rank whose own machine
        # differs, too), so the launch reports one line per problem, not one per rank.
        sys.exit(report_bad_input(e))

    # Past this point a failure is one "error: rank N: ..." line per rank (PARALLEL3D_DEBUG=1: the traceback).
    with errors_as_one_line():
        return _train(args, training_config, tokenizer, config, partition)


def _train(args: argparse.Namespace, training_config: TrainingConfig, tokenizer, config: TransformerConfig,
           partition: list[list[range]]) -> dict:
    initialize_distributed(training_config)
    if not args.data_path:
        files = [args.tokenizer_model] if args.tokenizer_model else [args.vocab_file, args.merge_file]
        tok_id = "byte" if args.tokenizer_type == "byte" else "hf" + hashlib.sha1(
            "|".join(os.path.abspath(f) for f in files).encode()).hexdigest()[:8]
        args.data_path = [default_data_prefix(tokenizer, tok_id)]
    print_rank_0(f"parallel3d: world {args.world_size} = TP {args.tensor_model_parallel_size} x PP "
                 f"{args.pipeline_model_parallel_size} (virtual {args.virtual_pipeline_model_parallel_size or 1}) x "
                 f"DP {args.data_parallel_size}; {args.num_microbatches} microbatches of {args.micro_batch_size}; "
                 f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}")
    print_rank_0(fused.describe())  # every rank loads (or the node's first builds) the kernels here

    def datasets_provider(num_samples):
        return build_train_valid_test_datasets(args.data_path, args.split, args.seq_length, args.seed, num_samples,
                                               eod_token=tokenizer.eod, eod_mask_loss=args.eod_mask_loss)

    result = pretrain(training_config, partial(model_provider, config, partition),
                      partial(forward_step, args.calculate_per_token_loss), datasets_provider,
                      model_config=config, layer_numbers=[[list(r) for r in chunks] for chunks in partition])
    if args.sample_prompt and not result["exit_signal"]:
        text, generated = sample_continuation(result["model"], tokenizer, config, args.sample_prompt,
                                              args.sample_tokens)
        if is_last_rank():
            print(f"sample (greedy, {generated} tokens):\n{text}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    exit_after_run(0)  # an error has already exited (1) through report_bad_input or the one-line handler
