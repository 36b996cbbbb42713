"""Where a conversion may write: never over or around its source, and --overwrite replaces only a checkpoint.

``--overwrite`` swaps the whole --save-dir out and removes it. So a --save-dir equal to --load-dir,
containing it or inside it is refused (the source would be deleted or read while replaced), and
one holding anything a conversion does not write (a tracker, ``iter_*``, an HF model's config and
weight files) is refused even with --overwrite, naming that entry: it is not ours to delete.
"""
from __future__ import annotations

import os
import re
from typing import Optional

from parallel3d.training.checkpointing import LATEST_FILE

from .schema import ConversionError

_WRITTEN = re.compile(r"^(iter_\d+|config\.json|generation_config\.json|model\.safetensors(\.index\.json)?|"
                      r"model-\d+-of-\d+\.safetensors)$")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_save_dir(load_dir: str, save_dir: str, overwrite: bool) -> None:
    """Refuse (ConversionError, one line) a --save-dir this conversion may not write or replace."""
    load, save = os.path.realpath(load_dir), os.path.realpath(save_dir)
    if _inside(load, save) or _inside(save, load):
        where = "is" if load == save else "contains" if _inside(load, save) else "is inside"
        raise ConversionError(f"--save-dir {save_dir} {where} --load-dir {load_dir}: the source would be replaced "
                              "or deleted; write the conversion to a directory of its own")
    problem = _describe_existing(save_dir)
    if problem is None:
        return
    if not overwrite or os.path.isfile(save_dir) or not os.path.isdir(save_dir):
        raise ConversionError(problem)
    foreign = sorted(n for n in os.listdir(save_dir) if not _WRITTEN.match(n) and n != LATEST_FILE)
    if foreign:
        raise ConversionError(f"--save-dir {save_dir} holds {foreign[0]!r}{' and more' if len(foreign) > 1 else ''}, "
                              "which no conversion writes: --overwrite replaces only a converted checkpoint; choose "
                              "another --save-dir or move that away yourself")


def _describe_existing(path: str) -> Optional[str]:
    """Why ``path`` may not be written over: None if it is absent or an empty directory."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path) or os.path.islink(path):
        return f"--save-dir {path} exists and is not a directory"
    names = os.listdir(path)
    if not names:
        return None
    if LATEST_FILE in names or any(n.startswith("iter_") for n in names) or "config.json" in names:
        return f"--save-dir {path} already holds a checkpoint; pass --overwrite to replace it"
    return f"--save-dir {path} is not empty ({len(names)} entries); pass --overwrite to replace it"
