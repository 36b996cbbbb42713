"""One training iteration (``train_step``) and the loss averaging it and evaluation share."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d import parallel_state
from parallel3d.device import default_device
from parallel3d.distributed import finalize_model_grads
from parallel3d.distributed_timeout import waiting_for
from parallel3d.pipeline import forward_backward
from parallel3d.training.training_config import TrainingConfig


class LossAverager:
    """Each reported loss over microbatches (last stage) and DP, available on every rank: a value's mean, or for
    Megatron's (sum, count) pairs (--calculate-per-token-loss) the summed sums over the summed counts, as
    Megatron reports them (token-weighted over the global batch, not a mean of microbatch means).

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
        # per key: a numerator and a denominator, summed over microbatches here and over ranks below
        parts = [_sum_and_count([d[k] for d in losses], dev) for k in self.keys] if losses else \
            [torch.zeros(2, dtype=torch.float64, device=dev) for _ in self.keys]
        vec = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=dev)
        if dist.is_initialized():
            with waiting_for("the loss all-reduce", "all ranks"):
                dist.all_reduce(vec)  # the ranks that reported: their sums and counts
                values = vec.tolist()  # NCCL: the host waits here, inside the block the watchdog names
        else:
            values = vec.tolist()
        return {k: values[2 * i] / max(values[2 * i + 1], 1.0) for i, k in enumerate(self.keys)}


def _sum_and_count(values: list[Any], dev: torch.device) -> torch.Tensor:
    """[sum, count] of one key's microbatch values: of a (sum, count) pair's parts, or of the values."""
    if isinstance(values[0], (tuple, list)):
        return torch.stack([torch.stack([_as_tensor(v[i], dev) for v in values]).sum() for i in (0, 1)])
    return torch.stack([torch.stack([_as_tensor(v, dev) for v in values]).sum(),
                        torch.full((), float(len(values)), dtype=torch.float64, device=dev)])  # a fill, no copy


def _as_tensor(x: Any, dev: torch.device) -> torch.Tensor:
    """A reported value (a tensor or a number) as a float64 scalar on ``dev``."""
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
