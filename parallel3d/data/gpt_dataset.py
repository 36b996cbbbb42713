"""Megatron's GPTDataset: fixed-length samples over a shuffled document stream.

Three indices, built exactly as Megatron-Core builds them (same RandomState draws
in the same order, so the same seed gives the same samples as Megatron-LM):

* document index: the split's documents repeated for enough epochs, shuffled;
* sample index: (position in the document index, token offset) where every
  sample starts; sample ``i`` is the ``seq_length + 1`` tokens that start at token
  ``i * seq_length`` of the concatenated stream, so consecutive samples share one
  token (the last label of one is the first input of the next);
* shuffle index: a permutation of the samples.

The indices are built in memory (a vectorised numpy equivalent of Megatron's
C++ ``build_sample_idx``); nothing is cached on disk.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from parallel3d.data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


@dataclass
class GPTDatasetConfig:
    """Options of Megatron's GPTDatasetConfig that shape a sample.

    random_seed: seed of every shuffle (Megatron's ``--seed``).
    sequence_length: tokens per sample input (``--seq-length``).
    eod_token: id of the end-of-document token; needed by eod_mask_loss / reset_position_ids.
    eod_mask_loss: zero the loss mask on eod tokens (``--eod-mask-loss``).
    reset_position_ids: restart position ids after every eod (``--reset-position-ids``).
    """

    random_seed: int
    sequence_length: int
    eod_token: int | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False

    def __post_init__(self) -> None:
        if self.sequence_length < 1:
            raise ValueError(f"sequence_length must be >= 1, got {self.sequence_length}")
        if not 0 <= self.random_seed < 2**32:
            raise ValueError(f"random_seed must be in [0, 2**32) for numpy RandomState, got {self.random_seed}")
        if (self.eod_mask_loss or self.reset_position_ids) and self.eod_token is None:
            raise ValueError("eod_mask_loss and reset_position_ids need eod_token")


def parse_and_normalize_split(split: str) -> list[float]:
    """"969,30,1" -> [0.969, 0.030, 0.001]; missing trailing parts count as 0."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"split {split!r} must have 1 to 3 comma-separated weights, got {len(parts)}")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    if total <= 0:
        raise ValueError(f"split {split!r} weights sum to {total}, need a positive sum")
    return (np.array(parts, dtype=np.float64) / total).tolist()


def convert_split_vector_to_split_matrix(vector: list[float]) -> list[tuple[float, float] | None]:
    """[0.99, 0.01, 0.0] -> [(0, 0.99), (0.99, 1.0), None]: book-ends per split, None if empty."""
    ends = [0.0]
    for v in vector:
        ends.append(ends[-1] + v)
    return [(a, b) if b > a else None for a, b in zip(ends[:-1], ends[1:])]


def get_split_indices(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """Document range [begin, end) per train/valid/test split, None for a 0-weight split.

    Same rounding as Megatron-Core: ``begin = round(lo * N)``, ``end = round(hi * N)``.
    """
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        None if bounds is None else (int(round(bounds[0] * float(num_documents))), int(round(bounds[1] * float(num_documents))))
        for bounds in matrix
    ]


def _build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(document_index)
        return document_index
    # The short final epoch is shuffled on its own so its documents are not
    # spread thinly over the whole run (Megatron's rule).
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    last = _build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """[num_samples + 1, 2] of (document index position, token offset) per sample start.

    Sample i starts at global token i * seq_length. Equivalent to Megatron's C++
    build_sample_idx with drop_last_partial_sequence and add_extra_token_to_sequence.
    """
    doc_lengths = sequence_lengths[document_index].astype(np.int64)
    starts = np.zeros(doc_lengths.size + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" lands on the last document starting at or before the position,
    # which skips empty documents the way the C++ walk does
    doc = np.searchsorted(starts, positions, side="right") - 1
    sample_index = np.stack((doc, positions - starts[doc]), axis=1)
    sample_index[0] = (0, 0)  # the C++ walk always starts at the first entry
    return sample_index


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``sequence_length`` tokens (plus the shifted labels) from one IndexedDataset.

    ``indexed_indices`` are the sequence ids this split may use (a contiguous range
    for train/valid/test); ``num_samples`` None means exactly one epoch.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        config: GPTDatasetConfig,
    ) -> None:
        if index_split not in SPLIT_NAMES:
            raise ValueError(f"index_split must be one of {SPLIT_NAMES}, got {index_split!r}")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indexed_indices, dtype=np.int64)
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        if self.indices.size == 0:
            raise ValueError(f"{index_split} split of {dataset_path} has no documents to sample from")
        if self.indices.min() < 0 or self.indices.max() >= len(indexed_dataset):
            raise ValueError(
                f"document ids span [{self.indices.min()}, {self.indices.max()}] but {dataset_path} "
                f"holds {len(indexed_dataset)} sequences"
            )
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    def _num_tokens_per_epoch(self) -> int:
        return int(np.sum(self.dataset.sequence_lengths[self.indices], dtype=np.int64))

    def _num_epochs(self, num_tokens_per_epoch: int) -> int:
        if self.num_samples is None:
            return 1
        # +1: the last sample needs one token past its input for its final label
        num_tokens_requested = self.num_samples * self.config.sequence_length + 1
        return max(1, -(-num_tokens_requested // num_tokens_per_epoch))

    def _build_document_sample_shuffle_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        seq_length = self.config.sequence_length
        num_tokens_per_epoch = self._num_tokens_per_epoch()
        if num_tokens_per_epoch == 0:
            raise ValueError(
                f"{self.index_split} split of {self.dataset_path} ({self.indices.size} documents) holds no tokens"
            )
        num_epochs = self._num_epochs(num_tokens_per_epoch)

        separate_final_epoch = False
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - 1) // seq_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - 1) // seq_length
            assert 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1
            separate_final_epoch = num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)

        rng = np.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        num_samples_total = (num_epochs * num_tokens_per_epoch - 1) // seq_length
        sample_index = _build_sample_index(self.dataset.sequence_lengths, document_index, seq_length, num_samples_total)
        num_shuffled_first = num_samples_sans_final_epoch if separate_final_epoch else num_samples_total
        shuffle_index = _build_shuffle_index(num_shuffled_first, num_samples_total, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def _query_document_sample_shuffle_indices(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        """The seq_length + 1 tokens of sample ``idx`` and the document ids they come from."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        idx = int(self.shuffle_index[idx])
        doc_beg, offset_beg = (int(x) for x in self.sample_index[idx])
        doc_end, offset_end = (int(x) for x in self.sample_index[idx + 1])
        document_ids, parts = [], []
        for i in range(doc_beg, doc_end + 1):
            doc_id = int(self.document_index[i])
            offset = offset_beg if i == doc_beg else 0
            # the end offset is inclusive: it is the extra token that becomes the last label
            length = offset_end + 1 - offset if i == doc_end else None
            document_ids.append(doc_id)
            parts.append(self.dataset.get(doc_id, offset=offset, length=length))
        return np.concatenate(parts).astype(np.int64), np.array(document_ids, dtype=np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text, _ = self._query_document_sample_shuffle_indices(idx)
        text = torch.from_numpy(text)
        tokens = text[:-1].contiguous()
        labels = text[1:].contiguous()
        loss_mask, position_ids = get_ltor_loss_mask_and_position_ids(
            tokens, self.config.eod_token, self.config.reset_position_ids, self.config.eod_mask_loss
        )
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def get_ltor_loss_mask_and_position_ids(
    tokens: torch.Tensor, eod_token: int | None, reset_position_ids: bool, eod_mask_loss: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask (float, 0 on eod inputs when eod_mask_loss) and position ids for one sample.

    Megatron's _get_ltor_masks_and_position_ids without the attention mask: the
    causal mask is built by the attention layer.
    """
    seq_length = tokens.numel()
    loss_mask = torch.ones(seq_length, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long)
    if reset_position_ids:
        # positions restart at 0 on the token after each eod
        eod_positions = (tokens == eod_token).nonzero().flatten().tolist()
        prev = 0
        for i in eod_positions:
            position_ids[i + 1 :] -= i + 1 - prev
            prev = i + 1
    return loss_mask, position_ids


# Megatron builds each blended constituent with this many extra samples
# (mid_level_dataset_surplus) so the greedy blend never runs one dry.
MID_LEVEL_DATASET_SURPLUS = 0.005


def _build_splits_for_prefix(
    prefix: str, split: str, sizes: list[int | None], config: GPTDatasetConfig
) -> list[GPTDataset | None]:
    indexed = IndexedDataset(prefix)
    datasets: list[GPTDataset | None] = []
    for name, bounds, size in zip(SPLIT_NAMES, get_split_indices(split, len(indexed)), sizes):
        if bounds is None:
            datasets.append(None)
            continue
        begin, end = bounds
        if end <= begin:
            raise ValueError(
                f"{name} split of {prefix} is empty: documents [{begin}, {end}) of {len(indexed)}; "
                f"use fewer splits or more documents"
            )
        datasets.append(GPTDataset(indexed, prefix, np.arange(begin, end), size, name, config))
    return datasets


def build_train_valid_test_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    eod_token: int | None = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
) -> tuple:
    """(train, valid, test) datasets from Megatron's ``--data-path`` and ``--split``.

    ``data_path`` is ``[prefix]``, several prefixes (blended in proportion to
    their one-epoch sizes) or weight/prefix pairs ``["0.3", "A", "0.7", "B"]``.
    A split of weight 0 is None. With one prefix each split is a GPTDataset of at
    least the requested samples; with a blend it is a BlendedDataset.
    """
    from parallel3d.data.blended_dataset import BlendedDataset, get_blend_from_list, normalize

    sizes = [int(n) for n in train_valid_test_num_samples]
    if len(sizes) != 3 or any(n < 0 for n in sizes):
        raise ValueError(f"train_valid_test_num_samples must be 3 non-negative ints, got {train_valid_test_num_samples}")
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, eod_token=eod_token,
                              eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids)
    prefixes, weights = get_blend_from_list(data_path)
    parse_and_normalize_split(split)  # a bad split string fails before any file is opened
    for prefix in prefixes:
        for path in (prefix + ".idx", prefix + ".bin"):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path} (from data_path {list(data_path)})")

    if len(prefixes) == 1:
        return tuple(_build_splits_for_prefix(prefixes[0], split, sizes, config))

    def blend(per_prefix: list, make: Callable[[int, list], BlendedDataset]) -> tuple:
        """Split s of every prefix blended by ``make(s, parts)``; None where the split is empty."""
        splits = [[datasets[s] for datasets in per_prefix] for s in range(3)]
        return tuple(None if parts[0] is None else make(s, parts) for s, parts in enumerate(splits))

    if weights is None:
        # Blend by size: one epoch of each, drawn in proportion to their lengths.
        per_prefix = [_build_splits_for_prefix(p, split, [None] * 3, config) for p in prefixes]
        return blend(per_prefix, lambda s, parts: BlendedDataset(
            parts, [len(d) for d in parts], min(sizes[s], sum(len(d) for d in parts))))

    weights = normalize(weights)
    # Target samples per dataset per split, and what we build of each (with surplus).
    target = [[math.ceil(size * w) for size in sizes] for w in weights]
    buffered = [[math.ceil(t * (1 + MID_LEVEL_DATASET_SURPLUS)) for t in row] for row in target]
    per_prefix = [_build_splits_for_prefix(p, split, buffered[k], config) for k, p in enumerate(prefixes)]
    return blend(per_prefix, lambda s, parts: BlendedDataset(parts, weights, sum(row[s] for row in target)))
