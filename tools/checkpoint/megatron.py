"""Megatron-LM checkpoints (``--loader megatron`` / ``--saver megatron``): which format a directory holds.

``megatron_legacy`` reads and writes the legacy per-rank ``model_optim_rng.pt`` format,
``megatron_dist`` reads and writes ``torch_dist``; ``megatron_files`` has what both share (locations, the
safe unpickling, args <-> TransformerConfig).
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

from parallel3d.training.checkpointing import CheckpointError, read_metadata

from .megatron_dist import MegatronDistLoader, MegatronDistSaver
from .megatron_files import DIST_METADATA, find_checkpoint
from .megatron_legacy import MegatronLegacyLoader, MegatronLegacySaver

__all__ = ["MegatronLoader", "MegatronSaver", "known_args"]

# --ckpt-format (Megatron's name) -> the saver writing it
SAVERS = {"torch": MegatronLegacySaver, "torch_dist": MegatronDistSaver}


def MegatronSaver(ckpt_format: str, out_dir: str, config: Any, iteration: int, known: dict[str, Any]) -> Any:
    """The saver of Megatron's ``--ckpt-format`` (torch: legacy, torch_dist)."""
    return SAVERS[ckpt_format](out_dir, config, iteration, known)


def MegatronLoader(load_dir: str, vocab_size: Optional[int] = None
                   ) -> Union[MegatronLegacyLoader, MegatronDistLoader]:
    """The loader of the checkpoint in ``load_dir`` (a --save directory or one iteration directory)."""
    ckpt_dir, iteration = find_checkpoint(load_dir)
    if os.path.isfile(os.path.join(ckpt_dir, DIST_METADATA)):
        return MegatronDistLoader(ckpt_dir, iteration, vocab_size)
    return MegatronLegacyLoader(ckpt_dir, iteration, vocab_size)


# The tokenizer arguments a Megatron run compares with the checkpoint's (check_checkpoint_args).
_TOKENIZER_ARGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def known_args(source: Any) -> dict[str, Any]:
    """The source's tokenizer arguments (a Megatron checkpoint's args, a parallel3d checkpoint's metadata)."""
    saved = getattr(source, "args", None)
    if saved is not None:
        return {k: getattr(saved, k) for k in _TOKENIZER_ARGS if hasattr(saved, k)}
    ckpt_dir = getattr(source, "ckpt_dir", None)
    if ckpt_dir is None or not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        return {}
    try:
        recorded = read_metadata(ckpt_dir).get("args") or {}
    except CheckpointError:
        return {}
    return {k: recorded[k] for k in _TOKENIZER_ARGS if recorded.get(k) is not None}
