"""The application (Megatron's ``megatron/training``): arguments, the training loop and its typed
config, checkpoints and the Megatron run-time flags.

The core library (``parallel3d.parallel_state``, ``device``, ``tensor_parallel``, ``pipeline``,
``distributed``, ``data``, ``fused``, ``planning``, ``model_chunk``, ``progress``, ``bootstrap``)
never imports this package: embedding the core needs none of it. The loop's entry points (``training.py``
the loop, ``initialize.py`` the setup, ``data_iterators.py``, ``step.py``, ``evaluation.py``,
``training_logger.py``) are re-exported here: ``from parallel3d.training import pretrain``.
"""
from .data_iterators import build_data_iterators
from .evaluation import evaluate
from .initialize import get_model, get_optimizer_param_scheduler, initialize_distributed, is_last_rank, print_rank_0
from .step import LossAverager, train_step
from .training import pretrain
from .training_config import TrainingConfig
from .training_logger import TrainingLogger, model_flops, peak_tflops

__all__ = ["LossAverager", "TrainingConfig", "TrainingLogger", "build_data_iterators", "evaluate", "get_model",
           "get_optimizer_param_scheduler", "initialize_distributed", "is_last_rank", "model_flops", "peak_tflops",
           "pretrain", "print_rank_0", "train_step"]
