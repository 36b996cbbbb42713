"""The MLP: column-parallel fc1, activation (fused where a kernel exists), row-parallel fc2."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d.fused import bias_gelu, bias_gelu_reference, bias_swiglu, bias_swiglu_reference
from parallel3d.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
    scaled_init_method_normal,
)

from .config import TransformerConfig


def _activation_fn(config: TransformerConfig) -> Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]:
    """act(x + bias), or act(gate) * up for a gated unit; the fused wrapper where one exists."""
    fused = config.bias_activation_fusion
    if config.swiglu:
        return bias_swiglu if fused else bias_swiglu_reference
    if config.activation in ("gelu", "gelu_tanh") and not config.gated_linear_unit:
        return functools.partial(bias_gelu if fused else bias_gelu_reference,
                                 approximate="tanh" if config.activation == "gelu_tanh" else "none")
    # The rest (GeGLU, a non-gated SiLU) has no kernel: plain PyTorch.
    act = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu}[config.activation]

    def plain(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x = x if bias is None else x + bias
        if config.gated_linear_unit:
            gate, up = torch.chunk(x, 2, dim=-1)
            return act(gate) * up
        return act(x)

    return plain


class MLP(nn.Module):
    """linear_fc1 (column-parallel, [gate; up] with a gated unit) -> activation -> linear_fc2 (row-parallel)."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        common = dict(config.linear_kwargs(tp_group), skip_bias_add=True, bias=config.add_bias_linear)
        gated = config.gated_linear_unit
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size * (2 if gated else 1), gather_output=False,
            init_method=init_method_normal(config.init_method_std), stride=2 if gated else 1, **common,
        )
        self.activation = _activation_fn(config)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers), **common,
        )

    def forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        return self.linear_fc2(self.activation(intermediate, bias))
