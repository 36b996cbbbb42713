"""The training run's settings as typed, frozen sections (torchtitan's style), built once from the
arguments after ``arguments.validate_args`` applied every rule and derived every size.

    config = TrainingConfig.from_args(validate_args(parse_args(argv), world_size))

The training loop reads these sections, never the argparse namespace; each section's fields keep
Megatron's argument names, so the helpers of megatron_args / resume that read those names
accept a section as they accept the arguments.

The one setting that changes during a run is the batch under ``--rampup-batch-size``: the layout
section holds the batch of the iteration it describes, and ``TrainingConfig.at_consumed(samples)``
returns the config of the iteration that starts after ``samples`` samples (Megatron's
``update_num_microbatches``), a new frozen object instead of a mutated namespace.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from parallel3d.distributed import DistributedDataParallelConfig, OptimizerConfig
from parallel3d.parallel_state import model_parallel_sizes
from parallel3d.symmetric_memory import gathers_off_reason
from parallel3d.training.megatron_args import current_global_batch_size, scheduler_steps


@dataclass(frozen=True)
class LayoutConfig:
    """The process layout, the pipeline schedule and the batch split, as validate_args derived them."""

    world_size: int
    model_parallel_sizes: dict  # parallel_state.model_parallel_sizes: TP, PP, ... and the virtual size, by name
    data_parallel_size: int
    sequence_parallel: bool
    pipeline_schedule: Optional[str]  # --pipeline-schedule; None: the layout's (1F1B / interleaved)
    seq_length: int
    micro_batch_size: int
    global_batch_size: int  # this iteration's (below the target while --rampup-batch-size ramps)
    num_microbatches: int  # this iteration's
    target_global_batch_size: int  # --global-batch-size
    rampup_batch_size: Optional[tuple]  # (start, increment, samples), or None
    # why the SP all-gathers do not go into NCCL symmetric windows; None: they do, where NCCL has them
    # (symmetric_memory.gathers_off_reason: SP with graphs, unless --no-tp-symmetric-gathers)
    tp_symmetric_gathers_off: Optional[str] = "not asked for"

    @property
    def tp_symmetric_gathers(self) -> bool:
        return self.tp_symmetric_gathers_off is None

    def at_consumed(self, consumed_samples: int) -> "LayoutConfig":
        """The batch of the iteration after ``consumed_samples`` samples (self without a rampup)."""
        if self.rampup_batch_size is None:
            return self
        gbs = current_global_batch_size(self, consumed_samples)
        return dataclasses.replace(self, global_batch_size=gbs,
                                   num_microbatches=gbs // (self.micro_batch_size * self.data_parallel_size))


@dataclass(frozen=True)
class LoopConfig:
    train_iters: int  # derived from --train-samples when that was given
    eval_interval: int
    eval_iters: int
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    exit_signal_handler: bool
    seed: int
    bf16: bool
    fp16: bool
    distributed_backend: Optional[str]
    distributed_timeout_minutes: float
    dataloader_type: str
    num_workers: int
    deallocate_pipeline_outputs: bool
    calculate_per_token_loss: bool
    check_for_nan_in_loss_and_grad: bool  # with the two below: training_guards.StepGuard's settings
    skip_nonfinite_iters: int
    max_consecutive_skipped_iters: int

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass(frozen=True)
class LRScheduleConfig:
    """The LR / weight-decay schedule, its lengths in samples (OptimizerParamScheduler's unit)."""

    lr: float
    min_lr: float
    lr_decay_style: str
    lr_wsd_decay_style: str
    weight_decay: float
    lr_warmup_steps: float  # the four lengths: megatron_args.scheduler_steps, from iterations or samples
    lr_decay_steps: int
    wd_incr_steps: int
    wsd_decay_steps: Optional[int]
    # What resume.CheckedScheduler needs to compare a checkpoint's schedule in the run's units:
    train_samples: Optional[int]
    target_global_batch_size: int
    override_opt_param_scheduler: bool
    use_checkpoint_opt_param_scheduler: bool


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str]
    save_interval: Optional[int]
    no_save_optim: bool
    load: Optional[str]
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    exit_on_missing_checkpoint: bool


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    log_json: Optional[str]
    tensorboard_dir: Optional[str]
    wandb_project: Optional[str]
    wandb_exp_name: Optional[str]
    wandb_save_dir: Optional[str]
    no_progress_bar: bool
    peak_tflops: Optional[float]


def _section(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """``cls`` from the arguments of its fields' names (those it has), and ``given``."""
    names = {f.name for f in dataclasses.fields(cls)} - set(given)
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)}, **given)


@dataclass(frozen=True)
class TrainingConfig:
    layout: LayoutConfig
    loop: LoopConfig
    lr_schedule: LRScheduleConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    optimizer: OptimizerConfig
    ddp: DistributedDataParallelConfig
    args: dict = dataclasses.field(default_factory=dict)
    """Every argument, as given and derived: recorded in checkpoints' metadata and the wandb run. The
    namespace's own dict, not a copy, so what the application sets after building the config (the
    example's default --data-path) is recorded as before."""

    @staticmethod
    def from_args(args: argparse.Namespace) -> "TrainingConfig":
        if not hasattr(args, "num_microbatches"):
            raise ValueError("TrainingConfig.from_args needs the arguments after arguments.validate_args()")
        loop = _section(LoopConfig, args)
        # --log-num-zeros-in-grad is accepted for Megatron's scripts but not logged (megatron_args):
        # passing it on would only add an all-reduce per step.
        optimizer = _section(OptimizerConfig, args, params_dtype=loop.params_dtype,
                             check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, log_num_zeros_in_grad=False)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16 or args.fp16,
            overlap_grad_reduce=args.overlap_grad_reduce, use_distributed_optimizer=args.use_distributed_optimizer,
            **({"bucket_size": args.ddp_bucket_size} if args.ddp_bucket_size else {}),
        )
        rampup = tuple(args.rampup_batch_size) if args.rampup_batch_size is not None else None
        return TrainingConfig(
            _section(LayoutConfig, args, model_parallel_sizes=model_parallel_sizes(args), rampup_batch_size=rampup,
                     tp_symmetric_gathers_off=gathers_off_reason(args.tp_symmetric_gathers, args.sequence_parallel,
                                                                 args.enable_cuda_graph)),
            loop,
            _section(LRScheduleConfig, args, **scheduler_steps(args)), _section(CheckpointConfig, args),
            _section(LoggingConfig, args), optimizer, ddp, vars(args))

    def at_consumed(self, consumed_samples: int) -> "TrainingConfig":
        """This config for the iteration after ``consumed_samples`` samples (see the module doc)."""
        layout = self.layout.at_consumed(consumed_samples)
        return self if layout is self.layout else dataclasses.replace(self, layout=layout)

    def run_args(self) -> dict:
        """The arguments to record (checkpoint metadata), with this iteration's batch as the loop runs it."""
        return dict(self.args, global_batch_size=self.layout.global_batch_size,
                    num_microbatches=self.layout.num_microbatches)


def as_training_config(config: "TrainingConfig | argparse.Namespace") -> TrainingConfig:
    """A TrainingConfig as is; validated arguments converted (pretrain's callers may pass either)."""
    return config if isinstance(config, TrainingConfig) else TrainingConfig.from_args(config)
