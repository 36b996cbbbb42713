"""The largest token id of a .bin/.idx pair, recorded beside it, to catch data tokenized for another vocabulary.

Data preprocessed with an 8,000-token BPE and trained with the 257-token byte tokenizer used to
train to the end at ``loss inf`` (TP > 1) or crash deep in the embedding (TP = 1). The writer
(IndexedDatasetBuilder) records the largest id in ``<prefix>.stats.json`` for free while it
writes; files written elsewhere (Megatron-LM's tools, older parallel3d) get one vectorised scan
of the .bin on first use, cached in the same file. The cache names the .bin's size, modification
and change times and a hash of 64 blocks sampled over it, so a rewritten .bin is scanned again,
even one whose modification time was set back (the change time cannot be).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

_CHUNK = 1 << 24  # tokens per scan step: bounded memory for any file size
_SAMPLES, _BLOCK = 64, 4096  # the sampled hash reads 256 KiB at most


def stats_path(prefix: str) -> str:
    return prefix + ".stats.json"


def _sampled_sha256(bin_path: str, size: int) -> str:
    """SHA-256 of ``_SAMPLES`` blocks spread evenly over the file (first and last included): a few reads."""
    h = hashlib.sha256()
    with open(bin_path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _BLOCK) * i // (_SAMPLES - 1)))
            h.update(f.read(_BLOCK))
    return h.hexdigest()


def _bin_key(bin_path: str) -> dict[str, Any]:
    """What ties a record to the .bin: its size, its times (ctime cannot be set back, unlike the mtime) and a
    sampled content hash."""
    st = os.stat(bin_path)
    return {"bin_size": st.st_size, "bin_mtime_ns": st.st_mtime_ns, "bin_ctime_ns": st.st_ctime_ns,
            "bin_sampled_sha256": _sampled_sha256(bin_path, st.st_size)}


def record_max_token_id(prefix: str, max_token_id: int) -> None:
    """Write ``<prefix>.stats.json`` for the .bin as it is now (atomically; a read-only folder is skipped)."""
    record = {"max_token_id": int(max_token_id), **_bin_key(prefix + ".bin")}
    tmp = f"{stats_path(prefix)}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, stats_path(prefix))
    except OSError:  # the cache is an optimisation: a read-only dataset folder is scanned each time
        if os.path.exists(tmp):
            os.remove(tmp)


def scan_max_token_id(bin_path: str, dtype: type) -> int:
    """The largest token id in ``bin_path`` (-1 when empty), read in chunks of 16M tokens."""
    data = np.memmap(bin_path, dtype=dtype, mode="r") if os.path.getsize(bin_path) else np.empty(0, dtype)
    best = -1
    for start in range(0, data.size, _CHUNK):
        best = max(best, int(data[start:start + _CHUNK].max()))
    return best


def max_token_id(prefix: str, dtype: type) -> int:
    """The recorded largest token id of ``prefix``, scanning (and recording) it if no valid record exists."""
    try:
        with open(stats_path(prefix)) as f:
            record = json.load(f)
        key = _bin_key(prefix + ".bin")
        if {k: record.get(k) for k in key} == key:
            return int(record["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    value = scan_max_token_id(prefix + ".bin", dtype)
    record_max_token_id(prefix, value)
    return value


def check_tokens_fit_vocab(prefix: str, dtype: type, vocab_size: int, tokenizer: str) -> None:
    """Refuse data whose largest token id is outside the vocabulary, with both numbers and the file."""
    largest = max_token_id(prefix, dtype)
    if largest >= vocab_size:
        raise ValueError(f"{prefix}.bin holds token id {largest} but the vocabulary has {vocab_size} ids "
                         f"({tokenizer}): the data was tokenized with another tokenizer. Train with the tokenizer "
                         "it was preprocessed with, or re-run tools/preprocess_data.py with this one")
