"""--use-checkpoint-args (Megatron's load_args_from_checkpoint): the model's shape and layout from --load
(with a pipeline, the layers of each stage too, as --pipeline-model-parallel-layout).

Continuing from a converted Hugging Face model then needs no restated shape flags. The checkpoint's
metadata.json records the TransformerConfig (every save and conversion writes it) and its TP / PP /
virtual PP layout; a checkpoint saved by training also records its arguments, from which the
tokenizer is taken when the command line names none. As in Megatron, the shape wins over the command
line; the sequence length stays the command line's (bounded by the checkpoint's position table).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from parallel3d.models.config import megatron_gelu_flags
from parallel3d.training import checkpointing
from parallel3d.training.checkpoint_integrity import CheckpointError
from parallel3d.training.checkpoint_layers import layout_string, saved_split

# TransformerConfig field -> argument, copied as they are.
_SAME = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
         "max_position_embeddings", "position_embedding_type", "rotary_base", "rotary_percent", "normalization",
         "add_qkv_bias", "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "vocab_size")
_TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def _args_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
    out = {name: cfg[name] for name in _SAME if name in cfg}
    out["norm_epsilon"] = cfg.get("layernorm_epsilon", 1e-5)
    out["swiglu"] = bool(cfg.get("gated_linear_unit"))
    out["disable_bias_linear"] = not cfg.get("add_bias_linear", True)
    if not out["swiglu"]:  # the GeLU flags that build the saved activation
        out.update(megatron_gelu_flags(cfg.get("activation", "gelu"), cfg.get("add_bias_linear", True)))
    groups = cfg.get("num_query_groups")
    out["group_query_attention"] = groups is not None and groups != cfg.get("num_attention_heads")
    out["num_query_groups"] = groups if out["group_query_attention"] else None
    return out


def apply_checkpoint_args(args: argparse.Namespace) -> list[str]:
    """Overwrite the model's shape and layout in ``args`` with the latest checkpoint's; return what changed."""
    if not args.load:
        raise CheckpointError("--use-checkpoint-args needs --load")
    iteration = checkpointing.read_latest_iteration(args.load) if os.path.isdir(args.load) else None
    if iteration is None:
        raise CheckpointError(f"--use-checkpoint-args: --load {args.load} holds no checkpoint to take arguments from")
    _, ckpt_dir, meta = checkpointing.open_checkpoint(args.load, iteration)
    cfg = meta.get("model_config")
    if not isinstance(cfg, dict) or not cfg:
        raise CheckpointError(f"--use-checkpoint-args: {ckpt_dir} records no model_config; give the shape flags")
    new = _args_from_config(cfg)
    layout = meta["layout"]
    new["tensor_model_parallel_size"] = layout["tensor_model_parallel_size"]
    new["pipeline_model_parallel_size"] = layout["pipeline_model_parallel_size"]
    new["virtual_pipeline_model_parallel_size"] = layout.get("virtual_pipeline_model_parallel_size")
    new["num_layers_per_virtual_pipeline_stage"] = None  # the virtual size above says it
    split = saved_split(meta, layout["pipeline_model_parallel_size"])
    if len(split or []) > 1:  # the layers per stage too: the default split may have changed since
        new.update(pipeline_model_parallel_layout=layout_string(split), decoder_first_pipeline_num_layers=None,
                   decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
                   account_for_loss_in_pipeline_split=False)
    saved_args = meta.get("args") or {}
    if all(getattr(args, k, None) is None for k in _TOKENIZER_ARGS):
        new.update({k: saved_args[k] for k in _TOKENIZER_ARGS if saved_args.get(k) is not None})
    changed = [f"{k}={v}" for k, v in new.items() if getattr(args, k, None) != v]
    for k, v in new.items():
        setattr(args, k, v)
    return changed


def take_checkpoint_split(args: argparse.Namespace, partition: list[list[range]]) -> Optional[str]:
    """Resume with the layer split --load's latest checkpoint records (a converter's even split, or another
    version's balance) when this run names none of its own and differs: sets --pipeline-model-parallel-layout
    and returns the notice to print; None when nothing changes (the load then checks the split as before)."""
    own = (args.pipeline_model_parallel_layout, args.decoder_first_pipeline_num_layers,
           args.decoder_last_pipeline_num_layers, args.account_for_embedding_in_pipeline_split or None,
           args.account_for_loss_in_pipeline_split or None)
    if not args.load or args.pipeline_split != "balanced" or any(v is not None for v in own):
        return None
    try:
        iteration = checkpointing.read_latest_iteration(args.load) if os.path.isdir(args.load) else None
        meta = checkpointing.read_metadata(checkpointing.find_checkpoint_dir(args.load, iteration)) \
            if iteration is not None else None
    except CheckpointError:
        return None  # the load reports it
    if meta is None or (meta["layout"].get("virtual_pipeline_model_parallel_size") or 1) != \
            (args.virtual_pipeline_model_parallel_size or 1):
        return None
    split = saved_split(meta, args.pipeline_model_parallel_size)
    if split is None or len(split) == 1 or split == [[list(r) for r in chunks] for chunks in partition] \
            or sum(len(layers) for chunks in split for layers in chunks) != args.num_layers:
        return None
    args.pipeline_model_parallel_layout = layout_string(split)
    return (f"--load {args.load}: taking the checkpoint's layer split over the pipeline stages "
            f"(--pipeline-model-parallel-layout '{args.pipeline_model_parallel_layout}')")
