"""The model contract: what parallel3d's lower layers may call on a model chunk.

A model chunk is the part of the model one (virtual) pipeline stage holds. The pipeline executor,
``DistributedDataParallel``, ``finalize_model_grads``, the optimizers and checkpointing call only
what :class:`PipelineChunk` names, never a model's own fields; ``models.GPTModel`` is one
implementation, ``examples/custom_model_tp.py`` another. Every member has a default, so a plain
``nn.Module`` is a valid one-stage chunk:

- ``pre_process`` / ``post_process`` (default True): the chunk holds the first / last stage
  (embedding / output layer and loss); a non-first chunk takes its input from ``set_input_tensor``;
- ``set_input_tensor(tensor_or_tuple_or_None)``: called before each forward with what the
  previous stage sent (None on the first stage); needed on every non-first stage;
- ``share_embeddings_and_output_weights`` (default False) and
  ``shared_embedding_or_output_weight()``: a weight the first and the last stage both hold
  (the tied word embedding): its gradients are summed over the embedding group, it is counted
  once in the gradient norm, and ZeRO-1 keeps it in its own bucket;
- ``config`` (optional): Megatron's model config, read for what Megatron's schedules read from it
  (``hidden_size``, ``sequence_parallel``, ``pipeline_dtype`` or ``params_dtype``,
  ``calculate_per_token_loss``, ``finalize_model_grads_func``, ...: docs/custom-models.md lists them).

The ``model_config`` handed to checkpointing may define ``checkpoint_mismatches(saved: dict)
-> list[str]`` (see :class:`CheckpointableConfig`): a checkpoint of another model is refused with them.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class PipelineChunk(Protocol):
    pre_process: bool
    post_process: bool
    share_embeddings_and_output_weights: bool

    def set_input_tensor(self, input_tensor: Any) -> None: ...

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]: ...


@runtime_checkable
class CheckpointableConfig(Protocol):
    def checkpoint_mismatches(self, saved: dict[str, Any]) -> list[str]: ...


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside a wrapper (DistributedDataParallel's ``module``), or the chunk itself."""
    return getattr(chunk, "module", chunk)


def is_first_stage_chunk(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "pre_process", True))


def is_last_stage_chunk(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "post_process", True))


def set_input(module: torch.nn.Module, input_tensor: Any) -> None:
    """Hand a chunk what the previous stage sent (None on the first stage)."""
    set_input_tensor = getattr(module, "set_input_tensor", None)
    if set_input_tensor is not None:
        set_input_tensor(input_tensor)
    elif input_tensor is not None:
        raise TypeError("a model chunk of a non-first pipeline stage must define set_input_tensor()")


def shared_weight(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The chunk's weight shared between the first and last stage, or None."""
    if not getattr(module, "share_embeddings_and_output_weights", False):
        return None
    get = getattr(module, "shared_embedding_or_output_weight", None)
    return get() if get is not None else None
