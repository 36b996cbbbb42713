"""Small residual MLP blocks shared by the DDP and optimizer tests: a TP one and its dense twin."""
import torch
import torch.nn.functional as F
from torch import nn

from parallel3d import tensor_parallel as tp

H, FFN = 16, 32
CPU = torch.device("cpu")


class ParallelBlock(nn.Module):
    """x + Row(GeLU(Column(LayerNorm(x)))); the LayerNorm is SP-flagged under sequence parallelism."""

    def __init__(self, sp: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.norm = nn.LayerNorm(H, dtype=dtype)
        for p in self.norm.parameters():
            p.sequence_parallel = sp
        self.fc1 = tp.ColumnParallelLinear(H, FFN, sequence_parallel=sp, params_dtype=dtype, device=CPU)
        self.fc2 = tp.RowParallelLinear(FFN, H, sequence_parallel=sp, params_dtype=dtype, device=CPU)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))[0]))[0]


class DenseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, FFN), nn.Linear(FFN, H)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))
