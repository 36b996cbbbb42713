"""Megatron's entry point: ``get_forward_backward_func()`` and the function it returns.

    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=..., data_iterator=..., model=chunks,
                              num_microbatches=M, seq_length=s, micro_batch_size=b)

It builds the schedule for this layout (no-pipelining, 1F1B, or interleaved
1F1B with virtual stages), checks it, and runs it with the executor.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from parallel3d import parallel_state

from .executor import PipelineGroup, ScheduleExecutor
from .p2p import TensorSpec
from .builders import forward_only_schedule
from .registry import build_schedule, placement_of
from .schedules import Schedule, ScheduleError
from .simulate import validate
from .zero_bubble import hoist_receives_over_w


# Megatron's forward_backward_func takes these too: accepted at the value that means what this
# schedule does, refused by name otherwise.
_MEGATRON_ARGS = {"decoder_seq_length": None, "first_val_step": None, "adjust_tensor_shapes_fn": None,
                  "p2p_communicator": None, "pg_collection": None, "force_all_reduce": False}
_NEUTRAL_ARGS = {"decoder_seq_length", "first_val_step"}  # any value: encoder-decoder / FP8 caching only

# ModelParallelConfig fields Megatron's schedules read that change the result, not honoured here.
_REFUSED_CONFIG = {"enable_autocast": False, "overlap_moe_expert_parallel_comm": False,
                   "hybrid_context_parallel": False}


@dataclass(frozen=True)
class PipelineConfig:
    """What the schedule reads from the model's config (Megatron's ModelParallelConfig fields).

    ``PipelineConfig.of(model_config)`` reads them as Megatron's schedules do, with Megatron's
    default for a missing field; a model without a ``config`` passes ``tensor_shape``.
    ``pipeline_dtype`` (what stages send) falls back to ``params_dtype``, then float32.
    """

    hidden_size: Optional[int] = None
    sequence_parallel: bool = False
    tensor_model_parallel_size: Optional[int] = None  # None: the parallel state's
    pipeline_dtype: torch.dtype = torch.float32
    variable_seq_lengths: bool = False
    calculate_per_token_loss: bool = False
    deallocate_pipeline_outputs: bool = False  # only safe when no backward saves a stage's output
    microbatch_group_size_per_vp_stage: Optional[int] = None  # the interleaved schedule's; None: PP
    grad_scale_func: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None

    @staticmethod
    def of(model_config: Any) -> "PipelineConfig":
        if model_config is None:
            return PipelineConfig()
        for name, default in _REFUSED_CONFIG.items():
            if getattr(model_config, name, default) != default:
                raise ValueError(f"model.config.{name}={getattr(model_config, name)!r} is not supported by "
                                 f"parallel3d's schedules; set it to {default!r}")
        values = {f.name: getattr(model_config, f.name, f.default) for f in dataclasses.fields(PipelineConfig)}
        values["pipeline_dtype"] = (getattr(model_config, "pipeline_dtype", None)
                                    or getattr(model_config, "params_dtype", None) or torch.float32)
        return PipelineConfig(**values)

    def tensor_shape(self, seq_length: Optional[int], micro_batch_size: Optional[int]) -> tuple[int, int, int]:
        """[s, b, h] of the hidden states between stages ([s/tp, b, h] under sequence parallelism)."""
        if seq_length is None or micro_batch_size is None or self.hidden_size is None:
            raise ValueError("pipeline transfers need tensor_shape, or seq_length, micro_batch_size and "
                             "model.config.hidden_size (or variable_seq_lengths=True)")
        if self.sequence_parallel:
            tp = self.tensor_model_parallel_size or parallel_state.resolve_parallel_state().tensor_model_parallel_size
            seq_length //= tp
        return seq_length, micro_batch_size, self.hidden_size


def _model_config(chunk: torch.nn.Module) -> Any:
    """Megatron's get_model_config: the ``config`` of the chunk or of the module it wraps."""
    while chunk is not None:
        config = getattr(chunk, "config", None)
        if config is not None:
            return config
        chunk = getattr(chunk, "module", None)
    return None


