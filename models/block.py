"""A pre-norm transformer layer and the block of layers one model chunk holds (with recompute)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel3d import tensor_parallel
from parallel3d.fused import bias_dropout_add

from .attention import InferenceParams, SelfAttention
from .config import TransformerConfig
from .mlp import MLP
from .ops import Norm, dropout_rng, init_rng, plain_bias_dropout_add


class TransformerLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then x + mlp(norm(x)), each with bias-dropout-add."""

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.config = config
        self.layer_number = layer_number  # global, 1-based (Megatron's)
        self.input_layernorm = Norm(config, config.hidden_size)
        self.self_attention = SelfAttention(config, layer_number, tp_group)
        self.pre_mlp_layernorm = Norm(config, config.hidden_size)
        self.mlp = MLP(config, tp_group)
        self.bias_dropout_add = bias_dropout_add if config.bias_dropout_fusion else plain_bias_dropout_add

    def _residual(self, out_with_bias, residual: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        out, bias = out_with_bias
        with dropout_rng(cfg.sequence_parallel, self.training and cfg.hidden_dropout > 0):
            return self.bias_dropout_add(out, bias, residual, cfg.hidden_dropout, self.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor],
                inference_params: Optional[InferenceParams] = None) -> torch.Tensor:
        post_ln_residual = self.config.apply_residual_connection_post_layernorm
        normed = self.input_layernorm(hidden_states)
        attention = self.self_attention(normed, attention_mask, rotary_pos_emb, inference_params)
        hidden_states = self._residual(attention, normed if post_ln_residual else hidden_states)
        normed = self.pre_mlp_layernorm(hidden_states)
        return self._residual(self.mlp(normed), normed if post_ln_residual else hidden_states)

    def forward_pieces(self, pieces: list[torch.Tensor], masks: list[Optional[torch.Tensor]],
                       rotary_pos_emb: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """``forward`` of independent pieces of the batch, ordered so that each piece's TP collectives run
        beside the other pieces' GEMMs: every piece's input gather is started before the first GEMM, and
        each row-parallel reduction is awaited only after the next piece's GEMMs were queued."""
        post_ln = self.config.apply_residual_connection_post_layernorm
        attention, mlp = self.self_attention, self.mlp
        normed, gathers = [], []
        for x in pieces:
            normed.append(self.input_layernorm(x))
            gathers.append(attention.linear_qkv.start_input_gather(normed[-1]))
        started = [attention(n, m, rotary_pos_emb, gathered=g, start_reduction=True)
                   for n, m, g in zip(normed, masks, gathers)]
        residuals, normed_mlp, gathers = [], [], []
        for x, n, (pending, bias) in zip(pieces, normed, started):
            h = self._residual((pending.wait(), bias), n if post_ln else x)
            residuals.append(h)
            normed_mlp.append(self.pre_mlp_layernorm(h))
            gathers.append(mlp.linear_fc1.start_input_gather(normed_mlp[-1]))
        started = [mlp(n, gathered=g, start_reduction=True) for n, g in zip(normed_mlp, gathers)]
        return [self._residual((pending.wait(), bias), n if post_ln else h)
                for h, n, (pending, bias) in zip(residuals, normed_mlp, started)]


def compile_layer(layer: nn.Module, config: TransformerConfig) -> None:
    """torch.compile one layer in place (its parameter names and state dict stay the same)."""
    if config.compile_backend == "inductor" and (config.hidden_dropout > 0 or config.attention_dropout > 0):
        # Dropout then draws eager's random numbers: the same masks as without --compile, from the
        # stream the RNG tracker has forked (process-wide, as it is set once for the compiled code).
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    layer.compile(backend=config.compile_backend)


class TransformerBlock(nn.Module):
    """The layers of one model chunk (global indices ``layer_numbers``) and, on the last, the final norm."""

    def __init__(self, config: TransformerConfig, layer_numbers: range, post_process: bool,
                 tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.config = config
        layers = []
        for index in layer_numbers:
            with init_rng(config.seed, f"decoder.layers.{index}"):
                layers.append(TransformerLayer(config, index + 1, tp_group))
        self.layers = nn.ModuleList(layers)
        if config.compile_layers:
            for layer in layers:
                compile_layer(layer, config)
        self.final_layernorm = Norm(config, config.hidden_size) if post_process else None

    def _run(self, start: int, end: int) -> Callable:
        def run(hidden_states, attention_mask, rotary_pos_emb, inference_params=None):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb, inference_params)
            return hidden_states

        return run

    def _run_pieces(self, start: int, end: int) -> Callable:
        """``_run`` for a batch in pieces: takes and returns the pieces as one tuple (so recompute can wrap it)."""
        def run(attention_mask, rotary_pos_emb, *pieces):
            pieces = list(pieces)
            masks = _mask_pieces(attention_mask, len(pieces))
            for layer in self.layers[start:end]:
                pieces = layer.forward_pieces(pieces, masks, rotary_pos_emb)
            return tuple(pieces)

        return run

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor],
                inference_params: Optional[InferenceParams] = None) -> torch.Tensor:
        cfg, n = self.config, len(self.layers)
        k = overlap_pieces(cfg, hidden_states.size(1), self.training and inference_params is None)[0]
        if cfg.recompute_granularity == "full" and self.training and inference_params is None:
            hidden_states = self._recompute(hidden_states, attention_mask, rotary_pos_emb, k)
        elif k > 1:  # [s, b, h] as k pieces of b / k sequences; one tensor again after the last layer
            pieces = [p.contiguous() for p in hidden_states.chunk(k, dim=1)]
            hidden_states = torch.cat(self._run_pieces(0, n)(attention_mask, rotary_pos_emb, *pieces), dim=1)
        else:
            hidden_states = self._run(0, n)(hidden_states, attention_mask, rotary_pos_emb, inference_params)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _recompute(self, hidden_states, attention_mask, rotary_pos_emb, k: int):
        """Full recomputation: "uniform" keeps only the input of every group of recompute_num_layers layers,
        "block" recomputes the first recompute_num_layers layers of the chunk and keeps the rest."""
        cfg, n = self.config, len(self.layers)
        r = cfg.recompute_num_layers
        spans = ([(start, min(start + r, n)) for start in range(0, n, r)] if cfg.recompute_method == "uniform"
                 else [(i, i + 1) for i in range(min(r, n))])
        kept = None if cfg.recompute_method == "uniform" else (min(r, n), n)
        if k == 1:
            for start, end in spans:
                hidden_states = tensor_parallel.checkpoint(self._run(start, end), hidden_states, attention_mask,
                                                           rotary_pos_emb)
            return hidden_states if kept is None else self._run(*kept)(hidden_states, attention_mask, rotary_pos_emb)
        pieces = tuple(p.contiguous() for p in hidden_states.chunk(k, dim=1))
        for start, end in spans:
            pieces = tensor_parallel.checkpoint(self._run_pieces(start, end), attention_mask, rotary_pos_emb, *pieces)
        if kept is not None:
            pieces = self._run_pieces(*kept)(attention_mask, rotary_pos_emb, *pieces)
        return torch.cat(pieces, dim=1)


