"""Megatron's entry point: ``get_forward_backward_func()`` and the function it returns.

    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=..., data_iterator=..., model=chunks,
                              num_microbatches=M, seq_length=s, micro_batch_size=b)

It builds the schedule for this layout (no-pipelining, 1F1B, or interleaved
1F1B with virtual stages), checks it, and runs it with the executor.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from parallel3d import parallel_state

from .executor import PipelineGroup, ScheduleExecutor, forward_only_schedule
from .p2p import TensorSpec
from .schedules import Schedule, build_schedule
from .simulate import validate


# Megatron's forward_backward_func takes these too; they change nothing here.
_MEGATRON_ONLY_ARGS = {"decoder_seq_length", "collect_non_loss_data", "first_val_step", "adjust_tensor_shapes_fn"}


def default_schedule_name(pipeline_size: int, virtual_size: Optional[int]) -> str:
    if pipeline_size == 1:
        return "no-pipelining"
    return "interleaved-1f1b" if virtual_size is not None and virtual_size > 1 else "1f1b"


@functools.lru_cache(maxsize=64)
def _checked_schedule(name: str, stages: int, microbatches: int, chunks: int, forward_only: bool):
    if forward_only:  # any microbatch count works without backwards
        return forward_only_schedule(Schedule(name, stages, microbatches, chunks, []))
    schedule = build_schedule(name, stages, microbatches, chunks)
    validate(schedule)
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
    **megatron_only: Any,
) -> list[Any]:
    """Run forward and backward of ``num_microbatches`` through the pipeline; return the last stage's losses.

    Settings not passed are read from ``model[0].config`` (Megatron's model config)
    where present: hidden_size, sequence_parallel, tensor_model_parallel_size,
    pipeline_dtype/params_dtype, variable_seq_lengths, calculate_per_token_loss,
    deallocate_pipeline_outputs (only safe when no backward function saves a
    stage's output tensor, e.g. it is a residual add; off by default as in Megatron-Core).
    ``finalize_model_grads_func(model, num_tokens)`` runs after the schedule.
    """
    unknown = set(megatron_only) - _MEGATRON_ONLY_ARGS
    if unknown:
        raise TypeError(f"forward_backward got unexpected arguments {sorted(unknown)}")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    pipeline = pipeline or PipelineGroup.from_state()
    config = getattr(chunks[0], "config", None)

    def cfg(name: str, default: Any) -> Any:
        return getattr(config, name, default) if config is not None else default

    if variable_seq_lengths is None:
        variable_seq_lengths = cfg("variable_seq_lengths", False)
    if calculate_per_token_loss is None:
        calculate_per_token_loss = cfg("calculate_per_token_loss", False)
    if deallocate_pipeline_outputs is None:
        deallocate_pipeline_outputs = cfg("deallocate_pipeline_outputs", False)
    if pipeline_dtype is None:
        pipeline_dtype = cfg("pipeline_dtype", None) or cfg("params_dtype", torch.float32)

    stages = len(pipeline.ranks)
    vp = parallel_state.resolve_parallel_state().virtual_pipeline_model_parallel_size
    if vp is not None and len(chunks) != vp:
        raise ValueError(f"virtual_pipeline_model_parallel_size is {vp} but the model has {len(chunks)} "
                         f"chunk(s) on this rank: build one chunk per virtual stage")
    name = schedule or default_schedule_name(stages, len(chunks) if len(chunks) > 1 else None)
    sched = _checked_schedule(name, stages, num_microbatches, len(chunks), forward_only)

    recv_spec = None
    if stages > 1 and not variable_seq_lengths:
        if tensor_shape is None:
            hidden = cfg("hidden_size", None)
            if seq_length is None or micro_batch_size is None or hidden is None:
                raise ValueError("pipeline transfers need tensor_shape, or seq_length, micro_batch_size and "
                                 "model.config.hidden_size (or variable_seq_lengths=True)")
            if cfg("sequence_parallel", False):
                tp = cfg("tensor_model_parallel_size", parallel_state.resolve_parallel_state().tensor_model_parallel_size)
                seq_length = seq_length // tp
            tensor_shape = (seq_length, micro_batch_size, hidden)
        recv_spec = TensorSpec((tuple(tensor_shape),), (pipeline_dtype,))

    executor = ScheduleExecutor(
        sched, forward_step_func, data_iterator, chunks,
        pipeline=pipeline, recv_spec=recv_spec, variable_seq_lengths=variable_seq_lengths,
        forward_only=forward_only, grad_scale_func=grad_scale_func,
        calculate_per_token_loss=calculate_per_token_loss,
        deallocate_pipeline_outputs=deallocate_pipeline_outputs, time_actions=time_actions,
    )
    losses = executor.run()
    if stats is not None:
        stats.append(executor.stats)
    if finalize_model_grads_func is not None and not forward_only:
        finalize_model_grads_func(chunks, executor.num_tokens if calculate_per_token_loss else None)
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
