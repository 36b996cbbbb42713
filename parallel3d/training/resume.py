"""Megatron-LM's resume rules (the load step of ``pretrain``): a --load directory without a checkpoint starts
from scratch with a notice (the first launch of ``--save ckpt --load ckpt``); ``--finetune`` loads weights only
and starts at iteration 0; a checkpoint lacking the state the run would load, or saved with other loss scaling,
is refused naming the flags that resume it; the LR schedule of a resumed run must match the checkpoint's unless
``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` says which wins.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import torch

from parallel3d.training import checkpointing
from parallel3d.training.checkpoint_integrity import FILES_KEY, CheckpointError

_FLAG_OF = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
            "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
            "wsd_decay_steps": "--lr-wsd-decay-iters", "lr_wsd_decay_style": "--lr-wsd-decay-style",
            "start_wd": "--weight-decay", "end_wd": "--weight-decay", "wd_incr_steps": "--train-iters",
            "wd_incr_style": "weight-decay increment style"}
_SAMPLE_FLAG_OF = {"lr_warmup_steps": "--lr-warmup-samples", "lr_decay_steps": "--lr-decay-samples",
                   "wsd_decay_steps": "--lr-wsd-decay-samples", "wd_incr_steps": "--train-samples"}


class ScheduleMismatchError(Exception):
    """Not a CheckpointError: load_checkpoint would re-word it as a damaged optimizer file."""


class CheckedScheduler:
    """Stands in for the LR scheduler while a checkpoint loads: Megatron's rule for the saved schedule.

    Equal schedules (or --override-opt_param-scheduler) keep this run's settings at the checkpoint's
    step; --use-checkpoint-opt_param-scheduler takes the checkpoint's; anything else is refused,
    naming each differing flag in the run's own units (iterations, or samples with --train-samples).
    """

    def __init__(self, scheduler: Any, args: Any) -> None:  # training_config.LRScheduleConfig, or the arguments
        self.scheduler, self.args = scheduler, args

    def differences(self, saved: dict[str, Any]) -> list[str]:
        current = self.scheduler.state_dict()
        styles = {saved.get("lr_decay_style"), current["lr_decay_style"]}
        # Compared only where they shape the schedule: a constant LR has no decay length, only WSD anneals,
        # a constant weight decay has no increment length.
        unused = {"lr_decay_steps"} if styles == {"constant"} else set()
        unused |= {"wsd_decay_steps", "lr_wsd_decay_style"} if "WSD" not in styles else set()
        unused |= {"wd_incr_steps"} if current["wd_incr_style"] == "constant" else set()
        keys = [k for k in _FLAG_OF if k not in unused]
        return [self._describe(k, saved.get(k), current[k]) for k in keys if saved.get(k) != current[k]]

    def _describe(self, key: str, saved: Any, current: Any) -> str:
        if key.endswith("_steps") and self.args.train_samples is None:
            gbs = self.args.target_global_batch_size
            saved, current = (None if v is None else v / gbs for v in (saved, current))
            saved, current = (v if v is None or v % 1 else int(v) for v in (saved, current))
        flag = _SAMPLE_FLAG_OF[key] if key in _SAMPLE_FLAG_OF and self.args.train_samples is not None \
            else _FLAG_OF[key]
        return f"{flag}: checkpoint {saved}, this run {current}"

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.args.use_checkpoint_opt_param_scheduler:
            self.scheduler.load_state_dict(saved)
            return
        diffs = self.differences(saved)
        if diffs and not self.args.override_opt_param_scheduler:
            raise ScheduleMismatchError(
                "the learning-rate schedule differs from the checkpoint's (" + "; ".join(diffs) + "). Give "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule or "
                "--override-opt_param-scheduler to use this run's flags")
        state = dict(self.scheduler.state_dict(), num_steps=saved["num_steps"])
        self.scheduler.load_state_dict(state)


def load_for_training(config: Any, model: Sequence[torch.nn.Module], optimizer: Any, scheduler: Any,
                      model_config: Any, say: Callable[[str], None]) -> tuple[int, int, int]:
    """Megatron's load step of ``pretrain``: (iteration, consumed train samples, consumed valid samples).

    ``config``: the run's training_config.TrainingConfig."""
    ckpt = config.checkpoint
    if not ckpt.load:
        return 0, 0, 0
    exists = os.path.isdir(ckpt.load)
    latest = checkpointing.read_latest_iteration(ckpt.load) if exists else None
    if latest is None:
        where = f"--load {ckpt.load} " + ("holds no checkpoint" if exists else "does not exist yet")
        if ckpt.exit_on_missing_checkpoint:
            raise CheckpointError(f"{where} (--exit-on-missing-checkpoint)")
        say(f"notice: {where}: starting from scratch")
        return 0, 0, 0
    load_optim = not (ckpt.no_load_optim or ckpt.finetune)
    load_rng = not (ckpt.no_load_rng or ckpt.finetune)
    meta = checkpointing.open_checkpoint(ckpt.load, latest)[2]
    _check_resumable(ckpt.load, latest, meta, config, load_optim, load_rng)
    iteration, meta = checkpointing.load_checkpoint(
        ckpt.load, model, optimizer if load_optim else None,
        CheckedScheduler(scheduler, config.lr_schedule) if load_optim else None,
        model_config=model_config, load_optimizer=load_optim, load_rng=load_rng)
    if ckpt.finetune:
        say(f"--finetune: loaded the weights of {ckpt.load} (iteration {iteration}); training starts at iteration 0 "
            "with a fresh optimizer, LR schedule and data order")
        return 0, 0, 0
    extra = meta.get("extra", {})
    consumed_train = extra.get("consumed_train_samples", iteration * config.layout.target_global_batch_size)
    consumed_valid = extra.get("consumed_valid_samples", 0)
    say(f"loaded {ckpt.load} at iteration {iteration} ({consumed_train} samples consumed)")
    train_iters = config.loop.train_iters
    if iteration >= train_iters:
        say(f"notice: the checkpoint is at iteration {iteration} >= --train-iters {train_iters}: nothing to "
            "train. Raise --train-iters to continue, or add --finetune to train these weights from iteration 0")
    return iteration, consumed_train, consumed_valid


