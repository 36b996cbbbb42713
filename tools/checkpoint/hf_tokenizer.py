"""The tokenizer a parallel3d checkpoint was trained with, written beside its Hugging Face export.

Training records its tokenizer arguments in the checkpoint's metadata; the export copies the files
``transformers`` reads (``tokenizer.json``, or GPT-2's ``vocab.json`` + ``merges.txt``) and gives
config.json the end-of-document id as ``eos_token_id`` / ``bos_token_id`` (GPT-2's convention).
"""
from __future__ import annotations

import argparse

import os
import shutil
from typing import Any, Optional

from parallel3d.data import build_tokenizer
from parallel3d.data.tokenizer import TOKENIZER_TYPES

_HF_EXTRA_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _files(kind: str, args: dict[str, Any]) -> dict[str, Optional[str]]:
    """{file name in the export: its source} for a recorded tokenizer."""
    if kind == "GPT2BPETokenizer":
        return {"vocab.json": args.get("vocab_file"), "merges.txt": args.get("merge_file")}
    if kind == "HuggingFaceTokenizer":
        model = args.get("tokenizer_model") or ""
        folder = model if os.path.isdir(model) else os.path.dirname(model)
        files: dict[str, Optional[str]] = {"tokenizer.json": os.path.join(model, "tokenizer.json")
                                           if os.path.isdir(model) else model}
        files.update({n: os.path.join(folder, n) for n in _HF_EXTRA_FILES if os.path.isfile(os.path.join(folder, n))})
        return files
    return {}


def export_tokenizer(args: Any, out_dir: str) -> tuple[Optional[int], Optional[str]]:
    """Copy the recorded tokenizer's files into ``out_dir``: (its end-of-document id, why no files were written).
    ``args``: the source's saved arguments, a dict (parallel3d) or a Namespace (Megatron-LM), or None."""
    args = vars(args) if isinstance(args, argparse.Namespace) else args
    kind = (args or {}).get("tokenizer_type")
    if not kind:
        return None, "the checkpoint records no tokenizer (a converted one keeps the source's config instead)"
    if kind not in TOKENIZER_TYPES:  # a Megatron-LM source's SentencePiece, Null, TikToken ... tokenizer
        return None, f"its {kind} has no reader here: copy the tokenizer files by hand"
    files = _files(kind, args)
    missing = [src for src in files.values() if not src or not os.path.isfile(src)]
    if missing:
        return None, f"its {kind} files {missing} are not there any more"
    eod = build_tokenizer(kind, args.get("tokenizer_model"), vocab_file=args.get("vocab_file"),
                          merge_file=args.get("merge_file")).eod
    for name, src in files.items():
        shutil.copyfile(src, os.path.join(out_dir, name))
    return eod, None if files else f"the {kind} tokenizer has no Hugging Face tokenizer files"
