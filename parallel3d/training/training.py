"""The training loop (Megatron's ``pretrain``), for any TP x PP (x virtual) x DP layout.

    pretrain(config, model_provider, forward_step_func, datasets_provider, model_config=...)

``config``: a :class:`~parallel3d.training.training_config.TrainingConfig` (or the validated arguments,
converted once);

- ``model_provider(pre_process, post_process, vp_stage) -> nn.Module``: one model chunk;
- ``forward_step_func(data_iterator, model) -> (output, loss_func)``: Megatron's contract;
- ``datasets_provider(train_valid_test_num_samples) -> (train, valid, test)``.

One iteration: zero the gradient buffers, run the pipeline schedule over
``num_microbatches`` (gradients reduced across DP while backward runs), finalise
gradients (tied embeddings, sequence-parallel norms), step the optimizer
(clipping, fp16 loss scaling), step the LR schedule, log, evaluate, save.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import resource
import sys
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d import parallel_state, progress
from parallel3d.training import checkpointing, megatron_runtime
from parallel3d.device import default_backend, default_device
from parallel3d.distributed_timeout import CommunicationError, prepare_process_groups, start_watchdog, waiting_for
from parallel3d.data import build_pretraining_data_loader
from parallel3d.distributed import DistributedDataParallel, OptimizerParamScheduler, finalize_model_grads, \
    get_megatron_optimizer
from parallel3d.pipeline import forward_backward
from parallel3d.planning.hardware import datasheet_peak_tflops
from parallel3d.pipeline.schedules import placement_of, virtual_stage
from parallel3d.tensor_parallel import model_parallel_cuda_manual_seed
from parallel3d.training.checkpoint_lock import save_dir_guard
from parallel3d.training.megatron_args import samples_consumed
from parallel3d.training.training_config import TrainingConfig, as_training_config
from parallel3d.training.training_guards import ExitSignalHandler, StepGuard

def print_rank_0(*args: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


# --------------------------------------------------------------------------------------- setup


def initialize_distributed(config: TrainingConfig | argparse.Namespace) -> None:
    """Process group (nccl with GPUs, gloo without), model-parallel groups, seeds."""
    config = as_training_config(config)
    loop, layout = config.loop, config.layout
    backend = loop.distributed_backend or default_backend()
    if megatron_runtime.single_process_env():
        print_rank_0("no launcher (torchrun) environment: running as a single process")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # Megatron's --distributed-timeout-minutes: gloo's 30 min default would stall every rank that long.
    # NCCL's groups get a longer timeout than ours: our watchdog names the hung operation first (distributed_timeout).
    timeout = prepare_process_groups(backend, datetime.timedelta(minutes=loop.distributed_timeout_minutes))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    parallel_state.initialize_model_parallel(
        layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
        layout.virtual_pipeline_model_parallel_size, timeout=timeout,
    )
    start_watchdog()
    # Megatron's _set_random_seed: one seed per pipeline stage for the CPU generator (weights are
    # initialised there) and the device's, TP streams inside the tracker.
    seed = loop.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def get_model(model_provider: Callable[..., torch.nn.Module], config: TrainingConfig
              ) -> list[DistributedDataParallel]:
    """Build this rank's model chunks (one per virtual stage) and wrap each in DDP."""
    state = parallel_state.resolve_parallel_state()
    chunks = []
    P, V = state.pipeline_model_parallel_size, config.layout.virtual_pipeline_model_parallel_size or 1
    placement = placement_of(config.layout.pipeline_schedule, V)  # ZB-V / DualPipeV (auto over 2 chunks): a V
    for c in range(V):
        v = virtual_stage(state.pipeline_model_parallel_rank, c, P, placement)
        pre, post = v == 0, v == P * V - 1
        chunks.append(model_provider(pre_process=pre, post_process=post, vp_stage=c))
    wrapped = [DistributedDataParallel(chunk.to(default_device()), config.ddp) for chunk in chunks]
    for w in wrapped:
        w.broadcast_params()
    return wrapped


def get_optimizer_param_scheduler(optimizer: Any, config: TrainingConfig) -> OptimizerParamScheduler:
    """Megatron counts the schedule in samples: one step advances it by the global batch."""
    lr = config.lr_schedule  # its lengths: iterations x global batch, or --train-samples' own sample counts
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if lr.lr_warmup_steps else lr.lr, max_lr=lr.lr, min_lr=lr.min_lr,
        lr_decay_style=lr.lr_decay_style, start_wd=lr.weight_decay, end_wd=lr.weight_decay,
        wd_incr_style="constant", lr_wsd_decay_style=lr.lr_wsd_decay_style if lr.lr_decay_style == "WSD" else None,
        lr_warmup_steps=lr.lr_warmup_steps, lr_decay_steps=lr.lr_decay_steps, wd_incr_steps=lr.wd_incr_steps,
        wsd_decay_steps=lr.wsd_decay_steps,
    )


