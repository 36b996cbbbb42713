"""Megatron's memory-mapped indexed dataset (the ``MMIDIDX`` .bin/.idx pair).

Byte-compatible with ``megatron/core/datasets/indexed_dataset.py``: files written
here are read by Megatron-LM and the other way round.

Layout of ``<prefix>.idx`` (all little-endian)::

    b"MMIDIDX\\x00\\x00"           9-byte magic
    <Q  version = 1
    <B  dtype code of the tokens   (see ``DType``)
    <Q  sequence count S
    <Q  document count D           (= number of documents + 1)
    int32[S]  sequence lengths     (tokens)
    int64[S]  sequence pointers    (byte offsets into the .bin)
    int64[D]  document indices     (sequence index where each document starts, leading 0)

``<prefix>.bin`` is the token ids of all sequences back to back, in that dtype.
Multimodal files carry an extra int8[S] of sequence modes after the document
indices; we read such files (ignoring the modes) but never write them.
"""
from __future__ import annotations

import os
import struct
from enum import Enum
from typing import Callable, Sequence

import numpy as np
import torch

from parallel3d.data.token_stats import record_max_token_id

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# magic(9) + version(8) + dtype code(1) + sequence count(8) + document count(8)
_INDEX_PREAMBLE_BYTES = 34


