#!/usr/bin/env python3
"""Generate text from, or score tokens with, a parallel3d checkpoint under its own layout.

    torchrun --nproc-per-node TP*PP tools/generate.py --load ckpt --prompt-ids 1,2,3 \\
        --max-new-tokens 16 --greedy --output-json out.json
    torchrun --nproc-per-node TP*PP tools/generate.py --load ckpt --prompt "Once upon" \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json \\
        --max-new-tokens 32 --temperature 0.8 --top-p 0.9 --seed 7 --output-json out.json
    ... --prompt-ids 5,6,7,8 --score-only --output-json scores.json

The TP / PP / virtual PP layout is read from the checkpoint; the world size must be
TP x PP (generation runs one model replica, DP = 1), or 1: a single process (no torchrun)
loads a checkpoint of any layout, resharded to TP = PP = 1 in a temporary directory by
tools/convert_checkpoint.py's code. Sequence parallelism is off here (the model is built for
inference). The result is ``{"tokens": prompt + generated ids, "logprobs": log p(token i+1 |
tokens up to i)}`` (fp32, full real vocabulary) and, with a tokenizer, ``"text"``: written to
--output-json, else printed as one JSON line. Without --tokenizer-type the tokenizer the
checkpoint was trained with (its recorded arguments) is used, where its files are still there.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from parallel3d.bootstrap import reexec_unless_ready  # noqa: E402
    reexec_unless_ready(__file__)  # this Python lacks torch & co: run inside .venv, as the demo does

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel3d.models import GPTModel, TransformerConfig  # noqa: E402
from parallel3d import parallel_state  # noqa: E402
from parallel3d.device import default_backend, default_device  # noqa: E402
from parallel3d.training.checkpointing import (  # noqa: E402
    CheckpointError,
    check_compatible,
    load_model_shards,
    load_model_state,
    open_checkpoint,
)
from parallel3d.data import build_tokenizer  # noqa: E402
from parallel3d.lifetime import exit_after_run, exit_with_launcher  # noqa: E402
from parallel3d.data.tokenizer import TOKENIZER_TYPES  # noqa: E402
from parallel3d.models.generation import check_generation_args, generate  # noqa: E402
from parallel3d.pipeline.partition import partition_layers  # noqa: E402
from parallel3d.training.checkpoint_layers import saved_split, stage_order  # noqa: E402
from parallel3d.training.training_guards import errors_as_one_line  # noqa: E402
from parallel3d.tools.checkpoint.parallel3d_format import config_from_metadata  # noqa: E402
from parallel3d.tools.checkpoint.schema import ConversionError  # noqa: E402
from parallel3d.tools.convert_checkpoint import convert  # noqa: E402


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (its latest iteration is used)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", default=None, help="comma-separated token ids")
    prompt.add_argument("--prompt", default=None, help="text, tokenized with --tokenizer-type/--tokenizer-model")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    p.add_argument("--tokenizer-model", default=None, help="tokenizer.json (or its directory) for HuggingFaceTokenizer")
    p.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json for GPT2BPETokenizer")
    p.add_argument("--merge-file", default=None, help="GPT-2's merges.txt for GPT2BPETokenizer")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default without sampling options)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (0 = off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--score-only", action="store_true", help="generate nothing: log-probabilities of the prompt")
    p.add_argument("--output-json", default=None, help="write the result here (default: print it as one JSON line)")
    return p.parse_args(argv)


def read_checkpoint(load_dir: str) -> tuple[str, dict[str, Any], TransformerConfig]:
    """(checkpoint directory, metadata, model config) of the latest iteration under ``load_dir``."""
    _, ckpt_dir, meta = open_checkpoint(load_dir)
    return ckpt_dir, meta, config_from_metadata(meta.get("model_config"), ckpt_dir)


def inference_config(config: TransformerConfig, sequence_parallel: bool = False) -> TransformerConfig:
    """The saved config with training-only machinery off (and sequence parallelism as asked)."""
    fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
    fields.update(sequence_parallel=sequence_parallel and config.tensor_model_parallel_size > 1,
                  recompute_granularity=None, gradient_accumulation_fusion=False)
    return TransformerConfig(**fields)


def load_model(load_dir: str, *, sequence_parallel: bool = False,
               device: Optional[torch.device] = None) -> tuple[list[GPTModel], TransformerConfig]:
    """This rank's model chunks of the checkpoint, in eval mode. parallel_state must hold its layout."""
    ckpt_dir, meta, saved = read_checkpoint(load_dir)
    config = inference_config(saved, sequence_parallel)
    check_compatible(meta, config, ckpt_dir)
    st = parallel_state.resolve_parallel_state()
    tp_rank, pp_rank = st.tensor_model_parallel_rank, st.pipeline_model_parallel_rank
    pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    split = saved_split(meta, pp)  # the layers each stage was trained with (the default split is cost-balanced)
    if split is None:  # a checkpoint that records none: the config's even (or first/last) split
        partition = partition_layers(config.num_layers, pp, vp, layers_per_stage=config.layers_per_virtual_stage())
    else:
        if stage_order(split)[0] != "loop":
            raise CheckpointError(f"{ckpt_dir} places its pipeline chunks in the V of zb-v / dualpipev; generation "
                                  "runs the loop placement: convert it first (python3 tools/convert_checkpoint.py "
                                  "--loader parallel3d --saver parallel3d --load-dir ... --save-dir ... "
                                  "--target-pipeline-parallel-size ...)")
        partition = [[range(c[0], c[-1] + 1) if c else range(0) for c in chunks] for chunks in split]
    chunks = []
    for c in range(vp):
        chunk = GPTModel(config, pre_process=pp_rank == 0 and c == 0, post_process=pp_rank == pp - 1 and c == vp - 1,
                         layer_numbers=partition[pp_rank][c])
        chunks.append(chunk.to(device) if device is not None else chunk)
    tensors, _ = load_model_shards(ckpt_dir, tp_rank, pp_rank, meta)  # verifies the file's checksum
    load_model_state(chunks, tensors, ckpt_dir)
    for chunk in chunks:
        chunk.eval()
    return chunks, config