# --------------------------------------------------------------------------------------- data


def _cyclic(loader: Optional[torch.utils.data.DataLoader]) -> Optional[Iterator]:
    if loader is None:
        return None

    def gen():
        while True:
            yield from loader

    return gen()


def build_data_iterators(datasets_provider: Callable, config: TrainingConfig, consumed_train: int,
                         consumed_valid: int, num_chunks: int):
    """One iterator per model chunk (every chunk sees the same sequence of microbatches)."""
    loop, gbs = config.loop, config.layout.target_global_batch_size
    eval_runs = (loop.train_iters // loop.eval_interval + 1) * loop.eval_iters
    # Megatron's sizes: --train-samples when given, else iterations x the global batch; never fewer than the
    # run consumes (a rampup's last growing batch may pass --train-samples, as in Megatron's update_train_iters).
    train_samples = max(config.lr_schedule.train_samples or 0, samples_consumed(config.layout, loop.train_iters))
    num_samples = (train_samples, eval_runs * gbs, loop.eval_iters * gbs)
    train_ds, valid_ds, test_ds = datasets_provider(num_samples)
    state = parallel_state.resolve_parallel_state()
    dp_rank, dp_size = state.data_parallel_rank, state.data_parallel_size

    def loader(ds, consumed):
        return build_pretraining_data_loader(ds, consumed, config.layout.micro_batch_size, dp_rank, dp_size,
                                             dataloader_type=loop.dataloader_type, num_workers=loop.num_workers,
                                             seed=loop.seed)

    train = [iter(loader(train_ds, consumed_train)) if train_ds is not None else None for _ in range(num_chunks)]
    valid = [_cyclic(loader(valid_ds, consumed_valid)) for _ in range(num_chunks)]
    return train, valid


# --------------------------------------------------------------------------------------- steps


class LossAverager:
    """Mean of each reported loss over microbatches (last stage) and DP, available on every rank.

    Only the last pipeline stage has losses; their names travel to the other ranks once
    (the first call), after which each call is one small all-reduce and one host copy.
    """

    def __init__(self) -> None:
        self.keys: Optional[list[str]] = None

    def __call__(self, losses: list[dict[str, Any]]) -> dict[str, float]:
        if self.keys is None:
            names = [sorted(losses[0]) if losses else None]
            if dist.is_initialized():  # from any loss rank: in a V (ZB-V, DualPipeV) that is pipeline rank 0
                gathered: list = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, names[0])
                names = [next((n for n in gathered if n is not None), None)]
            self.keys = names[0] or []
        dev = default_device()
        if losses:
            per_key = [torch.stack([_as_tensor(d[k], dev) for d in losses]).mean() for k in self.keys]
            vec = torch.stack(per_key + [torch.ones((), dtype=torch.float64, device=dev)])
        else:
            vec = torch.zeros(len(self.keys) + 1, dtype=torch.float64, device=dev)
        if dist.is_initialized():
            with waiting_for("the loss all-reduce", "all ranks"):
                dist.all_reduce(vec)  # sum over the ranks that reported, divided by their count below
                values = vec.tolist()  # NCCL: the host waits here, inside the block the watchdog names
        else:
            values = vec.tolist()
        count = max(values[-1], 1.0)
        return {k: values[i] / count for i, k in enumerate(self.keys)}


def _as_tensor(x: Any, dev: torch.device) -> torch.Tensor:
    """A reported value as a float64 scalar on ``dev``: a tensor, a number, or a (sum, count) pair."""
    if isinstance(x, (tuple, list)):  # Megatron's per-token losses
        return _as_tensor(x[0], dev) / _as_tensor(x[1], dev).clamp(min=1.0)
    return torch.as_tensor(x, dtype=torch.float64, device=dev).detach().reshape(())


def _group_ranks(kind: str) -> list[int]:
    """This rank's group of ``kind`` (tp, pp, dp, mp) as global ranks, for error messages."""
    return list(parallel_state.resolve_parallel_state().group_ranks[kind])