def overlap_pieces(config: TransformerConfig, micro_batch_size: int, training: bool) -> tuple[int, str]:
    """(pieces, why): how many batch pieces a layer runs as under ``tp_comm_overlap`` (1: whole)."""
    k = config.tp_comm_overlap_pieces
    why = None
    if not config.tp_comm_overlap or config.tensor_model_parallel_size == 1:
        why = "off"
    elif not training:
        why = "off outside training (evaluation, generation)"
    elif config.hidden_dropout > 0 or config.attention_dropout > 0:
        why = "off: dropout > 0 (a piece would draw other masks than the whole batch)"
    elif config.compile_layers:
        why = "off: --compile compiles the whole layer"
    elif k < 2 or micro_batch_size % k != 0:
        why = f"off: the micro-batch ({micro_batch_size}) does not split into {k} pieces"
    if why is not None:
        return 1, "TP communication overlap: " + why
    return k, f"TP communication overlap: on, {k} batch pieces per layer"


def _mask_pieces(attention_mask: Optional[torch.Tensor], k: int) -> list[Optional[torch.Tensor]]:
    """The attention mask [b or 1, 1, s, s] of each of k batch pieces."""
    if attention_mask is None or attention_mask.size(0) == 1:
        return [attention_mask] * k
    return list(attention_mask.chunk(k, dim=0))