def _prepare(args: argparse.Namespace, world_size: int) -> tuple[Any, list[int], TransformerConfig, dict[str, Any]]:
    """Check everything that can be checked before any process talks to another."""
    if args.score_only and args.max_new_tokens:
        raise ValueError("--score-only generates nothing: drop --max-new-tokens")
    if not args.score_only and args.max_new_tokens is None:
        raise ValueError("--max-new-tokens is required (or --score-only)")
    sampling_given = [n for n in ("temperature", "top_k", "top_p") if getattr(args, n) is not None]
    if args.greedy and sampling_given:
        raise ValueError(f"--greedy excludes {', '.join('--' + n.replace('_', '-') for n in sampling_given)}")
    sampling = dict(greedy=not sampling_given, temperature=1.0 if args.temperature is None else args.temperature,
                    top_k=args.top_k or 0, top_p=args.top_p or 0.0)
    if not os.path.isdir(args.load):
        raise ValueError(f"--load directory {args.load!r} does not exist")
    _, meta, config = read_checkpoint(args.load)
    tokenizer = _tokenizer(args, meta.get("args") or {})
    if args.prompt is not None and tokenizer is None:
        raise ValueError("--prompt needs --tokenizer-type (and --tokenizer-model for HuggingFaceTokenizer): the "
                         "checkpoint records no tokenizer whose files are there")
    if args.prompt is not None:
        prompt_ids = tokenizer.tokenize(args.prompt)
    else:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as e:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from e
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    if world_size not in (1, tp * pp):
        raise ValueError(f"world size ({world_size}) must be the checkpoint's TP ({tp}) x PP ({pp}) = {tp * pp}, or 1 "
                         f"(the checkpoint resharded to one process): generation runs one model replica (DP = 1)")
    args.reshard = world_size == 1 and tp * pp > 1
    check_generation_args(prompt_ids, 0 if args.score_only else args.max_new_tokens, config, **sampling)
    return tokenizer, prompt_ids, config, sampling