def train_step(forward_step_func: Callable, data_iterator: Sequence, model: list, optimizer: Any,
               scheduler: Any, config: TrainingConfig, stats: Optional[list] = None,
               average_losses: Optional[LossAverager] = None, schedule: Optional[str] = None
               ) -> tuple[dict[str, float], bool, Optional[float]]:
    """One iteration; ``stats`` (a list) receives the executor's per-action timings.

    ``schedule``: a pipeline schedule name; None = the config's (--pipeline-schedule, else 1F1B,
    interleaved with virtual stages). ``config.layout`` gives this iteration's microbatch count.
    """
    layout, loop = config.layout, config.loop
    optimizer.zero_grad()  # zeroes every chunk's gradient buffer (once) and drops the masters' gradients
    with waiting_for(lambda: f"forward/backward (gradient reduction over data-parallel ranks {_group_ranks('dp')}, "
                     "tied-embedding all-reduce)", "its data-parallel and embedding-group peers"):
        losses = forward_backward(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=layout.num_microbatches, seq_length=layout.seq_length,
            micro_batch_size=layout.micro_batch_size, schedule=schedule or layout.pipeline_schedule,
            grad_scale_func=optimizer.scale_loss if (loop.fp16 or loop.bf16) else None,
            finalize_model_grads_func=finalize_model_grads, pipeline_dtype=loop.params_dtype,
            deallocate_pipeline_outputs=loop.deallocate_pipeline_outputs,
            calculate_per_token_loss=loop.calculate_per_token_loss,
            stats=stats, time_actions=stats is not None,
        )
    with waiting_for(lambda: f"the optimizer step (inf check and gradient norm over model-parallel ranks "
                     f"{_group_ranks('mp')}, data-parallel ranks {_group_ranks('dp')})", "those ranks"):
        update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=layout.global_batch_size)
    return (average_losses or LossAverager())(losses), not update_successful, grad_norm


def evaluate(forward_step_func: Callable, data_iterator: Sequence, model: list,
             config: TrainingConfig, average_losses: Optional[LossAverager] = None) -> dict[str, float]:
    for chunk in model:
        chunk.eval()
    average_losses = average_losses or LossAverager()
    totals: dict[str, float] = {}
    layout, eval_iters = config.layout, config.loop.eval_iters
    with torch.no_grad():
        for _ in range(eval_iters):
            losses = forward_backward(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=layout.num_microbatches, seq_length=layout.seq_length,
                micro_batch_size=layout.micro_batch_size, forward_only=True, pipeline_dtype=config.loop.params_dtype,
                schedule=layout.pipeline_schedule,  # the chunks' placement
            )
            for k, v in average_losses(losses).items():
                totals[k] = totals.get(k, 0.0) + v / eval_iters
    for chunk in model:
        chunk.train()
    return totals


# --------------------------------------------------------------------------------------- logging


def model_flops(model_config: Any, batch_size: int) -> Optional[float]:
    """Model FLOPs of one iteration, when the model config can count them (TransformerConfig does)."""
    count = getattr(model_config, "num_floating_point_operations", None)
    return count(batch_size) if count is not None else None


def peak_tflops(args: Any) -> Optional[float]:
    """``args.peak_tflops`` (the logging config's, or the arguments'), else the card's datasheet figure."""
    if args.peak_tflops:
        return args.peak_tflops
    return datasheet_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


class TrainingLogger:
    """Interval logging: console (with a progress bar on a terminal), --log-json, TensorBoard."""

    def __init__(self, config: TrainingConfig | argparse.Namespace, start_iteration: int = 0, model_config: Any = None):
        self.config, self.model_config = as_training_config(config), model_config
        args = self.config.logging
        self.active = is_last_rank()  # the last rank holds the losses (Megatron logs there too)
        self.json = open(args.log_json, "a") if (self.active and args.log_json) else None
        self.tb = megatron_runtime.TensorBoardSink(args.tensorboard_dir) \
            if (self.active and args.tensorboard_dir) else None
        self.wandb = megatron_runtime.WandbSink(args, self.config.run_args()) \
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

    def log_eval(self, iteration: int, losses: dict[str, float], consumed_samples: Optional[int] = None) -> None:
        if not self.active:
            return
        if self.tb:
            self.tb.log_eval(iteration, losses, consumed_samples)
        loss = losses.get("lm loss", next(iter(losses.values()), float("nan")))
        ppl = math.exp(min(loss, 20.0))
        progress.emit(self.bar, f"validation at iteration {iteration} | lm loss {loss:.4f} | perplexity {ppl:.2f}")
        self.write({"type": "eval", "iteration": iteration, "eval_loss": loss, "eval_perplexity": ppl})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.json:
            self.json.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.close()


# --------------------------------------------------------------------------------------- the loop


def pretrain(
    config: TrainingConfig | argparse.Namespace,
    model_provider: Callable[..., torch.nn.Module],
    forward_step_func: Callable,
    datasets_provider: Callable,
    model_config: Any = None,
    layer_numbers: Optional[Sequence[Sequence[int]]] = None,
) -> dict[str, Any]:
    """Train for ``config.loop.train_iters`` iterations; returns the model, optimizer, and each
    iteration's averaged losses and gradient norm.

    ``model_config``: the model's config, saved in checkpoints (a ``checkpoint_mismatches`` method
    refuses another model's, parallel3d.model_chunk) and counting the FLOPs the log reports (a
    ``num_floating_point_operations(batch_size)`` method). Expects ``initialize_distributed`` to have run.
    """
    config = as_training_config(config)
    if config.checkpoint.save:  # an unwritable --save fails now, not at the first save hours in
        checkpointing.check_save_dir_writable(config.checkpoint.save)
    # Installed before the slow setup, so an early SIGTERM still ends in a save after iteration 1.
    with save_dir_guard(config.checkpoint.save), \
            ExitSignalHandler(default_device()) if config.loop.exit_signal_handler else contextlib.nullcontext() \
            as exit_signal:
        return _pretrain(config, model_provider, forward_step_func, datasets_provider, model_config, layer_numbers,
                         exit_signal)


