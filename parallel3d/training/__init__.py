"""The application (Megatron's ``megatron/training``): arguments, the training loop and its typed
config, checkpoints and the Megatron run-time flags.

The core library (``parallel3d.parallel_state``, ``device``, ``tensor_parallel``, ``pipeline``,
``distributed``, ``data``, ``fused``, ``planning``, ``model_chunk``, ``progress``, ``bootstrap``)
never imports this package: embedding the core needs none of it. The loop's entry points
(``parallel3d.training.training``) are re-exported here: ``from parallel3d.training import pretrain``.
"""
from .training import (
    LossAverager,
    TrainingLogger,
    build_data_iterators,
    evaluate,
    get_model,
    get_optimizer_param_scheduler,
    initialize_distributed,
    is_last_rank,
    model_flops,
    peak_tflops,
    pretrain,
    print_rank_0,
    train_step,
)
from .training_config import TrainingConfig

__all__ = ["LossAverager", "TrainingConfig", "TrainingLogger", "build_data_iterators", "evaluate", "get_model",
           "get_optimizer_param_scheduler", "initialize_distributed", "is_last_rank", "model_flops", "peak_tflops",
           "pretrain", "print_rank_0", "train_step"]
