"""A pre-norm transformer layer and the block of layers one model chunk holds (with recompute)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from parallel3d import tensor_parallel
from parallel3d.fused import bias_dropout_add, bias_dropout_add_reference

from .attention import InferenceParams, SelfAttention
from .config import TransformerConfig
from .mlp import MLP
from .norm import Norm
from .rng import dropout_rng, init_rng


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
        self.bias_dropout_add = bias_dropout_add if config.bias_dropout_fusion else bias_dropout_add_reference

    def _residual(self, out_with_bias, residual: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        out, bias = out_with_bias
        with dropout_rng(cfg.sequence_parallel, self.training and cfg.hidden_dropout > 0):
            return self.bias_dropout_add(out, bias, residual, cfg.hidden_dropout, self.training)

    def _norm(self, norm: Norm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed input of a sub-block, the residual added back after it)."""
        if self.config.apply_residual_connection_post_layernorm:
            normed = norm(x)
            return normed, normed
        return norm.with_residual(x)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor],
                inference_params: Optional[InferenceParams] = None) -> torch.Tensor:
        normed, residual = self._norm(self.input_layernorm, hidden_states)
        attention = self.self_attention(normed, attention_mask, rotary_pos_emb, inference_params)
        normed, residual = self._norm(self.pre_mlp_layernorm, self._residual(attention, residual))
        return self._residual(self.mlp(normed), residual)


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
        # --enable-cuda-graph: the forwards in flight, counted in the warm-up steps, then the captured layers
        # (parallel3d.training.cuda_graphs: InFlight, LayerGraphs); a plain attribute, not a submodule, so the
        # state dict is the same with and without.
        self.__dict__["cuda_graphs"] = None

    def _run(self, start: int, end: int) -> Callable:
        def run(hidden_states, attention_mask, rotary_pos_emb, inference_params=None):
            graphs = self.cuda_graphs if self.training else None
            ticket = graphs.begin(hidden_states, attention_mask, rotary_pos_emb, inference_params) if graphs else None
            for index in range(start, end):
                if ticket is not None and ticket.slot is not None:
                    hidden_states = graphs.layer(ticket.slot, index, hidden_states)
                else:
                    hidden_states = self.layers[index](hidden_states, attention_mask, rotary_pos_emb,
                                                       inference_params)
            return graphs.end(ticket, hidden_states) if ticket is not None else hidden_states

        return run

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor],
                inference_params: Optional[InferenceParams] = None) -> torch.Tensor:
        cfg, n = self.config, len(self.layers)
        if cfg.recompute_granularity == "full" and self.training and inference_params is None:
            k = cfg.recompute_num_layers
            if cfg.recompute_method == "uniform":  # every group of k layers keeps only its input
                for start in range(0, n, k):
                    hidden_states = tensor_parallel.checkpoint(
                        self._run(start, min(start + k, n)), False, hidden_states, attention_mask, rotary_pos_emb)
            else:  # "block": the first k layers of the chunk are recomputed, the rest keep activations
                for i in range(min(k, n)):
                    hidden_states = tensor_parallel.checkpoint(
                        self._run(i, i + 1), False, hidden_states, attention_mask, rotary_pos_emb)
                hidden_states = self._run(min(k, n), n)(hidden_states, attention_mask, rotary_pos_emb)
        else:
            hidden_states = self._run(0, n)(hidden_states, attention_mask, rotary_pos_emb, inference_params)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
