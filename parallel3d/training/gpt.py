"""The GPT application's pieces (Megatron keeps them in ``pretrain_gpt.py``): the model's config from
the arguments, the layer split across pipeline stages, the model provider, the forward step and its
loss, the sampling flags, and the check that the data fits the vocabulary.

``examples/pretrain_gpt.py`` wires them into :func:`parallel3d.training.pretrain`; the tests and the
benchmarks use the same ones, so what they measure is what the example trains.
"""
from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Optional

import numpy as np
import torch

from parallel3d import parallel_state
from parallel3d.data import IndexedDataset
from parallel3d.data.blended_dataset import get_blend_from_list
from parallel3d.data.token_stats import check_tokens_fit_vocab
from parallel3d.device import default_device
from parallel3d.models import GPTModel, TransformerConfig
from parallel3d.models.config import megatron_activation
from parallel3d.pipeline.layout import LayoutError
from parallel3d.pipeline.layout import layer_partition as pipeline_layer_partition
from parallel3d.pipeline.registry import placement_of
from parallel3d.planning.compute import head_cost_in_layers
from parallel3d.training.arguments import ArgumentError


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """pretrain_gpt.py's own flags (its ``extra_args_provider``): a greedy sample after training."""
    g = parser.add_argument_group("example")
    g.add_argument("--sample-prompt", default=None, help="print a greedy continuation of this text at the end")
    g.add_argument("--sample-tokens", type=int, default=64, help="length of the --sample-prompt continuation")


def check_data_fits_vocab(data_path: list[str], vocab_size: int, tokenizer: str = "the tokenizer") -> None:
    """Data tokenized for another vocabulary is a wrong pairing: say so before training, naming the file
    (its token dtype, then its largest token id: recorded at preprocessing or scanned once and cached)."""
    prefixes, _ = get_blend_from_list(data_path)
    for prefix in prefixes:
        for path in (prefix + ".idx", prefix + ".bin"):
            if not os.path.isfile(path):
                raise ArgumentError(f"--data-path: missing file {path}")
        dtype = IndexedDataset(prefix).dtype
        if np.iinfo(dtype).max < vocab_size - 1:
            raise ArgumentError(f"--data-path {prefix}: tokens are stored as {np.dtype(dtype).name}, which cannot "
                                f"hold the tokenizer's vocabulary of {vocab_size}; re-run tools/preprocess_data.py "
                                "with this tokenizer")
        try:
            check_tokens_fit_vocab(prefix, dtype, vocab_size, tokenizer)
        except ValueError as e:
            raise ArgumentError(f"--data-path: {e}") from None


# --------------------------------------------------------------------------------------- model


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size, seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation=megatron_activation(args.swiglu, args.openai_gelu, args.bias_gelu_fusion,
                                       not args.disable_bias_linear),
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, seed=args.seed,
        **parallel_state.model_parallel_sizes(args), sequence_parallel=args.sequence_parallel,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method or "uniform",
        recompute_num_layers=args.recompute_num_layers or 1, bf16=args.bf16, fp16=args.fp16,
        attention_backend=args.attention_backend, gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,  # Megatron's rule
        bias_dropout_fusion=args.bias_dropout_fusion, masked_softmax_fusion=args.masked_softmax_fusion,
        apply_rope_fusion=args.apply_rope_fusion, compile_layers=args.compile, compile_backend=args.compile_backend,
        enable_cuda_graph=args.enable_cuda_graph, cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        calculate_per_token_loss=args.calculate_per_token_loss,
        fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
        fp8_amax_history_len=args.fp8_amax_history_len, fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        fp8_wgrad=args.fp8_wgrad,
    )


def layer_partition(args: argparse.Namespace, config: Optional[TransformerConfig] = None) -> list[list[range]]:
    """result[pp_rank][chunk]: the global layers of each (virtual) pipeline stage.

    ``config``: the model's, whose padded vocabulary weighs the output layer in the balanced split
    (without it: --vocab-size)."""
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if vp != 1 and (first is not None or last is not None):
        raise ArgumentError("--decoder-first/last-pipeline-num-layers need one chunk per pipeline rank")
    vocab = config.padded_vocab_size if config is not None else args.vocab_size
    head = head_cost_in_layers(args.hidden_size, args.seq_length, vocab, args.tensor_model_parallel_size > 1)
    try:
        return pipeline_layer_partition(
            args.num_layers, pp, vp, placement_of(args.pipeline_schedule, vp),
            layout=args.pipeline_model_parallel_layout, first_stage_layers=first, last_stage_layers=last,
            account_for_embedding=args.account_for_embedding_in_pipeline_split,
            account_for_loss=args.account_for_loss_in_pipeline_split, split=args.pipeline_split,
            head_cost=head)
    except LayoutError as e:
        raise ArgumentError(str(e)) from None


def model_provider(config: TransformerConfig, partition: list[list[range]], pre_process: bool, post_process: bool,
                   vp_stage: int) -> GPTModel:
    layers = partition[parallel_state.resolve_parallel_state().pipeline_model_parallel_rank][vp_stage]
    return GPTModel(config, pre_process=pre_process, post_process=post_process, layer_numbers=layers)


# --------------------------------------------------------------------------------------- steps


def loss_func(loss_mask: torch.Tensor, per_token: bool, output_tensor: torch.Tensor):
    """Mean of the per-token losses over the tokens that count (Megatron's loss_func)."""
    mask = loss_mask.float().reshape(-1)
    total = (output_tensor.float().reshape(-1) * mask).sum()
    count = mask.sum()
    if per_token:
        return total, count.to(torch.int64), {"lm loss": (total.detach(), count.detach())}
    loss = total / count.clamp(min=1)
    return loss, {"lm loss": loss.detach()}


def forward_step(per_token: bool, data_iterator, model):
    """Megatron's contract: (output, loss_func). Middle stages read no data."""
    dev = default_device()
    batch = next(data_iterator) if (model.pre_process or model.post_process) else None
    tokens = batch["tokens"].to(dev) if batch is not None and model.pre_process else None
    position_ids = batch["position_ids"].to(dev) if batch is not None else None
    labels = batch["labels"].to(dev) if batch is not None and model.post_process else None
    output = model(tokens, position_ids, labels=labels)
    loss_mask = batch["loss_mask"].to(dev) if labels is not None else None
    return output, partial(loss_func, loss_mask, per_token)