class DType(Enum):
    """Numeric codes Megatron stores for the token dtype in the .idx header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: type | np.dtype) -> int:
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            supported = ", ".join(cls.__members__)
            raise ValueError(f"dtype {name} cannot be stored in an MMIDIDX file (supported: {supported})")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        return getattr(np, cls(code).name)

    @staticmethod
    def size(dtype: type | np.dtype) -> int:
        return np.dtype(dtype).itemsize


def best_fitting_dtype(vocab_size: int | None = None) -> type:
    """Token dtype for a vocabulary: uint16 below 65500 ids, else int32 (Megatron's rule)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def _tmp_path(path: str) -> str:
    # pid in the name so two writers aimed at the same prefix never share a temp file
    return f"{path}.tmp-{os.getpid()}"


def _as_numpy(tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().numpy()
    return np.asarray(tokens)


class IndexedDatasetBuilder:
    """Writes a .bin/.idx pair the way Megatron's builder does.

    Tokens go to a temporary file next to ``bin_path``; ``finalize`` writes the
    index to a temporary file too and only then renames both into place, so an
    interrupted run never leaves a matching-looking pair behind.
    """

    def __init__(self, bin_path: str, dtype: type | np.dtype = np.int32) -> None:
        DType.code_from_dtype(dtype)  # reject unsupported dtypes before creating files
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype).type
        self._tmp_bin_path = _tmp_path(bin_path)
        self.data_file = open(self._tmp_bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.max_token_id = -1  # recorded beside the .idx (token_stats) to catch a tokenizer mismatch

    def _to_dtype(self, tokens) -> np.ndarray:
        array = _as_numpy(tokens).reshape(-1)
        if array.dtype == self.dtype:
            return array
        if array.size and np.issubdtype(self.dtype, np.integer):
            # numpy would silently wrap out-of-range ids; a wrapped id is a wrong token
            info = np.iinfo(self.dtype)
            lo, hi = array.min(), array.max()
            if lo < info.min or hi > info.max:
                raise ValueError(
                    f"token ids span [{lo}, {hi}] which does not fit {np.dtype(self.dtype).name} "
                    f"[{info.min}, {info.max}]; pick a wider dtype"
                )
            if np.issubdtype(array.dtype, np.floating) and not np.all(np.floor(array) == array):
                raise ValueError(f"non-integer token values cannot be stored as {np.dtype(self.dtype).name}")
        return array.astype(self.dtype)

    def add_item(self, tokens) -> None:
        """Append one sequence (a tensor, array or list of token ids)."""
        array = self._to_dtype(tokens)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))
        self.max_token_id = max(self.max_token_id, int(array.max())) if array.size else self.max_token_id

    def end_document(self) -> None:
        """Close the current document (for use after one or more ``add_item``)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append a whole document: ``tokens`` split into sequences of ``lengths``."""
        array = self._to_dtype(tokens)
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths) or sum(lengths) != array.size:
            raise ValueError(
                f"document lengths {lengths} (sum {sum(lengths)}) do not cover its {array.size} tokens"
            )
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.max_token_id = max(self.max_token_id, int(array.max())) if array.size else self.max_token_id
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files into place."""
        self.data_file.close()
        itemsize = DType.size(self.dtype)
        lengths = np.array(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {lengths.max()} tokens does not fit the int32 length field")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
        tmp_idx_path = _tmp_path(idx_path)
        with open(tmp_idx_path, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<Q", _INDEX_VERSION))
            f.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.array(self.document_indices, dtype=np.int64).tobytes(order="C"))
        # Drop any old index first: between the two renames there is then no .idx
        # at all, rather than an old .idx next to a new .bin.
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(self._tmp_bin_path, self.bin_path)
        os.replace(tmp_idx_path, idx_path)
        if idx_path.endswith(".idx") and self.bin_path == idx_path[:-4] + ".bin":
            record_max_token_id(idx_path[:-4], self.max_token_id)

    def cancel(self) -> None:
        """Abandon the build: close and delete the temporary data file."""
        if not self.data_file.closed:
            self.data_file.close()
        if os.path.exists(self._tmp_bin_path):
            os.remove(self._tmp_bin_path)


def _check_index(idx_path: str, bin_path: str, bin_size: int, lengths: np.ndarray, pointers: np.ndarray,
                 document_indices: np.ndarray, itemsize: int) -> None:
    """Every sequence inside the .bin and where its predecessor ends; document indices non-decreasing.

    Vectorised (a few passes over the index: milliseconds for millions of sequences), so a corrupt
    entry is refused at open, naming it, rather than read as garbage tokens or a crash mid-training.
    Megatron's writers lay sequences out back to back: pointer[i + 1] = pointer[i] + length[i] * itemsize.
    """
    def refuse(mask: np.ndarray, what: Callable[[int], str]) -> None:
        bad = np.flatnonzero(mask)
        if bad.size:
            i = int(bad[0])
            more = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
            raise ValueError(f"{idx_path}: sequence {i} {what(i)}{more}: corrupt index or mismatched {bin_path}")

    expected_bin = int(pointers[-1]) + int(lengths[-1]) * itemsize if pointers.size else 0
    if bin_size != expected_bin:
        raise ValueError(
            f"{bin_path} is {bin_size} bytes but {idx_path} describes {expected_bin} bytes "
            f"({lengths.size} sequences of {itemsize}-byte tokens): truncated or mismatched pair"
        )
    lengths64 = lengths.astype(np.int64)
    refuse(lengths64 < 0, lambda i: f"has negative length {lengths64[i]}")
    refuse(pointers < 0, lambda i: f"has negative pointer {pointers[i]}")
    # pointers beyond the file first, so the end computation below cannot overflow int64
    refuse(pointers > bin_size, lambda i: f"starts at byte {pointers[i]}, beyond the {bin_size}-byte .bin")
    ends = pointers + lengths64 * itemsize
    refuse(ends > bin_size, lambda i: f"(pointer {pointers[i]} + {lengths64[i]} tokens x {itemsize} bytes = "
                                      f"{ends[i]}) ends beyond the {bin_size}-byte .bin")
    if pointers.size:
        refuse(pointers[:1] != 0, lambda i: f"starts at byte {pointers[0]}, expected 0")
        refuse(np.concatenate(([False], pointers[1:] != ends[:-1])),
               lambda i: f"starts at byte {pointers[i]} but sequence {i - 1} ends at byte {ends[i - 1]}")
    steps = np.diff(document_indices)
    bad = np.flatnonzero(steps < 0)
    if bad.size:
        d = int(bad[0]) + 1
        raise ValueError(f"{idx_path}: document index {d} is {document_indices[d]}, below the previous "
                         f"{document_indices[d - 1]}: document indices must not decrease")


class IndexedDataset(torch.utils.data.Dataset):
    """Read-only, memory-mapped view of a ``<path_prefix>.bin/.idx`` pair.

    ``dataset[i]`` is sequence ``i`` as a numpy array in the file's dtype (a
    read-only view of the mapping, no copy); ``dataset[a:b]`` is a list of them.
    """

    def __init__(self, path_prefix: str) -> None:
        super().__init__()
        self._load(path_prefix)

    def _load(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path} (prefix {path_prefix!r})")

        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            preamble = f.read(_INDEX_PREAMBLE_BYTES)
        if len(preamble) < _INDEX_PREAMBLE_BYTES or preamble[:9] != _INDEX_HEADER:
            raise ValueError(
                f"{idx_path} is not an MMIDIDX index: header {preamble[:9]!r}, expected {_INDEX_HEADER!r}"
            )
        (version,) = struct.unpack("<Q", preamble[9:17])
        if version != _INDEX_VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only version {_INDEX_VERSION} is supported")
        (code,) = struct.unpack("<B", preamble[17:18])
        try:
            self._dtype = DType.dtype_from_code(code)
        except ValueError:
            raise ValueError(f"{idx_path}: unknown dtype code {code}") from None
        sequence_count, document_count = struct.unpack("<QQ", preamble[18:34])

        expected = _INDEX_PREAMBLE_BYTES + 12 * sequence_count + 8 * document_count
        # Megatron's multimodal files append int8 modes per sequence
        if idx_size not in (expected, expected + sequence_count):
            raise ValueError(
                f"{idx_path} is {idx_size} bytes but its header ({sequence_count} sequences, "
                f"{document_count} document indices) implies {expected} bytes: truncated or corrupt"
            )

        self._idx_mmap = np.memmap(idx_path, mode="r", order="C")
        offset = _INDEX_PREAMBLE_BYTES
        self._sequence_lengths = np.frombuffer(self._idx_mmap, np.int32, sequence_count, offset)
        offset += 4 * sequence_count
        self._sequence_pointers = np.frombuffer(self._idx_mmap, np.int64, sequence_count, offset)
        offset += 8 * sequence_count
        self._document_indices = np.frombuffer(self._idx_mmap, np.int64, document_count, offset)

        if document_count == 0 or self._document_indices[0] != 0 or self._document_indices[-1] != sequence_count:
            first = self._document_indices[0] if document_count else None
            last = self._document_indices[-1] if document_count else None
            raise ValueError(
                f"{idx_path}: document indices must run from 0 to the sequence count {sequence_count}, "
                f"found first={first} last={last} ({document_count} entries)"
            )
        bin_size = os.path.getsize(bin_path)
        _check_index(idx_path, bin_path, bin_size, self._sequence_lengths, self._sequence_pointers,
                     self._document_indices, DType.size(self._dtype))
        # numpy cannot map an empty file
        self._bin_mmap = np.memmap(bin_path, mode="r", order="C") if bin_size else np.empty(0, np.uint8)

    # DataLoader workers started by spawn pickle the dataset: reopen the mapping there.
    def __getstate__(self) -> str:
        return self.path_prefix

    def __setstate__(self, path_prefix: str) -> None:
        self._load(path_prefix)

    def __len__(self) -> int:
        return self._sequence_lengths.shape[0]

    def _check_idx(self, idx: int) -> int:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.path_prefix}")
        return idx

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into an IndexedDataset must be contiguous, got step {step}")
            if stop <= start:
                return []
            lengths = self._sequence_lengths[start:stop]
            tokens = np.frombuffer(
                self._bin_mmap, self._dtype, int(lengths.sum()), int(self._sequence_pointers[start])
            )
            return np.split(tokens, np.cumsum(lengths)[:-1])
        raise TypeError(f"unexpected index type {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        idx = self._check_idx(int(idx))
        seq_len = int(self._sequence_lengths[idx])
        offset = int(offset)
        length = seq_len - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {seq_len}"
            )
        pointer = int(self._sequence_pointers[idx]) + offset * DType.size(self._dtype)
        return np.frombuffer(self._bin_mmap, self._dtype, length, pointer)

    @property
    def dtype(self) -> type:
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))
