"""The transformer's normalization layer: LayerNorm or RMSNorm, fused or plain."""
from __future__ import annotations

import torch
from torch import nn

from parallel3d.device import default_device
from parallel3d.fused import (
    layer_norm,
    layer_norm_reference,
    layer_norm_with_residual,
    rms_norm,
    rms_norm_reference,
    rms_norm_with_residual,
)

from .config import TransformerConfig


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight) over the hidden dim, statistics in fp32."""

    def __init__(self, config: TransformerConfig, hidden_size: int):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.fused = config.normalization_fusion
        device, dtype = default_device(), config.params_dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        if self.rms:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        # Under SP a norm sees a sequence shard: its gradient must be summed over TP.
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return (rms_norm if self.fused else rms_norm_reference)(x, self.weight, self.eps)
        return (layer_norm if self.fused else layer_norm_reference)(x, self.weight, self.bias, self.eps)

    def with_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), x) for a pre-norm layer's residual: fused, x's two gradients are summed in the norm's
        backward kernel (fused.layer_norm_with_residual); unfused, autograd sums them as for any reuse of x."""
        if not self.fused:
            return self(x), x
        if self.rms:
            return rms_norm_with_residual(x, self.weight, self.eps)
        return layer_norm_with_residual(x, self.weight, self.bias, self.eps)
