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
from typing import Any, Callable, Optional, Sequence

import torch

from parallel3d.training import checkpointing
from parallel3d.device import default_device
from parallel3d.distributed_timeout import CommunicationError
from parallel3d.distributed import get_megatron_optimizer
from parallel3d.training.checkpoint_lock import save_dir_guard
from parallel3d.training.cuda_graphs import capture_cuda_graphs, count_in_flight, out_of_memory, release_cuda_graphs
from parallel3d.training.cuda_graphs import describe as describe_launches
from parallel3d.training.data_iterators import build_data_iterators
from parallel3d.training.evaluation import evaluate
from parallel3d.training.initialize import get_model, get_optimizer_param_scheduler, print_rank_0
from parallel3d.training.resume import load_for_training
from parallel3d.training.step import LossAverager, train_step
from parallel3d.training.training_config import TrainingConfig, as_training_config
from parallel3d.training.training_guards import DurationLimit, ExitSignalHandler, StepGuard
from parallel3d.training.training_logger import TrainingLogger


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
    fp8 = getattr(model_config, "fp8_settings", None)
    if fp8 is not None:
        print_rank_0(fp8.describe())
    launches = describe_launches(model_config)
    if launches:
        print_rank_0(launches)
    optimizer = get_megatron_optimizer(config.optimizer, model)
    scheduler = get_optimizer_param_scheduler(optimizer, config)

    iteration, consumed_train, consumed_valid = load_for_training(
        config, model, optimizer, scheduler, model_config, print_rank_0)

    train_iter, valid_iter, test_iter = build_data_iterators(datasets_provider, config, consumed_train, consumed_valid,
                                                             len(model))
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
    duration = DurationLimit(loop.exit_duration_in_mins)
    for chunk in model:
        chunk.train()
    first_iteration, reached_end = iteration, False
    graphs_after = getattr(model_config, "cuda_graph_warmup_steps", 0) if getattr(model_config, "enable_cuda_graph",
                                                                                  False) else 0
    if graphs_after:
        count_in_flight(model)  # the warm-up steps count each block's forwards in flight: its capture's slots
    try:
        while iteration < loop.train_iters:
            step_config = config.at_consumed(consumed_train)  # --rampup-batch-size: this iteration's global batch
            layout = step_config.layout
            try:
                loss, skipped, grad_norm = train_step(forward_step_func, train_iter, model, optimizer, scheduler,
                                                      step_config, average_losses=train_losses)
            except CommunicationError as e:
                raise CommunicationError(f"iteration {iteration + 1}: {e}") from e
            except torch.cuda.OutOfMemoryError as e:
                if graphs_after and iteration - first_iteration >= graphs_after:  # the graphs hold their memory
                    raise out_of_memory(e, f"iteration {iteration + 1}") from e
                raise
            scaler = getattr(optimizer, "grad_scaler", None)  # its scale is a host float: no sync
            bad = guard.check(iteration + 1, loss, grad_norm, skipped, model, scaler.scale if scaler else None)
            iteration += 1
            consumed_train += layout.global_batch_size
            if graphs_after and iteration - first_iteration == graphs_after:  # between steps: see cuda_graphs.py
                try:
                    count = capture_cuda_graphs(model, layout.micro_batch_size)
                except torch.cuda.OutOfMemoryError as e:
                    raise out_of_memory(e, f"capturing the CUDA graphs after iteration {iteration}") from e
                print_rank_0(f"captured the CUDA graphs of {count} transformer layers after {graphs_after} eager steps")
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
                print_rank_0(f"exiting after iteration {iteration}: --exit-duration-in-mins "
                             f"{loop.exit_duration_in_mins} reached"
                             + ("" if ckpt.save else "; no --save, so nothing is saved"))
                break
            if exit_signal is not None and exit_signal.should_exit():
                print_rank_0(f"exiting after iteration {iteration}: received SIGTERM (--exit-signal-handler)"
                             + ("" if ckpt.save else "; no --save, so nothing is saved"))
                stopped_by_signal = True
                break
        else:  # no break: --train-iters reached, not --exit-interval, --exit-duration-in-mins or a signal
            reached_end = True
    except BaseException:  # a failed step: the GPU may never finish, so do not wait for it
        release_cuda_graphs(model, wait=False)
        raise
    replayed = release_cuda_graphs(model)  # before anyone destroys the process groups: see cuda_graphs.py
    if ckpt.save and last_saved != iteration:
        save(iteration)
    # Megatron's pretrain(): after a run that reached --train-iters and its last save, --eval-iters batches of
    # the validation set and of the test set (not after --exit-interval, --exit-duration-in-mins or a signal).
    for split, data in (("validation", valid_iter), ("test", test_iter)):
        if reached_end and loop.eval_iters > 0 and any(v is not None for v in data):
            logger.log_eval(iteration, evaluate(forward_step_func, data, model, step_config, eval_losses),
                            consumed_train, split=split, final=True)
    logger.close()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iteration": iteration,
            "losses": history, "grad_norms": grad_norms, "exit_signal": stopped_by_signal,
            "cuda_graph_replays": replayed}
