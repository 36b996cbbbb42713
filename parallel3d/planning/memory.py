"""Memory per GPU: parameters, gradients, optimizer states, activations, logits, allocator.

Static bytes per parameter follow parallel3d's optimizers exactly (tests count them on real
models): bf16 params (2) + fp32 main_grad buffer (4) + fp32 master (4) + Adam m, v (8), the last
two divided by DP under the distributed optimizer (ZeRO-1); fp32 training keeps no master.
Activations per layer and microbatch generalise Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2: sbh(34 + 5as/h) without parallelism) to
GQA and SwiGLU; which (microbatch, chunk) forwards are held at once comes from the simulated schedule.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Optional

from parallel3d.pipeline.layout import layer_partition as pipeline_layer_partition
from parallel3d.pipeline.schedules import virtual_stage
from parallel3d.tensor_parallel.cross_entropy import loss_memory_per_logit

from .compute import head_cost_in_layers
from .hardware import GIB, ClusterSpec
from .model import Layout, ModelSpec



@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU at its peak (what torch.cuda.max_memory_allocated reports)."""

    params: float
    grads: float
    optimizer: float  # fp32 masters + Adam states
    activations: float  # stored for backward by the in-flight microbatches
    transient: float  # one layer's working set in backward, the loss's logits
    inflight_microbatches: int

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.static + self.activations + self.transient

    def reserved(self, cluster: ClusterSpec) -> float:
        """What the device must hold: the allocator's reserve over the peak plus the CUDA context."""
        return self.peak * (1 + cluster.fragmentation) + cluster.context_gib * GIB

    def fits(self, cluster: ClusterSpec) -> bool:
        return self.reserved(cluster) <= cluster.memory_gib * GIB

    def as_gib(self) -> dict:
        d = {k: v / GIB for k, v in asdict(self).items() if k != "inflight_microbatches"}
        d["peak"] = self.peak / GIB
        d["inflight_microbatches"] = self.inflight_microbatches
        return d


@functools.lru_cache(maxsize=256)
def layer_partition(model: ModelSpec, layout: Layout) -> list[list[range]]:
    """result[rank][chunk]: the layers training places there, by --pipeline-split
    (parallel3d.pipeline.layout.layer_partition, the rule training builds by)."""
    head = head_cost_in_layers(model.hidden_size, model.seq_length, model.vocab(layout.tp), layout.tp > 1)
    return pipeline_layer_partition(model.num_layers, layout.pp, layout.virtual_stages(model), layout.placement(model),
                                    split=layout.pipeline_split, head_cost=head)


def rank_chunks(model: ModelSpec, layout: Layout, rank: int) -> list[tuple[int, bool, bool]]:
    """(layers, holds embedding, holds output layer) of each model chunk of pipeline rank ``rank``."""
    P, V, placement = layout.pp, layout.virtual_stages(model), layout.placement(model)
    last = P * V - 1
    stages = [virtual_stage(rank, c, P, placement) for c in range(V)]
    return [(len(layers), v == 0, v == last) for layers, v in zip(layer_partition(model, layout)[rank], stages)]


def params_on_rank(model: ModelSpec, layout: Layout, rank: int) -> int:
    """Parameters of one TP rank of pipeline stage ``rank`` (every chunk it holds)."""
    t, n = layout.tp, 0
    for layers, first, last in rank_chunks(model, layout, rank):
        n += layers * model.layer_params(t)
        if first:
            n += model.embedding_params(t)
        if last:
            n += model.head_params(t, holds_embedding=first)
    return n


