"""Megatron's pretraining batch samplers and the DataLoader built on them.

Both samplers yield, for this data-parallel rank, one list of ``micro_batch_size``
sample indices per micro-batch, and resume exactly from ``consumed_samples``
(the number of samples all DP ranks together have consumed), which is what the
training loop checkpoints.
"""
from __future__ import annotations

from typing import Iterator

import torch


class _PretrainingSampler:
    """What both samplers check and hold."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int) -> None:
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: total_samples={total_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be > 0, got {data_parallel_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples


class MegatronPretrainingSampler(_PretrainingSampler):
    """Sequential sampler: global batches of ``micro_batch_size * dp`` consecutive
    indices from ``consumed_samples`` on; rank r takes slice ``[r*mbs, (r+1)*mbs)``.

    A final partial global batch is dropped unless ``drop_last=False``, in which
    case each rank yields its part of it (possibly short; nothing if it is empty).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"no samples left to consume: consumed_samples={consumed_samples}, total_samples={total_samples}")
        self.drop_last = drop_last

    def get_start_end_idx(self) -> tuple[int, int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        start, end = self.get_start_end_idx()
        stride = self.micro_batch_times_data_parallel_size
        first = self.consumed_samples
        num_full = (self.total_samples - first) // stride
        for b in range(num_full):
            base = first + b * stride
            yield list(range(base + start, base + end))
        tail = first + num_full * stride
        if tail < self.total_samples and not self.drop_last:
            batch = list(range(tail, self.total_samples))[start:end]
            if batch:  # ranks past the tail get nothing rather than an empty batch
                yield batch


class MegatronPretrainingRandomSampler(_PretrainingSampler):
    """Epoch-shuffled sampler (Megatron's ``--dataloader-type cyclic``).

    Each epoch covers ``total_samples`` rounded down to whole global batches,
    shuffled with a generator seeded by ``seed + epoch`` (Megatron seeds with the
    epoch alone, i.e. ``seed=0`` reproduces it), so no sample repeats within an
    epoch. With ``data_sharding`` each rank shuffles its own contiguous bucket;
    without it all ranks shuffle everything and take every dp-th index.
    Iterating yields the rest of the current epoch; iterate again for the next.
    """

    def __init__(
        self,
        dataset,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset, self.data_sharding, self.seed = dataset, data_sharding, seed
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(
                f"total_samples={total_samples} is less than one global batch "
                f"(micro_batch_size {micro_batch_size} x data_parallel_size {data_parallel_size})"
            )
        if consumed_samples % self.micro_batch_times_data_parallel_size:
            raise ValueError(
                f"consumed_samples={consumed_samples} is not a multiple of micro_batch_size x "
                f"data_parallel_size = {self.micro_batch_times_data_parallel_size}"
            )

    def __iter__(self) -> Iterator[list[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples

        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=g).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            idx_range_total = torch.randperm(full_bucket_size, generator=g).tolist()
            idx_range = idx_range_total[current_epoch_samples:][self.data_parallel_rank :: self.data_parallel_size]

        batch: list[int] = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    dataloader_type: str = "single",
    num_workers: int = 0,
    seed: int = 0,
    data_sharding: bool = True,
    drop_last: bool = True,
) -> torch.utils.data.DataLoader | None:
    """A DataLoader over ``dataset`` for this DP rank (None when dataset is None).

    dataloader_type: "single" (MegatronPretrainingSampler) or "cyclic"
    (MegatronPretrainingRandomSampler), as Megatron's ``--dataloader-type``.
    """
    if dataset is None:
        return None
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    common = dict(total_samples=len(dataset), consumed_samples=consumed_samples, micro_batch_size=micro_batch_size,
                  data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size)
    if dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(**common, drop_last=drop_last)
    elif dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(dataset, **common, data_sharding=data_sharding, seed=seed)
    else:
        raise ValueError(f"dataloader_type must be 'single' or 'cyclic', got {dataloader_type!r}")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        # Its own generator: starting an epoch must not draw from the global RNG, or dropout
        # after a resume (which builds fresh loaders) would differ from an uninterrupted run.
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
