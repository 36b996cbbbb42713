"""Everything that turns per-rank gradients into the gradients of the global batch (Megatron's function).

Called once per iteration after the last backward (the pipeline executor calls
``finalize_model_grads_func(model_chunks, num_tokens)``), before the optimizer step:

1. each chunk's DP reduction: ``finish_grad_sync()``;
2. sequence-parallel parameters (LayerNorm weights, row-parallel biases) saw only
   their TP rank's sequence shard: sum their gradients over TP;
3. the tied word embedding lives on the first and the last pipeline stage: sum
   its two gradients over the embedding group (a learned position embedding lives
   on the first stage only: nothing to sum);
4. per-token loss: divide every gradient by the global number of tokens;
5. FP8 delayed scaling: this step's amaxes (max over TP and DP) enter each linear's history and
   give the next step's scales (``tensor_parallel.fp8.update_fp8_scaling``).

On its first call for a set of chunks it also checks that the copies which must agree do
(``replica_check.py``): replicated parameters across TP ranks, the tied embedding across stages.

With ZeRO-1 only this rank's shard of each bucket holds reduced gradients after
step 1. Steps 2-3 stay correct: TP ranks (and, thanks to its own bucket, both
copies of the shared embedding) have identical bucket layouts, so the elementwise
sums over TP / the embedding group line up shard for shard.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d.model_chunk import shared_weight
from parallel3d.tensor_parallel import allreduce_sequence_parallel_gradients
from parallel3d.tensor_parallel.fp8 import update_fp8_scaling

from .ddp import DistributedDataParallel, ddp_chunks
from .replica_check import check_replicas


def _main_grad(param: torch.Tensor) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def _allreduce_layernorm_grads(chunks: Sequence[DistributedDataParallel], state: ps.ParallelState) -> None:
    if state.tensor_model_parallel_size == 1:
        return
    params = [p for c in chunks for p in c.module.parameters()
              if p.requires_grad and getattr(p, "sequence_parallel", False)]
    if params:
        allreduce_sequence_parallel_gradients(params, state.tensor_model_parallel_group)


def _embedding_chunk(chunks: Sequence[DistributedDataParallel], state: ps.ParallelState) -> Optional[nn.Module]:
    # The first stage's embedding lives in its first virtual chunk; the last stage's copy in its last one.
    if state.is_pipeline_first_stage(ignore_virtual=True):
        return chunks[0].module
    if state.is_pipeline_last_stage(ignore_virtual=True):
        return chunks[-1].module
    return None


def _tied_pair(chunks: Sequence[DistributedDataParallel]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A V-shaped schedule puts the first and the last stage on one rank, in two chunks: the embedding's
    and the output layer's tied weights, both here (this rank then needs no embedding group)."""
    first, last = [next((c.module for c in chunks if getattr(c.module, attr, False)), None)
                   for attr in ("pre_process", "post_process")]
    if first is None or last is None or first is last or not getattr(first, "share_embeddings_and_output_weights", False):
        return None
    return first.shared_embedding_or_output_weight(), last.shared_embedding_or_output_weight()


def _tied_weight(chunks: Sequence[DistributedDataParallel], state: ps.ParallelState) -> Optional[torch.Tensor]:
    """This rank's copy of the tied weight it shares with the other end of its pipeline over the
    embedding group, or None where it shares none over that group."""
    if state.pipeline_model_parallel_size == 1 or not state.is_rank_in_embedding_group():
        return None
    if _tied_pair(chunks) is not None:
        return None
    if all(hasattr(c.module, "pre_process") for c in chunks) and not any(
            c.module.pre_process or c.module.post_process for c in chunks):
        return None  # the last rank of a V holds neither end
    group = state.embedding_group
    if group is None or dist.get_world_size(group) == 1:
        return None
    module = _embedding_chunk(chunks, state)
    if module is None or not getattr(module, "share_embeddings_and_output_weights", False):
        return None
    weight = shared_weight(module)
    if weight is None:
        raise RuntimeError(
            f"pipeline stage {state.pipeline_model_parallel_rank} sets share_embeddings_and_output_weights but "
            "shared_embedding_or_output_weight() returned None"
        )
    return weight


def _allreduce_word_embedding_grads(chunks: Sequence[DistributedDataParallel], state: ps.ParallelState) -> None:
    if state.pipeline_model_parallel_size == 1 or not state.is_rank_in_embedding_group():
        return
    pair = _tied_pair(chunks)
    if pair is not None:
        a, b = _main_grad(pair[0]), _main_grad(pair[1])
        a.add_(b)
        b.copy_(a)
        return
    weight = _tied_weight(chunks, state)
    if weight is not None:
        dist.all_reduce(_main_grad(weight), group=state.embedding_group)


@torch.no_grad()
def finalize_model_grads(model_chunks, num_tokens: Optional[torch.Tensor] = None,
                         state: Optional[ps.ParallelState] = None, *, pg_collection=None,
                         force_all_reduce: bool = False) -> None:
    """Finish the DP reduction and the TP/PP gradient fix-ups of every chunk (Megatron's contract).

    ``num_tokens``: this rank's count of loss tokens (summed over its microbatches;
    on the last pipeline stage, identical across TP ranks). It is broadcast from the
    last stage over PP, summed over DP, and every gradient is divided by it; the
    chunks must have been built with ``config.calculate_per_token_loss=True``.
    The caller's tensor is not modified. ``state`` defaults to the global parallel state.
    Megatron's keywords ``pg_collection`` (None: the default groups) and ``force_all_reduce``
    (False) are accepted at those values only.
    """
    if pg_collection is not None or force_all_reduce:
        raise ValueError("finalize_model_grads: pg_collection and force_all_reduce=True are not supported; pass "
                         "state= (a parallel_state.ParallelState) for other groups")
    chunks = ddp_chunks(model_chunks, "finalize_model_grads")
    state = ps.resolve_parallel_state(state)
    if num_tokens is not None:
        bad = [i for i, c in enumerate(chunks) if not c.calculate_per_token_loss]
        if bad:
            raise ValueError(
                f"num_tokens was given but model chunks {bad} were wrapped without "
                "config.calculate_per_token_loss=True: their gradients are already averaged over DP"
            )

    for chunk in chunks:
        chunk.finish_grad_sync()
    update_fp8_scaling(chunks, chunks[0].dp_group)
    _allreduce_layernorm_grads(chunks, state)
    _allreduce_word_embedding_grads(chunks, state)
    if not getattr(chunks[0], "replicas_checked", False):  # the first step: values still initial, gradients final
        check_replicas(chunks, state, _tied_pair(chunks), _tied_weight(chunks, state))
        chunks[0].replicas_checked = True

    if num_tokens is not None:
        if not isinstance(num_tokens, torch.Tensor):
            raise TypeError(f"num_tokens must be a tensor, got {type(num_tokens).__name__}")
        total = num_tokens.detach().clone()
        if state.pipeline_model_parallel_size > 1:
            last = state.pipeline_rank_to_global(state.pipeline_model_parallel_size - 1)
            dist.broadcast(total, src=last, group=state.pipeline_model_parallel_group)
        dp_group = chunks[0].dp_group
        if dp_group is not None and chunks[0].dp_size > 1:
            dist.all_reduce(total, group=dp_group)
        count = float(total.item())
        if count > 0:
            for chunk in chunks:
                chunk.scale_gradients(1.0 / count)