def _check_megatron_args(given: dict[str, Any]) -> None:
    unknown = set(given) - set(_MEGATRON_ARGS)
    if unknown:
        raise TypeError(f"forward_backward got unexpected arguments {sorted(unknown)}")
    for name, value in given.items():
        default = _MEGATRON_ARGS[name]
        if name not in _NEUTRAL_ARGS and (value is not None if default is None else value != default):
            raise ValueError(f"forward_backward: {name}={value!r} is not supported by parallel3d's schedules "
                             f"(leave it at {_MEGATRON_ARGS[name]!r})")


def _check_per_token(chunks: Sequence[torch.nn.Module], per_token: bool) -> None:
    """DDP chose its 1/DP scaling from the config it was wrapped with: the schedule must agree."""
    for i, chunk in enumerate(chunks):
        wrapped = getattr(chunk, "calculate_per_token_loss", None)
        if wrapped is not None and bool(wrapped) != per_token:
            raise ValueError(f"forward_backward runs with calculate_per_token_loss={per_token} but model chunk {i} "
                             f"was wrapped in DistributedDataParallel with calculate_per_token_loss={bool(wrapped)}: "
                             "set model.config.calculate_per_token_loss once, before wrapping")


INTERLEAVED = "interleaved-1f1b"  # the one schedule of microbatch groups (microbatch_group_size_per_vp_stage)


def schedule_group_size(name: str, group_size: Optional[int]) -> Optional[int]:
    """The microbatch group size schedule ``name`` takes: Megatron reads it in its interleaved schedule only;
    the others have no groups."""
    return group_size if name == INTERLEAVED else None


def default_schedule_name(pipeline_size: int, virtual_size: Optional[int]) -> str:
    if pipeline_size == 1:
        return "no-pipelining"
    return INTERLEAVED if virtual_size is not None and virtual_size > 1 else "1f1b"


@functools.lru_cache(maxsize=64)
def _checked_schedule(name: str, stages: int, microbatches: int, chunks: int, forward_only: bool,
                      negotiate_shapes: bool = False, layer_shape: Optional[tuple[int, int]] = None,
                      group_size: Optional[int] = None) -> Schedule:
    """Built and validated once per shape; Schedule is frozen, so sharing the cached object is safe.

    ``negotiate_shapes`` (variable_seq_lengths): also deadlock-free when each batch exchanges
    shape headers first; a zero-bubble order that is not gets its receives hoisted over W.
    ``layer_shape`` (hidden size, sequence length): what 'auto' weighs its candidates by.
    ``group_size``: the interleaved schedule's microbatch_group_size_per_vp_stage (None: PP)."""
    if forward_only:  # any microbatch count works without backwards
        # the placement the model chunks were built for
        return forward_only_schedule(Schedule(name, stages, microbatches, chunks, (), placement_of(name, chunks)))
    hidden_size, seq_length = layer_shape or (None, None)
    schedule = build_schedule(name, stages, microbatches, chunks, hidden_size=hidden_size, seq_length=seq_length,
                              microbatch_group_size_per_vp_stage=group_size)
    if schedule.placement != placement_of(name, chunks):
        raise ScheduleError(f"schedule {schedule.name!r} places chunks in a {schedule.placement!r} shape, but the "
                            f"model was built for {placement_of(name, chunks)!r} (placement_of)")
    validate(schedule)
    if negotiate_shapes:
        try:
            validate(schedule, negotiate_shapes=True)
        except ScheduleError:
            if not schedule.splits_backward:
                raise
            schedule = hoist_receives_over_w(schedule)
            try:
                validate(schedule, negotiate_shapes=True)
            except ScheduleError as e:
                raise ValueError(f"pipeline schedule {name!r} with {stages} stages and {microbatches} microbatches "
                                 f"cannot negotiate variable sequence lengths without deadlock; use fixed "
                                 f"lengths, another microbatch count or another schedule ({e})") from e
    return schedule


