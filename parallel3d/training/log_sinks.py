"""Where the training log goes besides the console and --log-json: ``--wandb-project`` (Weights & Biases) and
``--tensorboard-dir`` (TensorBoard, Megatron's tag names), refused before any work where the package is not
installed.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Optional

_WANDB_MISSING = ("--wandb-project needs the wandb package: pip install wandb (or pip install 'parallel3d[wandb]'), "
                  "or drop --wandb-project")


class WandbSink:
    """--wandb-project: every --log-json record goes to a wandb run too."""

    def __init__(self, logging: Any, run_args: dict[str, Any]) -> None:
        """``logging``: training_config.LoggingConfig (or the arguments); ``run_args``: every argument, the
        run's config in wandb."""
        try:
            import wandb
        except ImportError:
            raise ImportError(_WANDB_MISSING) from None
        self.run = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name, dir=logging.wandb_save_dir,
                              config={k: v for k, v in run_args.items() if isinstance(v, (int, float, str, bool))})

    def log(self, record: dict[str, Any]) -> None:
        prefix = "train/" if record.get("type") != "eval" else "test/" if record.get("split") == "test" else "eval/"
        values = {prefix + k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}
        self.run.log(values, step=record["iteration"])

    def close(self) -> None:
        self.run.finish()


_TENSORBOARD_MISSING = ("--tensorboard-dir needs the tensorboard package: pip install tensorboard (or pip install "
                        "'parallel3d[tensorboard]'), or drop --tensorboard-dir")


class TensorBoardSink:
    """--tensorboard-dir with Megatron's tag names (its training_log and evaluate_and_print_results: "lm loss",
    "learning-rate", "lm loss validation", ..., most also "<tag> vs samples"), so Megatron's dashboards read it."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(_TENSORBOARD_MISSING) from None
        self.writer = SummaryWriter(log_dir)

    def _add(self, tag: str, value: Optional[float], iteration: int, samples: Optional[int]) -> None:
        if value is None:
            return
        self.writer.add_scalar(tag, value, iteration)
        if samples is not None:
            self.writer.add_scalar(tag + " vs samples", value, samples)

    def log_train(self, record: dict[str, Any], losses: dict[str, float], samples: Optional[int],
                  batch_size: int) -> None:
        """``record``: TrainingLogger's train record; ``losses``: the interval's mean of each reported loss."""
        it = record["iteration"]
        self._add("learning-rate", record["lr"], it, samples)
        self._add("batch-size", batch_size, it, samples)
        for key, value in losses.items():
            self._add(key, value, it, samples)
        self._add("loss-scale", record["loss_scale"], it, samples)
        self._add("grad-norm", record["grad_norm"], it, samples)
        self._add("iteration-time", record["iteration_time_s"], it, None)
        self._add("throughput", record["tflops_per_gpu"], it, None)  # TFLOP/s per GPU
        self._add("mem-max-allocated-bytes", record["memory_gb"] * 2 ** 30, it, None)

    def log_eval(self, iteration: int, losses: dict[str, float], samples: Optional[int],
                 split: str = "validation") -> None:
        """Megatron's "<key> validation" tags; the final test-set losses under "<key> test", apart from the
        validation curve."""
        for key, value in losses.items():
            self._add(f"{key} {split}", value, iteration, samples)
            self._add(f"{key} {split} ppl", math.exp(min(20.0, value)), iteration, samples)

    def close(self) -> None:
        self.writer.close()


def check_logging_available(args: argparse.Namespace) -> None:
    """Refuse --wandb-project / --tensorboard-dir before any work when their package is not installed (not a
    warning hours later, nor a run without the logs asked for)."""
    import importlib.util

    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ImportError(_WANDB_MISSING)
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ImportError(_TENSORBOARD_MISSING)