def static_bytes(model: ModelSpec, layout: Layout, rank: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of one GPU of pipeline stage ``rank``."""
    n = params_on_rank(model, layout, rank)
    shard = layout.dp if layout.use_distributed_optimizer else 1
    master = 4 if layout.bf16 else 0
    return n * (2 if layout.bf16 else 4), n * 4.0, n * (master + 8) / shard


def layer_activation_bytes(model: ModelSpec, layout: Layout, recompute: str | None) -> float:
    """Bytes one transformer layer keeps for its backward, per microbatch, on one TP rank."""
    t, elem = layout.tp, 2 if layout.bf16 else 4
    s, b, h = model.seq_length, layout.micro_batch_size, model.hidden_size
    sp_div = t if layout.sequence_parallel else 1
    if recompute == "full":
        return s * b * h * elem / sp_div  # the layer's input only
    mask = 1 if model.hidden_dropout > 0 else 0
    # Not split by TP (unless SP): two norm inputs, the two norm outputs feeding QKV and FC1, two masks.
    replicated = s * b * h * (4 * elem + 2 * mask) / sp_div
    # Split by TP: Q, K, V; the attention output (projection input); FC1 output; FC2 input.
    sharded = s * b * (model.q_size + 2 * model.kv_size + model.q_size + model.fc1_out + model.ffn) * elem / t
    scores = 0.0
    if model.attention_backend == "local" and recompute != "selective":
        heads = model.num_attention_heads // t
        scores = b * heads * s * s * (2 * elem + 1 if mask else elem)  # softmax out (+ dropout mask and out)
    return replicated + sharded + scores


def chunk_activation_bytes(model: ModelSpec, layout: Layout, rank: int) -> list[float]:
    """Bytes one microbatch leaves held on rank ``rank`` from each chunk's forward to its backward:
    the chunk's own layers (not the rank's), plus what the loss keeps on the chunk with the output layer."""
    per_layer = layer_activation_bytes(model, layout, layout.recompute_granularity)
    held = loss_memory_per_logit(tensor_parallel=layout.tp > 1)[1]
    return [layers * per_layer + (_logit_elements(model, layout) * held if last else 0.0)
            for layers, _, last in rank_chunks(model, layout, rank)]


def _logit_elements(model: ModelSpec, layout: Layout) -> int:
    return layout.micro_batch_size * model.seq_length * model.vocab(layout.tp) // layout.tp


def memory_breakdown(model: ModelSpec, layout: Layout, rank: int, inflight: int,
                     actions: Optional[Sequence] = None) -> MemoryBreakdown:
    """Peak bytes of pipeline stage ``rank`` holding ``inflight`` (microbatch, chunk) forwards at once.

    With ``actions`` (the rank's compute actions in the simulated order, each with ``kind`` F/B/W
    and ``chunk``) the peak is found by walking them: a forward adds its chunk's activations, the
    backward (W where the schedule splits it) frees them, and the working set of the moment is
    added (the loss's logits in the last chunk's forward and backward, one layer's activations in
    any backward).  Without, a lower bound, what the search prunes with (a layout whose lower bound
    does not fit cannot fit): ``inflight`` forwards of the rank's smallest chunk, and one layer's
    working set (the backward that follows them)."""
    params, grads, optim = static_bytes(model, layout, rank)
    chunks = rank_chunks(model, layout, rank)
    held_by = chunk_activation_bytes(model, layout, rank)
    # In backward one layer is live in full (recomputed, or its activation gradients); on the
    # last stage the loss's peak beyond what it keeps (counted as held) in its forward and backward.
    layer_ws = layer_activation_bytes(model, layout, None)
    loss_peak, loss_kept = loss_memory_per_logit(tensor_parallel=layout.tp > 1)
    loss_ws = _logit_elements(model, layout) * (loss_peak - loss_kept)
    if actions is None:
        return MemoryBreakdown(params, grads, optim, inflight * min(held_by), layer_ws, inflight)
    split = any(a.kind == "W" for a in actions)
    held = 0.0
    count = most = 0
    best = (0.0, 0.0, 0.0)  # (activations + working set, activations, working set) at the peak
    for a in actions:
        last = chunks[a.chunk][2]
        if a.kind == "F":
            held += held_by[a.chunk]
            count += 1
            most = max(most, count)
            work = loss_ws if last else 0.0
        elif a.kind == "B":
            work = max(layer_ws, loss_ws if last else 0.0)
        else:
            work = 0.0
        best = max(best, (held + work, held, work))
        if a.kind == ("W" if split else "B"):
            held -= held_by[a.chunk]
            count -= 1
    return MemoryBreakdown(params, grads, optim, best[1], best[2], most)