def forward_backward(
    *,
    forward_step_func: Callable,
    data_iterator: Union[Iterator, Sequence[Iterator], None],
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    forward_only: bool = False,
    schedule: Optional[str] = None,
    config: Optional[PipelineConfig] = None,
    tensor_shape: Optional[Sequence[int]] = None,
    pipeline_dtype: Optional[torch.dtype] = None,
    variable_seq_lengths: Optional[bool] = None,
    grad_scale_func: Optional[Callable] = None,
    finalize_model_grads_func: Optional[Callable] = None,
    calculate_per_token_loss: Optional[bool] = None,
    deallocate_pipeline_outputs: Optional[bool] = None,
    pipeline: Optional[PipelineGroup] = None,
    stats: Optional[list] = None,
    time_actions: bool = False,
    collect_non_loss_data: bool = False,
    **megatron_args: Any,
) -> list[Any]:
    """Run forward and backward of ``num_microbatches`` through the pipeline; return the last stage's losses.

    ``config``: a :class:`PipelineConfig`; default ``PipelineConfig.of(model[0].config)``, the
    fields Megatron's schedules read from the model's config. The keyword settings
    (pipeline_dtype, variable_seq_lengths, grad_scale_func, finalize_model_grads_func,
    calculate_per_token_loss, deallocate_pipeline_outputs; Megatron's names) override its fields
    where given. ``finalize_model_grads_func(model_chunks, num_tokens)`` runs after a backward
    schedule, ``num_tokens`` None unless calculate_per_token_loss, as Megatron calls it.
    ``collect_non_loss_data`` (forward only): the last stage returns ``loss_func(output,
    non_loss_data=True)`` of each microbatch instead of the losses.
    """
    _check_megatron_args(megatron_args)
    if collect_non_loss_data and not forward_only:
        raise ValueError("collect_non_loss_data=True needs forward_only=True (Megatron collects non-loss data "
                         "in evaluation only: there is no loss to run backward from)")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    pipeline = pipeline or PipelineGroup.from_state()
    config = config or PipelineConfig.of(_model_config(chunks[0]))
    overrides = dict(pipeline_dtype=pipeline_dtype, variable_seq_lengths=variable_seq_lengths,
                     grad_scale_func=grad_scale_func, finalize_model_grads_func=finalize_model_grads_func,
                     calculate_per_token_loss=calculate_per_token_loss,
                     deallocate_pipeline_outputs=deallocate_pipeline_outputs)
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if not forward_only:
        _check_per_token(chunks, config.calculate_per_token_loss)

    stages = len(pipeline.ranks)
    vp = parallel_state.resolve_parallel_state().virtual_pipeline_model_parallel_size
    if vp is not None and len(chunks) != vp:
        raise ValueError(f"virtual_pipeline_model_parallel_size is {vp} but the model has {len(chunks)} "
                         f"chunk(s) on this rank: build one chunk per virtual stage")
    name = schedule or default_schedule_name(stages, len(chunks) if len(chunks) > 1 else None)
    known = config.hidden_size is not None and seq_length is not None
    sched = _checked_schedule(name, stages, num_microbatches, len(chunks), forward_only,
                              config.variable_seq_lengths and stages > 1,
                              (config.hidden_size, seq_length) if known else None,
                              schedule_group_size(name, config.microbatch_group_size_per_vp_stage))

    recv_spec = None
    if stages > 1 and not config.variable_seq_lengths:
        shape = tuple(tensor_shape) if tensor_shape is not None else config.tensor_shape(seq_length, micro_batch_size)
        recv_spec = TensorSpec((shape,), (config.pipeline_dtype,))

    executor = ScheduleExecutor(
        sched, forward_step_func, data_iterator, chunks,
        pipeline=pipeline, recv_spec=recv_spec, variable_seq_lengths=config.variable_seq_lengths,
        forward_only=forward_only, grad_scale_func=config.grad_scale_func,
        calculate_per_token_loss=config.calculate_per_token_loss,
        deallocate_pipeline_outputs=config.deallocate_pipeline_outputs, time_actions=time_actions,
        collect_non_loss_data=collect_non_loss_data,
    )
    losses = executor.run()
    if stats is not None:
        stats.append(executor.stats)
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(chunks, executor.num_tokens if config.calculate_per_token_loss else None)
    return losses


def get_forward_backward_func(
    pipeline_model_parallel_size: Optional[int] = None,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> Callable[..., list[Any]]:
    """The forward-backward function for the current layout (Megatron's name and contract)."""
    if pipeline_model_parallel_size is None:
        state = parallel_state.resolve_parallel_state()
        pipeline_model_parallel_size = state.pipeline_model_parallel_size
        virtual_pipeline_model_parallel_size = state.virtual_pipeline_model_parallel_size
    name = default_schedule_name(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size)
    return functools.partial(forward_backward, schedule=name)
