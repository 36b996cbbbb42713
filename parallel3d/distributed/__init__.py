"""Data parallelism and the optimizer (Megatron's ``megatron.core.distributed`` and ``megatron.core.optimizer``).

- ``DistributedDataParallel``: contiguous gradient buffers, bucketed all-reduce /
  reduce-scatter overlapped with backward, ``no_sync`` for gradient accumulation;
- ``finalize_model_grads``: DP sync, sequence-parallel and tied-embedding fix-ups,
  per-token loss scaling, once per iteration before the optimizer step;
- ``get_megatron_optimizer``: fp32, mixed precision with fp32 masters, or ZeRO-1;
  with gradient clipping over TP/PP/DP and fp16 loss scaling;
- ``OptimizerParamScheduler``: learning-rate warmup and decay.
"""
from .clip_grads import (
    clip_grad_by_total_norm_fp32,
    clip_grad_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    param_is_counted_in_grad_norm,
)
from .ddp import DistributedDataParallel, DistributedDataParallelConfig
from .distributed_optimizer import DistributedOptimizer, get_megatron_optimizer
from .finalize_model_grads import finalize_model_grads
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .lr_scheduler import OptimizerParamScheduler
from .optimizer import (
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    OptimizerConfig,
)
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = [
    "Bucket", "ConstantGradScaler", "DistributedDataParallel", "DistributedDataParallelConfig",
    "DistributedOptimizer", "DynamicGradScaler", "FP32Optimizer", "MegatronOptimizer", "MixedPrecisionOptimizer",
    "OptimizerConfig", "OptimizerParamScheduler", "ParamAndGradBuffer", "clip_grad_by_total_norm_fp32",
    "clip_grad_norm_fp32", "count_zeros_fp32", "finalize_model_grads", "get_grad_norm_fp32",
    "get_megatron_optimizer", "param_is_counted_in_grad_norm",
]
