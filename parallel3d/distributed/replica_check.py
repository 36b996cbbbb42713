"""A first-step check that the copies which must agree do (called by ``finalize_model_grads``).

Two mistakes in a custom model train silently wrong, and both show at the first step:
- a replicated parameter (no ``tensor_model_parallel`` attribute) whose copies differ across TP
  ranks: a norm applied to a sequence-parallel shard but not marked ``.sequence_parallel = True``
  gets each rank's partial gradient (its copies drift apart from the first update on), and a
  parameter initialised from a per-rank seed starts apart;
- the tied embedding's two copies (first and last pipeline stage) initialised differently: the
  summed gradients then update two different matrices.

``finalize_model_grads`` runs it once, after the gradient reductions and before the optimizer
step: the parameters still hold their initial values and the gradients are final, so each copy
must equal its TP rank 0's (or the first stage's). Cost: one broadcast of the replicated parameters
and their gradients over TP, one of the tied weight over the embedding group, and two small
all-reduces; once per run.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d import parallel_state as ps

# Copies that must agree: the same initial values, and gradients summed (or computed) identically.
# The tolerance, relative to the largest magnitude of the tensor, only allows for reductions taken
# in another order; a wrong marking or seed differs by the gradient's or the value's own size.
_TOLERANCE = 1e-3


def _grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def _first_mismatch(tensors: list[torch.Tensor], group: dist.ProcessGroup, src: int, what: str) -> Optional[int]:
    """Index of the first tensor whose copy on some rank of ``group`` differs from rank ``src``'s
    (the same answer on every rank), or None."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    count = torch.tensor([flat.numel(), -flat.numel()], dtype=torch.int64, device=flat.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if count[0] != -count[1]:
        raise ValueError(f"the {what} differ in size across ranks {dist.get_process_group_ranks(group)} "
                         f"({-int(count[1])} to {int(count[0])} elements): every rank must build the same model")
    ref = flat.clone()
    dist.broadcast(ref, src=src, group=group)
    bad = torch.zeros(len(tensors), device=flat.device)
    offset = 0
    for i, t in enumerate(tensors):
        mine, theirs = flat[offset:offset + t.numel()], ref[offset:offset + t.numel()]
        offset += t.numel()
        if t.numel() and (mine - theirs).abs().max() > _TOLERANCE * theirs.abs().max():
            bad[i] = 1.0
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    hits = bad.nonzero()
    return int(hits[0]) if len(hits) else None


def _check_tensor_parallel_replicas(chunks: Sequence, state: ps.ParallelState) -> None:
    named = []  # (description, tensor): each replicated parameter's value and gradient
    for i, chunk in enumerate(chunks):
        for name, p in chunk.module.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                continue
            where = f"replicated parameter {name!r} (model chunk {i})"
            named.append((f"{where} has different values", p))
            grad = _grad(p)
            if p.requires_grad and grad is not None:
                named.append((f"{where} has different gradients", grad))
    if not named:
        return
    ranks = list(state.group_ranks["tp"])
    bad = _first_mismatch([t for _, t in named], state.tensor_model_parallel_group, ranks[0],
                          "replicated parameters")
    if bad is not None:
        raise ValueError(f"{named[bad][0]} on tensor-parallel ranks {ranks}: mark it .sequence_parallel = True if it "
                         "is applied to a sequence-parallel shard, initialise it from the same seed on every TP rank, "
                         "or mark it tensor_model_parallel if it is split across them")


_TIED_HINT = ("initialise the output layer's copy from the embedding's (Megatron: zero it on the last stage and "
              "all-reduce it over the embedding group), as docs/custom-models.md shows")


def check_replicas(chunks: Sequence, state: ps.ParallelState,
                   tied_pair: Optional[tuple[torch.Tensor, torch.Tensor]],
                   tied_weight: Optional[torch.Tensor]) -> None:
    """Raise one line naming the first parameter whose copies disagree (the same line on every rank).

    ``tied_pair``: both tied copies when this rank holds both ends (a V); ``tied_weight``: this rank's
    copy, shared with the other end of its pipeline over the embedding group (else None).
    """
    if state.tensor_model_parallel_size > 1:
        _check_tensor_parallel_replicas(chunks, state)
    if tied_pair is not None and (tied_pair[0] - tied_pair[1]).abs().max() > _TOLERANCE * tied_pair[0].abs().max():
        raise ValueError(f"the tied embedding and output weights differ (first and last stage, both on rank "
                         f"{state.rank}): {_TIED_HINT}")
    if tied_weight is not None:
        ranks = list(state.group_ranks["embedding"])
        if _first_mismatch([tied_weight], state.embedding_group, ranks[0], "tied embedding weights") is not None:
            raise ValueError(f"the tied embedding weight (shared_embedding_or_output_weight) differs between the "
                             f"first and the last pipeline stage (ranks {ranks}): {_TIED_HINT}")
