"""Evaluation: ``--eval-iters`` forward-only passes, their losses averaged."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from parallel3d.pipeline import forward_backward
from parallel3d.training.step import LossAverager
from parallel3d.training.training_config import TrainingConfig


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
