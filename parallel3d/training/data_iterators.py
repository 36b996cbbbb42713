"""The loop's data: one iterator per model chunk over Megatron's sample counts, resuming at the consumed samples."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from parallel3d import parallel_state
from parallel3d.data import build_pretraining_data_loader
from parallel3d.training.megatron_args import samples_consumed
from parallel3d.training.training_config import TrainingConfig


def _cyclic(loader: Optional[torch.utils.data.DataLoader]) -> Optional[Iterator]:
    if loader is None:
        return None

    def gen():
        while True:
            yield from loader

    return gen()


def build_data_iterators(datasets_provider: Callable, config: TrainingConfig, consumed_train: int,
                         consumed_valid: int, num_chunks: int):
    """(train, valid, test): one iterator per model chunk each (every chunk sees the same sequence of
    microbatches); an entry is None where the datasets provider gave no such split."""
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
    test = [_cyclic(loader(test_ds, 0)) for _ in range(num_chunks)]  # read once, at the end (Megatron's)
    return train, valid, test