def _tokenizer(args: argparse.Namespace, saved: dict[str, Any]):
    """--tokenizer-type's, else the one the checkpoint was trained with where its files still exist, else None."""
    if args.tokenizer_type:
        return build_tokenizer(args.tokenizer_type, args.tokenizer_model, vocab_file=args.vocab_file,
                               merge_file=args.merge_file)
    files = [saved.get(k) for k in ("tokenizer_model", "vocab_file", "merge_file") if saved.get(k)]
    if not saved.get("tokenizer_type") or not all(os.path.exists(f) for f in files):
        return None
    return build_tokenizer(saved["tokenizer_type"], saved.get("tokenizer_model"), vocab_file=saved.get("vocab_file"),
                           merge_file=saved.get("merge_file"))


def _initialize(config: TransformerConfig) -> torch.device:
    if not dist.is_initialized() and "RANK" in os.environ:
        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    if dist.is_initialized():
        parallel_state.initialize_model_parallel(config.tensor_model_parallel_size,
                                                 config.pipeline_model_parallel_size,
                                                 config.virtual_pipeline_model_parallel_size)
    return default_device()


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    exit_with_launcher()  # a worker must not outlive a killed torchrun (parallel3d/lifetime.py)
    args = get_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        tokenizer, prompt_ids, config, sampling = _prepare(args, world_size)
    except (ValueError, CheckpointError, ConversionError, FileNotFoundError) as e:
        # every rank checks the same input and exits with the same message, before any collective
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    # Past this point a failure is one "error: rank N: ..." line per rank (PARALLEL3D_DEBUG=1: the traceback).
    with errors_as_one_line():
        return _generate(args, tokenizer, prompt_ids, config, sampling)


def _generate(args: argparse.Namespace, tokenizer, prompt_ids: list[int], config: TransformerConfig,
              sampling: dict) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="parallel3d-generate-") if args.reshard \
            else contextlib.nullcontext() as tmp:
        load = args.load
        if tmp is not None:  # one process: this layout's shards resharded to TP = PP = 1
            print(f"resharding {args.load} (TP {config.tensor_model_parallel_size} x PP "
                  f"{config.pipeline_model_parallel_size}) to one process", file=sys.stderr, flush=True)
            load = os.path.join(tmp, "ckpt")
            convert("parallel3d", "parallel3d", args.load, load)
            config = read_checkpoint(load)[2]
        device = _initialize(config)
        chunks, _ = load_model(load, device=device)
    max_new = 0 if args.score_only else args.max_new_tokens
    tokens, logprobs = generate(chunks, prompt_ids, max_new, seed=args.seed, **sampling)
    result = {"tokens": tokens, "logprobs": logprobs}
    if tokenizer is not None:
        result["text"] = tokenizer.detokenize(tokens)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if args.output_json is None:
            print(json.dumps(result), flush=True)
        else:
            tmp_json = args.output_json + ".tmp"
            with open(tmp_json, "w") as f:
                json.dump(result, f)
            os.replace(tmp_json, args.output_json)
            if tokenizer is not None:
                print(result["text"], flush=True)
            print(f"wrote {len(tokens)} tokens ({len(tokens) - len(prompt_ids)} generated) and {len(logprobs)} "
                  f"log-probabilities to {args.output_json}", flush=True)
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return result


def cli() -> None:
    """The console script and ``python tools/generate.py``: errors exit inside main with their own status; a
    finished run ends without interpreter finalization (parallel3d/lifetime.py says why)."""
    main()
    exit_after_run(0)


if __name__ == "__main__":
    cli()
