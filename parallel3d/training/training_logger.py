"""The training log: each interval's losses, throughput, MFU and memory on the console, --log-json,
TensorBoard and Weights & Biases (the last rank writes, as in Megatron)."""
from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from typing import Any, Optional

import torch

from parallel3d import progress
from parallel3d.planning.hardware import DATASHEET_PEAK_TFLOPS
from parallel3d.training.initialize import is_last_rank
from parallel3d.training.log_sinks import TensorBoardSink, WandbSink
from parallel3d.training.training_config import TrainingConfig, as_training_config


def model_flops(model_config: Any, batch_size: int) -> Optional[float]:
    """Model FLOPs of one iteration, when the model config can count them (TransformerConfig does)."""
    count = getattr(model_config, "num_floating_point_operations", None)
    return count(batch_size) if count is not None else None


def peak_tflops(args: Any) -> Optional[float]:
    """``args.peak_tflops`` (the logging config's, or the arguments'), else the card's datasheet figure."""
    if args.peak_tflops:
        return args.peak_tflops
    return DATASHEET_PEAK_TFLOPS.get(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


class TrainingLogger:
    """Interval logging: console (with a progress bar on a terminal), --log-json, TensorBoard."""

    def __init__(self, config: TrainingConfig | argparse.Namespace, start_iteration: int = 0, model_config: Any = None):
        self.config, self.model_config = as_training_config(config), model_config
        args = self.config.logging
        self.active = is_last_rank()  # the last rank holds the losses (Megatron logs there too)
        self.json = open(args.log_json, "a") if (self.active and args.log_json) else None
        self.tb = TensorBoardSink(args.tensorboard_dir) \
            if (self.active and args.tensorboard_dir) else None
        self.wandb = WandbSink(args, self.config.run_args()) \
            if (self.active and args.wandb_project) else None
        self.bar = (progress.make_bar(self.config.loop.train_iters, "training", stream=sys.stdout,
                                      initial=start_iteration)
                    if self.active and not args.no_progress_bar else None)
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.iters = 0
        self.skipped = 0
        self.sums: dict[str, float] = {}

    def record(self, loss: dict[str, float], skipped: bool) -> None:
        self.iters += 1
        self.skipped += int(skipped)
        if self.bar is not None:
            self.bar.update(1)
        for k, v in loss.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def write(self, record: dict[str, Any]) -> None:
        if self.wandb:
            self.wandb.log(record)
        if self.json:
            self.json.write(json.dumps(record) + "\n")
            self.json.flush()

    def log(self, iteration: int, lr: float, grad_norm: Optional[float], loss_scale: Optional[float],
            layout: Any = None, consumed_samples: Optional[int] = None) -> None:
        """``layout``: the logged iteration's (its batch, under --rampup-batch-size); default the config's.
        ``consumed_samples``: after this iteration (TensorBoard's "vs samples" tags)."""
        layout = layout or self.config.layout
        train_iters = self.config.loop.train_iters
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.t0
        per_iter = elapsed / max(self.iters, 1)
        tokens_per_s = layout.global_batch_size * layout.seq_length / per_iter
        flops = model_flops(self.model_config, layout.global_batch_size)
        tflops = flops / per_iter / layout.world_size / 1e12 if flops is not None else None
        peak = peak_tflops(self.config.logging)
        mem_gb = (torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available()
                  else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20)  # ru_maxrss: KiB on Linux
        loss = {k: v / max(self.iters, 1) for k, v in self.sums.items()}
        record = {"type": "train", "iteration": iteration, "loss": loss.get("lm loss", next(iter(loss.values()), float("nan"))),
                  "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "tokens_per_s_per_gpu": tokens_per_s / layout.world_size, "tflops_per_gpu": tflops,
                  "mfu": tflops / peak if peak and tflops is not None else None, "iteration_time_s": per_iter,
                  "memory_gb": mem_gb, "skipped_iterations": self.skipped, "loss_scale": loss_scale}
        if self.active:
            self.write(record)
            if self.tb:
                self.tb.log_train(record, loss, consumed_samples, layout.global_batch_size)
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            mfu = f" | MFU {100 * record['mfu']:.1f}%" if record["mfu"] else ""
            gn = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
            tf = f"{tflops:.1f}" if tflops is not None else "n/a"  # n/a: a model config without a FLOPs count
            tf = f" | {tf} TFLOP/s/GPU{mfu}" if torch.cuda.is_available() else ""  # CPU processes: no GPU to rate
            progress.emit(self.bar, f"iteration {iteration:6d}/{train_iters} | loss {record['loss']:.4f} | lr {lr:.3e} | "
                  f"grad norm {gn} | {per_iter * 1000:.0f} ms/it | {tokens_per_s:,.0f} tokens/s"
                  f"{tf} | mem {mem_gb:.2f} GB"
                  + (f" | skipped {self.skipped}" if self.skipped else ""))
        self.reset()

    def log_eval(self, iteration: int, losses: dict[str, float], consumed_samples: Optional[int] = None,
                 split: str = "validation", final: bool = False) -> None:
        """``split``: "validation" or "test"; ``final``: the evaluation after the last iteration."""
        if not self.active:
            return
        if self.tb:
            self.tb.log_eval(iteration, losses, consumed_samples, split)
        loss = losses.get("lm loss", next(iter(losses.values()), float("nan")))
        ppl = math.exp(min(loss, 20.0))
        when = f"the end of training, iteration {iteration}" if final else f"iteration {iteration}"
        progress.emit(self.bar, f"{split} at {when} | lm loss {loss:.4f} | perplexity {ppl:.2f}")
        self.write({"type": "eval", "split": split, "iteration": iteration, "eval_loss": loss,
                    "eval_perplexity": ppl})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.json:
            self.json.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.close()
