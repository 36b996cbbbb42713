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
   stage by cost, counting the output layer and loss on the last stage (:func:`head_cost_in_layers`);
   ``--pipeline-split even``: Megatron's default, every stage the same number of layers.

Every path ends in :func:`stage_counts`, which refuses a layout that would drop or duplicate a layer.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Optional

from parallel3d.tensor_parallel.cross_entropy import loss_bytes_per_logit

from .partition import _balanced_counts, _even_counts, partition_layers


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


# Bytes of memory traffic worth one GEMM FLOP's time, and a layer's time over its GEMMs' alone
# (H100, GPT-1.3B, 2026-11-26: GEMMs at ~650 TFLOP/s against ~3 TB/s copies; a layer measured
# 4.9 ms forward + backward for 4.45 ms of GEMMs). Calibrated so that the loss path measured
# there gives the measured head: 3.8 layers (11.2 ms forward + 7.5 ms backward) at PP=4.
FLOPS_PER_LOSS_BYTE = 200.0
LAYER_OVER_GEMMS = 1.1


def head_cost_in_layers(hidden_size: int, seq_length: int, padded_vocab_size: int,
                        tensor_parallel: bool = False) -> float:
    """The output layer and loss in units of one transformer layer's training time.

    Layer: 72 b s h^2 + 12 b s^2 h GEMM FLOPs (QKV, projection, a 4h MLP, attention scores;
    forward plus backward = 3x forward), times LAYER_OVER_GEMMS. Output layer: 6 b s h V FLOPs,
    plus the loss's memory passes over the b s V logits (``loss_bytes_per_logit``) at
    FLOPS_PER_LOSS_BYTE. GPT-1.3B (h 2048, s 2048, V 50304): 3.9 layers with TP's loss (3.8
    measured), 2.9 with the one-rank loss; the GEMMs alone would say 1.75.
    """
    h, s, V = hidden_size, seq_length, padded_vocab_size
    loss_bytes = sum(loss_bytes_per_logit(tensor_parallel))
    return (6 * h * V + loss_bytes * V * FLOPS_PER_LOSS_BYTE) / ((72 * h * h + 12 * s * h) * LAYER_OVER_GEMMS)


@functools.lru_cache(maxsize=256)
def _balanced_uniform(num_layers: int, num_stages: int, head: float) -> tuple[int, ...]:
    """The balanced split of equal layers with a head of ``head`` layers; cached, as the planner's
    search asks for the same few thousands of times."""
    return tuple(_balanced_counts([1.0] * num_layers, num_stages, 0.0, head, allow_empty=False))


def layer_counts(args: Any, num_stages: int, padded_vocab_size: Optional[int] = None) -> Optional[list[int]]:
    """Layers per virtual stage from the arguments (see the module doc); None = an even split.

    ``padded_vocab_size``: the output layer's vocabulary (the model config's), for the balanced split's
    head cost; default ``args.padded_vocab_size``, else ``args.vocab_size``."""
    L = args.num_layers
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout:
        return parse_layout(layout, num_stages, L)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        return None  # the caller's own rule (it also checks it splits evenly)
    emb = int(bool(getattr(args, "account_for_embedding_in_pipeline_split", False)))
    loss = int(bool(getattr(args, "account_for_loss_in_pipeline_split", False)))
    if emb or loss:
        counts = _even_counts(L + emb + loss, num_stages)
        counts[0] -= emb
        counts[-1] -= loss
        return stage_counts(counts, L, "--account-for-embedding/loss-in-pipeline-split")
    if num_stages == 1:
        return None
    if getattr(args, "pipeline_split", "balanced") == "even":
        if L % num_stages:
            raise LayoutError(f"--pipeline-split even needs --num-layers ({L}) divisible by the {num_stages} "
                              "(virtual) pipeline stages; drop it for the balanced split, or place the layers "
                              "with --pipeline-model-parallel-layout")
        return None
    tp = getattr(args, "tensor_model_parallel_size", 1)
    head = head_cost_in_layers(args.hidden_size, args.seq_length, padded_vocab_size
                               or getattr(args, "padded_vocab_size", None) or args.vocab_size, tp > 1)
    if L < num_stages:
        return None  # not enough layers to balance: the even split's error says so
    return list(_balanced_uniform(L, num_stages, head))


def layer_partition_from_args(args: Any, pipeline_size: int, virtual_size: int, placement: str,
                              padded_vocab_size: Optional[int] = None) -> list[list[range]]:
    """result[rank][chunk]: the layers of each (virtual) stage by :func:`layer_counts`, in the schedule's
    chunk placement: what training builds and the planner prices (one rule for both)."""
    counts = layer_counts(args, pipeline_size * virtual_size, padded_vocab_size)
    return partition_layers(args.num_layers, pipeline_size, virtual_size, layers_per_stage=counts,
                            allow_empty_stages=counts is not None, placement=placement)
