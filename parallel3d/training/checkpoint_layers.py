"""Which layers each pipeline chunk of a checkpoint holds: recorded when saved, checked when loaded.

The layer split over pipeline stages is not fixed by the layout alone: the default
(``--pipeline-split balanced``) weighs the stages by a cost model that can change between versions,
and ``--pipeline-model-parallel-layout`` or ``--decoder-first/last-pipeline-num-layers`` change it
too. Each model shard records the global layer range of each of its chunks, so that a run that
splits the layers differently is refused on every rank, before any training, with the layout flag
that reproduces the saved split (instead of a missing tensor deep in the loader).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Sequence

import torch
from safetensors import safe_open

from parallel3d.collectives import all_ranks_ok

LAYERS_KEY = "layer_numbers"  # in each model.safetensors' metadata: [[start, stop], ...] per chunk

Ranges = list[list[int]]


def layer_ranges(chunks: Sequence[torch.nn.Module]) -> Optional[Ranges]:
    """[start, stop) of each (unwrapped) chunk's global layers, where chunks declare ``layer_numbers``."""
    out = []
    for chunk in chunks:
        numbers = getattr(chunk, "layer_numbers", None)
        if not isinstance(numbers, range):
            return None  # a model that does not say which layers it holds: nothing to record
        out.append([numbers.start, numbers.stop])
    return out


def saved_layer_ranges(ckpt_dir: str, pipeline_size: int, shard_path: Callable[[int], str]
                       ) -> Optional[dict[int, Ranges]]:
    """pipeline rank -> its chunks' ranges, read from shard headers (``shard_path(pp)``, relative to
    ``ckpt_dir``); None where the checkpoint did not record them."""
    out = {}
    for p in range(pipeline_size):
        try:  # only the header is read; the loader verifies each rank's own shard by its checksum
            with safe_open(os.path.join(ckpt_dir, shard_path(p)), framework="pt") as f:
                out[p] = json.loads((f.metadata() or {})[LAYERS_KEY])
        except Exception:  # noqa: BLE001 - missing, damaged, or saved before the split was recorded
            return None
    return out


def layout_string(ranges: dict[int, Ranges]) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` for a split: its virtual stages in layer order."""
    stages = sorted((r for chunks in ranges.values() for r in chunks), key=lambda r: (r[0], r[1]))
    parts = ["t" * (stop - start) for start, stop in stages]
    return "|".join(["E" + parts[0]] + parts[1:-1] + [parts[-1] + "L"]) if len(parts) > 1 else f"E{parts[0]}L"


def check_layer_split(ckpt_dir: str, chunks: Sequence[torch.nn.Module], pp_rank: int, pipeline_size: int,
                      shard_path: Callable[[int], str]) -> Optional[str]:
    """The error line, on every rank, when this run splits the layers otherwise than the checkpoint."""
    saved = saved_layer_ranges(ckpt_dir, pipeline_size, shard_path)
    if saved is None:
        return None
    mine = layer_ranges(chunks)
    if all_ranks_ok(mine is None or mine == saved[pp_rank], "the check of the checkpoint's layer split"):
        return None
    here = (f"pipeline rank {pp_rank} holds layers {_ranges(mine)}, the checkpoint's {_ranges(saved[pp_rank])}"
            if mine is not None and mine != saved[pp_rank] else "another pipeline rank holds other layers")
    return (f"{ckpt_dir} splits the layers over the pipeline stages otherwise than this run ({here}); the "
            f"default cost-balanced split can change between versions: resume with "
            f"--pipeline-model-parallel-layout '{layout_string(saved)}'")


def _ranges(ranges: Any) -> str:
    return ", ".join(f"{a}-{b - 1}" if b > a else "none" for a, b in ranges)
