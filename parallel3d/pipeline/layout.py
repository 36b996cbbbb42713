"""How many transformer layers each (virtual) pipeline stage holds: Megatron's layout flags and a
split balanced by cost.

Precedence (the first given wins):
1. ``--pipeline-model-parallel-layout`` (Megatron's grammar): stages separated by ``|``, ``E`` the
   embedding, ``t`` a transformer layer, ``L`` the output layer and loss, ``X*n`` / ``(...)*n``
   repetition, commas and spaces ignored; stages listed by virtual stage (v = chunk * P + rank).
   Example: ``"Et|(tt|)*6L"`` for 14 layers on 8 stages.  ``m`` (MTP) is not supported.
2. ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``.
3. ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
   an even split in which the embedding / the loss counts as one layer of the first / last stage.
4. ``--pipeline-split balanced`` (default): the contiguous split minimising the most expensive
   stage by cost, counting the output layer and loss on the last stage (``head_cost``);
   ``--pipeline-split even``: Megatron's default, every stage the same number of layers.

A layout string and the account-for flags end in :func:`stage_counts`, which refuses a split that would
drop or duplicate a layer; the other rules refuse a total they cannot split.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Optional

from .partition import balanced_counts, even_counts, partition_layers


class LayoutError(ValueError):
    """A pipeline layout that does not hold every layer exactly once."""


def expand_layout(text: str) -> str:
    """Megatron's layout string with repetitions expanded and cosmetic commas/spaces removed."""
    s = re.sub(r"[\s,]", "", text)
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while True:
        s, n = group.subn(lambda m: m.group(1) * int(m.group(2)), s)
        if not n:
            break
    s = re.sub(r"([EtmL])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    bad = set(s) - set("EtL|")
    if bad:
        what = "MTP layers ('m') are not supported" if bad == {"m"} else f"unknown symbols {sorted(bad)}"
        raise LayoutError(f"--pipeline-model-parallel-layout {text!r}: {what}; use E, t, L, |, (...)*n")
    return s


def parse_layout(text: str, num_stages: int, num_layers: int) -> list[int]:
    """Transformer layers per virtual stage, from a layout string (see the module doc)."""
    stages = expand_layout(text).split("|")
    if len(stages) != num_stages:
        raise LayoutError(f"--pipeline-model-parallel-layout {text!r} has {len(stages)} stages, expected "
                          f"pipeline x virtual size = {num_stages}")
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise LayoutError(f"--pipeline-model-parallel-layout {text!r}: the embedding 'E' must appear once, "
                          "first in the first stage")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise LayoutError(f"--pipeline-model-parallel-layout {text!r}: the loss 'L' must appear once, "
                          "last in the last stage")
    return stage_counts([s.count("t") for s in stages], num_layers, f"--pipeline-model-parallel-layout {text!r}")


def stage_counts(counts: list[int], num_layers: int, source: str) -> list[int]:
    """``counts`` if it holds every one of ``num_layers`` layers exactly once, else a LayoutError."""
    total = sum(counts)
    if total != num_layers:
        verb = "drop" if total < num_layers else "duplicate"
        raise LayoutError(f"{source} places {total} transformer layers ({counts} per stage) but the model "
                          f"has --num-layers {num_layers}: it would {verb} {abs(num_layers - total)} layer(s)")
    if any(c < 0 for c in counts):
        raise LayoutError(f"{source} gives a stage a negative number of layers: {counts}")
    return counts


@functools.lru_cache(maxsize=256)
def _balanced_uniform(num_layers: int, num_stages: int, head: float) -> tuple[int, ...]:
    """The balanced split of equal layers with a head of ``head`` layers; cached, as the planner's
    search asks for the same few thousands of times."""
    return tuple(balanced_counts([1.0] * num_layers, num_stages, 0.0, head, allow_empty=False))


def _first_last_counts(L: int, P: int, V: int, first: Optional[int], last: Optional[int]) -> list[int]:
    """Megatron's uneven split (num_layers_in_first/last_pipeline_stage, --decoder-first/last-pipeline-num-layers):
    the first/last pipeline rank hold ``first``/``last`` layers, the other ranks share the rest evenly;
    each rank's layers spread evenly over its V chunks."""
    if P == 1:
        raise LayoutError("num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1")
    for which, n in (("first", first), ("last", last)):
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1 or n % V):
            raise LayoutError(f"num_layers_in_{which}_pipeline_stage must be a positive multiple of "
                              f"virtual_pipeline_model_parallel_size ({V}), got {n!r}")
    middle = P - (first is not None) - (last is not None)
    inner = L - (first or 0) - (last or 0)
    if inner < 0 or (middle == 0 and inner != 0):
        raise LayoutError(f"num_layers ({L}) does not match num_layers_in_first_pipeline_stage ({first}) + "
                          f"num_layers_in_last_pipeline_stage ({last}) with {middle} other stage(s)")
    if middle and (inner % (middle * V) or inner == 0):
        raise LayoutError(f"the {inner} layers left for the {middle} middle pipeline stage(s) are not divisible by "
                          f"{middle} x virtual_pipeline_model_parallel_size ({V}) = {middle * V} (or are none)")
    per_rank = [inner // middle if middle else 0] * P
    per_rank[0], per_rank[-1] = first or per_rank[0], last or per_rank[-1]  # both >= 1 where given
    return [per_rank[v % P] // V for v in range(P * V)]


def layers_per_virtual_stage(num_layers: int, pipeline_size: int, virtual_size: int = 1, *,
                             layout: Optional[str] = None, first_stage_layers: Optional[int] = None,
                             last_stage_layers: Optional[int] = None, account_for_embedding: bool = False,
                             account_for_loss: bool = False, split: str = "balanced",
                             head_cost: Optional[float] = None) -> list[int]:
    """Transformer layers of each virtual stage v = chunk * P + rank, by the first rule given (the
    module doc): ``layout``, ``first/last_stage_layers``, ``account_for_embedding/loss``, ``split``.

    ``head_cost``: the output layer and loss in layers (parallel3d.planning.compute.head_cost_in_layers),
    which the balanced split weighs; the even and uneven splits leave no stage empty."""
    L, P, V = num_layers, pipeline_size, virtual_size
    S = P * V
    if layout:
        return parse_layout(layout, S, L)
    if first_stage_layers is not None or last_stage_layers is not None:
        return _first_last_counts(L, P, V, first_stage_layers, last_stage_layers)
    if account_for_embedding or account_for_loss:
        emb, loss = int(account_for_embedding), int(account_for_loss)
        counts = even_counts(L + emb + loss, S)
        counts[0] -= emb
        counts[-1] -= loss
        return stage_counts(counts, L, "--account-for-embedding/loss-in-pipeline-split")
    if split == "even" and L % S:
        raise LayoutError(f"num_layers ({L}) is not divisible by pipeline_model_parallel_size ({P}) x "
                          f"virtual_pipeline_model_parallel_size ({V}) = {S}: no even split (--pipeline-split even); "
                          "drop that for the balanced split, set num_layers_in_first/last_pipeline_stage, or place "
                          "the layers with --pipeline-model-parallel-layout")
    if L < S:
        raise LayoutError(f"{L} layers cannot fill {S} virtual stages (pipeline_size={P} x virtual_size={V}); use at "
                          f"most {L} stages, more layers, or place them with --pipeline-model-parallel-layout")
    if split == "even" or S == 1:
        return [L // S] * S
    if head_cost is None:
        raise ValueError("the balanced split weighs the output layer: pass head_cost (head_cost_in_layers)")
    return list(_balanced_uniform(L, S, head_cost))


def layer_partition(num_layers: int, pipeline_size: int, virtual_size: int = 1, placement: str = "loop",
                    **split: Any) -> list[list[range]]:
    """result[rank][chunk]: the layers of each (virtual) stage by :func:`layers_per_virtual_stage` (its
    keywords), in the schedule's chunk placement: what training builds and the planner prices."""
    counts = layers_per_virtual_stage(num_layers, pipeline_size, virtual_size, **split)
    return partition_layers(num_layers, pipeline_size, virtual_size, layers_per_stage=counts,
                            allow_empty_stages=True, placement=placement)
