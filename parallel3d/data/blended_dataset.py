"""Megatron's BlendedDataset: interleave several datasets in fixed proportions.

The interleaving is Megatron's greedy ``build_blending_indices``: sample ``i``
comes from the dataset whose count lags its target the most, the error being
``weight * max(i, 1) - count`` (first dataset wins ties). It is deterministic
and keeps every dataset within about one sample of its weighted share at every
prefix, so the same weights give the same order as Megatron-LM.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def normalize(weights: Sequence[float]) -> list[float]:
    """Scale weights to sum to 1 (no exponentiation), as Megatron does."""
    w = np.array(weights, dtype=np.float64)
    if w.size == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.max() <= 0:
        raise ValueError(f"blend weights must be finite, non-negative and sum to > 0, got {list(weights)}")
    w = w / w.max()  # first to at most 1: weights near the float maximum would sum to inf
    return (w / w.sum()).tolist()


def get_blend_from_list(blend: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path`` list -> (prefixes, weights or None).

    ``["A"]`` or ``["A", "B"]``-style lists of prefixes have no weights;
    ``["0.3", "A", "0.7", "B"]`` is weight/prefix pairs.
    """
    blend = [str(x).strip() for x in blend]
    if not blend:
        raise ValueError("data_path is empty: give a prefix or weight/prefix pairs")
    if len(blend) % 2 == 0:
        weights = []
        for raw in blend[0::2]:
            try:
                weights.append(float(raw))
            except ValueError:
                weights = None
                break
        if weights is not None:
            for raw, w, prefix in zip(blend[0::2], weights, blend[1::2]):
                if not (np.isfinite(w) and w > 0):
                    raise ValueError(f"--data-path weight {raw!r} of {prefix} must be a finite number > 0")
            return list(blend[1::2]), weights
    for entry in blend:
        try:
            float(entry)
        except ValueError:
            continue
        raise ValueError(f"data_path {blend} mixes weights and prefixes; give 'w1 p1 w2 p2 ...' or only prefixes")
    return list(blend), None


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[size], dataset_sample_index int64[size]) by Megatron's greedy rule."""
    num_datasets = len(weights)
    if not 0 < num_datasets < 32767:
        raise ValueError(f"need 1 to 32766 datasets to blend, got {num_datasets}")
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    w = [float(x) for x in weights]
    counts = [0] * num_datasets
    datasets = range(num_datasets)
    # Plain Python floats keep this loop identical, bit for bit, to the C++ doubles.
    for i in range(size):
        scale = float(max(i, 1))
        best = 0
        best_error = w[0] * scale - counts[0]
        for j in datasets:
            error = w[j] * scale - counts[j]
            if error > best_error:
                best, best_error = j, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    Items are the constituent's item dict plus ``dataset_id`` (as in Megatron).
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        # Check here, not on some later __getitem__, that no constituent is overdrawn.
        for j, dataset in enumerate(self.datasets):
            needed = int(np.count_nonzero(self.dataset_index == j))
            if needed > len(dataset):
                raise ValueError(
                    f"blend needs {needed} samples from dataset {j} (weight {self.weights[j]:.6f} of {self.size}) "
                    f"but it holds only {len(dataset)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} blended samples")
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": torch.tensor(dataset_id, dtype=torch.long), **sample}
