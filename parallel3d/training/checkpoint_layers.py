"""Which layers each pipeline chunk of a checkpoint holds (metadata.json's ``layer_numbers``), checked on load.

The layer split over pipeline stages is not fixed by the layout alone: the default
(``--pipeline-split balanced``) weighs the stages by a cost model that can change between versions,
and ``--pipeline-model-parallel-layout`` or ``--decoder-first/last-pipeline-num-layers`` change it
too. A run that splits the layers otherwise than the checkpoint is refused on every rank, before
any tensor is read, with the layout flag that reproduces the saved split (instead of a missing
tensor deep in the loader on some ranks while the others wait).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from parallel3d.collectives import all_ranks_ok
from parallel3d.pipeline.schedules import stage_location

Split = list[list[list[int]]]  # [pp_rank][chunk] -> global layer indices


def saved_split(meta: dict[str, Any], pipeline_size: int) -> Optional[Split]:
    """metadata.json's ``layer_numbers`` when it holds every pipeline rank's chunks, else None."""
    split = meta.get("layer_numbers")
    if not isinstance(split, list) or len(split) != pipeline_size:
        return None
    if not all(isinstance(chunks, list) and all(isinstance(c, list) for c in chunks) for chunks in split):
        return None
    return split


def chunk_layers(chunks: Sequence[torch.nn.Module]) -> Optional[list[list[int]]]:
    """The global layer indices of each (unwrapped) chunk, where chunks declare ``layer_numbers``."""
    numbers = [getattr(chunk, "layer_numbers", None) for chunk in chunks]
    return [list(n) for n in numbers] if all(isinstance(n, range) for n in numbers) else None


def stage_order(split: Split) -> tuple[str, list[tuple[int, int]]]:
    """(placement, the (rank, chunk) of each virtual stage in layer order) of a saved split: the loop
    of Megatron's interleaving, or the V of zb-v / dualpipev, whichever lists the layers 0, 1, 2, ..."""
    P, V = len(split), len(split[0])
    for placement in ("loop", "v") if V == 2 else ("loop",):
        order = [stage_location(v, P, placement) for v in range(P * V)]
        stages = [split[p][c] for p, c in order]
        if sum(stages, []) == list(range(sum(len(s) for s in stages))):
            return placement, order
    raise ValueError(f"layer_numbers {split} list no layer order")


def layout_string(split: Split) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` for a split: its virtual stages in layer order."""
    parts = ["t" * len(split[p][c]) for p, c in stage_order(split)[1]]
    return "|".join(["E" + parts[0]] + parts[1:-1] + [parts[-1] + "L"]) if len(parts) > 1 else f"E{parts[0]}L"


def check_layer_split(ckpt_dir: str, meta: dict[str, Any], chunks: Sequence[torch.nn.Module], pp_rank: int,
                      pipeline_size: int) -> Optional[str]:
    """The error line, on every rank, when this run splits the layers otherwise than the checkpoint."""
    saved = saved_split(meta, pipeline_size)
    mine = chunk_layers(chunks)
    ok = saved is None or mine is None or mine == saved[pp_rank]
    if all_ranks_ok(ok, "the check of the checkpoint's layer split"):
        return None
    here = (f"pipeline rank {pp_rank} holds layers {_spans(mine)}, the checkpoint's {_spans(saved[pp_rank])}"
            if not ok else "another pipeline rank holds other layers")
    return (f"{ckpt_dir} splits the layers over the pipeline stages otherwise than this run ({here}); the "
            f"default cost-balanced split can change between versions: resume with "
            f"--pipeline-model-parallel-layout '{layout_string(saved)}'")


def _spans(chunks: Any) -> str:
    return ", ".join(f"{c[0]}-{c[-1]}" if c else "none" for c in chunks)
