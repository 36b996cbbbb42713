"""What the canonical units of a model hold: names, full shapes and tensor-parallel splits.

The shapes are those of the whole model (TP=1) with the real vocabulary; ``shard`` and
``merge`` move between that and one TP rank's slice as parallel3d's layers lay it out
(``split_tensor_for_rank`` / ``merge_tensor_shards``, the vocabulary padded for TP).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from parallel3d.models.config import TransformerConfig
from parallel3d.tensor_parallel import merge_tensor_shards, split_tensor_for_rank


class ConversionError(ValueError):
    """A checkpoint or a requested layout that cannot be converted; the message says why."""


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]  # full tensor, real vocabulary
    partition_dim: Optional[int] = None  # None: replicated over TP
    stride: int = 1
    vocab: bool = False  # the partition dim is the vocabulary (padded for TP)

    @property
    def split(self) -> Optional[str]:
        """The ``tensor_parallel_splits`` entry of checkpoint files ("dim,stride"), None if replicated."""
        return None if self.partition_dim is None else f"{self.partition_dim},{self.stride}"

    def shard_shape(self, config: TransformerConfig) -> tuple[int, ...]:
        if self.partition_dim is None:
            return self.shape
        shape = list(self.shape)
        size = config.padded_vocab_size if self.vocab else shape[self.partition_dim]
        shape[self.partition_dim] = size // config.tensor_model_parallel_size
        return tuple(shape)


def embedding_specs(config: TransformerConfig) -> dict[str, ParamSpec]:
    h = config.hidden_size
    specs = {"embedding.word_embeddings.weight": ParamSpec((config.vocab_size, h), 0, 1, vocab=True)}
    if config.position_embedding_type == "learned_absolute":
        specs["embedding.position_embeddings.weight"] = ParamSpec((config.max_position_embeddings, h))
    return specs


def layer_specs(config: TransformerConfig) -> dict[str, ParamSpec]:
    """One transformer layer, names relative to ``decoder.layers.{i}.``, in state_dict order."""
    h, d, f = config.hidden_size, config.kv_channels, config.ffn_hidden_size
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * d
    norm_bias = config.normalization == "LayerNorm"
    bias = config.add_bias_linear
    gate = 2 if config.gated_linear_unit else 1
    specs = {"input_layernorm.weight": ParamSpec((h,))}
    if norm_bias:
        specs["input_layernorm.bias"] = ParamSpec((h,))
    specs["self_attention.linear_qkv.weight"] = ParamSpec((qkv, h), 0, 1)
    if bias or config.add_qkv_bias:
        specs["self_attention.linear_qkv.bias"] = ParamSpec((qkv,), 0, 1)
    specs["self_attention.linear_proj.weight"] = ParamSpec((h, config.num_attention_heads * d), 1, 1)
    if bias:
        specs["self_attention.linear_proj.bias"] = ParamSpec((h,))
    specs["pre_mlp_layernorm.weight"] = ParamSpec((h,))
    if norm_bias:
        specs["pre_mlp_layernorm.bias"] = ParamSpec((h,))
    specs["mlp.linear_fc1.weight"] = ParamSpec((gate * f, h), 0, gate)
    if bias:
        specs["mlp.linear_fc1.bias"] = ParamSpec((gate * f,), 0, gate)
    specs["mlp.linear_fc2.weight"] = ParamSpec((h, f), 1, 1)
    if bias:
        specs["mlp.linear_fc2.bias"] = ParamSpec((h,))
    return specs


def head_specs(config: TransformerConfig) -> dict[str, ParamSpec]:
    """Final norm and, when untied, the output layer (a tied one is the embedding)."""
    h = config.hidden_size
    specs = {"decoder.final_layernorm.weight": ParamSpec((h,))}
    if config.normalization == "LayerNorm":
        specs["decoder.final_layernorm.bias"] = ParamSpec((h,))
    if config.untie_embeddings_and_output_weights:
        specs["output_layer.weight"] = ParamSpec((config.vocab_size, h), 0, 1, vocab=True)
    return specs


def check_unit(where: str, tensors: dict[str, torch.Tensor], specs: dict[str, ParamSpec]) -> None:
    """Every expected tensor present with its full shape, nothing else."""
    missing = [k for k in specs if k not in tensors]
    extra = sorted(set(tensors) - set(specs))
    if missing or extra:
        raise ConversionError(f"{where}: " + "; ".join(
            ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else [])))
    for k, spec in specs.items():
        if tuple(tensors[k].shape) != spec.shape:
            raise ConversionError(f"{where}: {k} has shape {tuple(tensors[k].shape)}, the model config "
                                  f"implies {spec.shape}")


def shard(full: torch.Tensor, spec: ParamSpec, config: TransformerConfig, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of a full tensor under ``config``'s TP size (vocabulary padded with zeros)."""
    if spec.partition_dim is None:
        return full
    padded = config.padded_vocab_size if spec.vocab else None
    return split_tensor_for_rank(full, spec.partition_dim, spec.stride, tp_rank,
                                 config.tensor_model_parallel_size, padded_size=padded)


def merge(shards: Sequence[torch.Tensor], spec: ParamSpec, config: TransformerConfig) -> torch.Tensor:
    """The full tensor from every TP rank's slice (the vocabulary padding dropped)."""
    if spec.partition_dim is None:
        return shards[0]
    full = merge_tensor_shards(list(shards), spec.partition_dim, spec.stride)
    if spec.vocab:
        full = full.narrow(spec.partition_dim, 0, config.vocab_size)
    return full