def _precision(fp16: bool, bf16: bool, loss_scale: Optional[float]) -> str:
    scale = f" --loss-scale {loss_scale:g}" if loss_scale else ""
    return ("--fp16" if fp16 else "--bf16" if bf16 else "fp32") + scale


def _check_resumable(load: str, iteration: int, meta: dict, config: Any, load_optim: bool, load_rng: bool) -> None:
    """Refuse, before a tensor is read, a resume the checkpoint cannot serve, naming the flags that resume it:
    state it does not hold (--no-save-optim / --no-save-rng, or a converted checkpoint: weights only), or an
    optimizer state of other loss scaling (a grad scaler, --fp16 or --loss-scale, on one side only)."""
    saved = meta.get("args") or {}
    files = meta.get(FILES_KEY)  # None: saved before file records were kept

    def holds(test: Callable[[str], bool]) -> bool:
        return files is None or any(test(name) for name in files)

    missing = []  # (state, the flag that resumes without it)
    if load_optim and (saved.get("no_save_optim") or not holds(lambda name: name.endswith("/optimizer.pt"))):
        missing.append(("optimizer", "--no-load-optim"))
    if load_rng and (saved.get("no_save_rng") or not holds(lambda name: name.startswith("rng/"))):
        missing.append(("RNG", "--no-load-rng"))
    if missing:
        why = ("written by tools/convert_checkpoint.py, which keeps the weights only" if meta.get("args") is None
               else ", ".join(flag.replace("load", "save") for _, flag in missing))
        raise CheckpointError(f"{load} (iteration {iteration}) was saved without {' or '.join(m[0] for m in missing)} "
                              f"state ({why}): resume with {' '.join(m[1] for m in missing)} (the iteration and data "
                              "position are kept), or with --finetune (its weights, from iteration 0)")
    opt = config.optimizer
    if load_optim and "fp16" in saved:
        if bool(saved["fp16"] or saved.get("loss_scale")) != bool(opt.fp16 or opt.loss_scale):  # a grad scaler
            was = _precision(saved["fp16"], saved.get("bf16"), saved.get("loss_scale"))
            now = _precision(opt.fp16, opt.bf16, opt.loss_scale)
            raise CheckpointError(f"{load} (iteration {iteration}) was saved with {was}, this run has {now}: the "
                                  "optimizer state's loss scaling differs; resume with the checkpoint's "
                                  f"{was}, or add --no-load-optim to take its weights with a fresh optimizer")