def _pretrain(config: TrainingConfig, model_provider: Callable[..., torch.nn.Module], forward_step_func: Callable,
              datasets_provider: Callable, model_config: Any, layer_numbers: Optional[Sequence[Sequence[int]]],
              exit_signal: Optional[ExitSignalHandler]) -> dict[str, Any]:
    ckpt, loop = config.checkpoint, config.loop
    model = get_model(model_provider, config)
    optimizer = get_megatron_optimizer(config.optimizer, model)
    scheduler = get_optimizer_param_scheduler(optimizer, config)

    iteration, consumed_train, consumed_valid = megatron_runtime.load_for_training(
        config, model, optimizer, scheduler, model_config, print_rank_0)

    train_iter, valid_iter = build_data_iterators(datasets_provider, config, consumed_train, consumed_valid, len(model))
    logger = TrainingLogger(config, start_iteration=iteration, model_config=model_config)
    history: list[dict[str, float]] = []
    grad_norms: list[Optional[float]] = []
    step_config = config  # the current iteration's: its batch changes under --rampup-batch-size

    def save(it: int) -> None:
        checkpointing.save_checkpoint(
            ckpt.save, it, model, *((None, None) if ckpt.no_save_optim else (optimizer, scheduler)),
            model_config=model_config, args=step_config.run_args(),
            extra={"consumed_train_samples": consumed_train, "consumed_valid_samples": consumed_valid},
            layer_numbers=layer_numbers,
        )
        print_rank_0(f"saved checkpoint of iteration {it} to {ckpt.save}")

    last_saved = None
    train_losses, eval_losses = LossAverager(), LossAverager()
    guard, stopped_by_signal = StepGuard(loop), False
    duration = megatron_runtime.DurationLimit(loop.exit_duration_in_mins)
    for chunk in model:
        chunk.train()
    while iteration < loop.train_iters:
        step_config = config.at_consumed(consumed_train)  # --rampup-batch-size: this iteration's global batch
        layout = step_config.layout
        try:
            loss, skipped, grad_norm = train_step(forward_step_func, train_iter, model, optimizer, scheduler,
                                                  step_config, average_losses=train_losses)
        except CommunicationError as e:
            raise CommunicationError(f"iteration {iteration + 1}: {e}") from e
        scaler = getattr(optimizer, "grad_scaler", None)  # its scale is a host float: no sync
        bad = guard.check(iteration + 1, loss, grad_norm, skipped, model, scaler.scale if scaler else None)
        iteration += 1
        consumed_train += layout.global_batch_size
        history.append(loss)
        grad_norms.append(grad_norm)
        logger.record(loss, skipped)
        # iteration 1 too: a loss curve starts at the untrained model's loss
        if iteration % config.logging.log_interval == 0 or iteration in (1, loop.train_iters):
            scale = optimizer.get_loss_scale() if loop.fp16 else None
            logger.log(iteration, optimizer.param_groups[0]["lr"], grad_norm,
                       float(scale) if scale is not None else None, layout, consumed_train)
        if any(v is not None for v in valid_iter) and loop.eval_interval and iteration % loop.eval_interval == 0:
            logger.log_eval(iteration, evaluate(forward_step_func, valid_iter, model, step_config, eval_losses),
                            consumed_train)
            consumed_valid += loop.eval_iters * layout.global_batch_size
        if ckpt.save and ckpt.save_interval and iteration % ckpt.save_interval == 0 and not bad:
            save(iteration)
            last_saved = iteration
        if loop.exit_interval and iteration % loop.exit_interval == 0:
            break
        if duration.reached():
            print_rank_0(f"exiting after iteration {iteration}: --exit-duration-in-mins {loop.exit_duration_in_mins} "
                         "reached" + ("" if ckpt.save else "; no --save, so nothing is saved"))
            break
        if exit_signal is not None and exit_signal.should_exit():
            print_rank_0(f"exiting after iteration {iteration}: received SIGTERM (--exit-signal-handler)"
                         + ("" if ckpt.save else "; no --save, so nothing is saved"))
            stopped_by_signal = True
            break
    if ckpt.save and last_saved != iteration:
        save(iteration)
    logger.close()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iteration": iteration,
            "losses": history, "grad_norms": grad_norms, "exit_signal": stopped_by_signal}
