"""Checkpoint integrity: every file's checksum and rank, checked before use; loads that run no code.

``save_checkpoint`` records each file it writes in ``metadata.json``, keyed by its path
relative to the iteration directory::

    "files": {"mp_rank_01_000/model.safetensors":
                  {"sha256": "9f2c...", "bytes": 81920, "tp_rank": 1, "pp_rank": 0, "dp_rank": 0, "rank": 1},
              "rng/rank_00001.pt": {...}, ...}

The SHA-256 (hashlib: no new dependency) is computed from the bytes as they are written,
never by reading the file back. A load hashes each file it is about to use in one
streaming pass (the pages it then maps are in the page cache), so flipped bytes, a
truncated file or another rank's file (swapped shards: its digest is that of another
record) is refused with a message naming the file. Checkpoints saved before checksums
were kept (format version 1) load with a one-line warning. Every file is opened only inside its
iteration directory (``confined_path``): a listed name with ``..`` or an absolute path, or a symlink
resolving outside, is refused before anything about its target is looked at.

``optimizer.pt`` and ``rng/*.pt`` are read with ``torch.load(weights_only=True)``: tensors,
numbers, strings, lists and dicts only. A planted pickle payload (``__reduce__``) is refused,
never run.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import warnings
from typing import Any, Optional

import torch
from safetensors import safe_open

from parallel3d.training.safetensors_stream import StreamingSafetensorsWriter

FILES_KEY = "files"
CHECKSUMS_SINCE = 2  # from this format version on, every checkpoint records checksums
_RANK_DIR = re.compile(r"^mp_rank_(\d+)_(\d+)/model\.safetensors$")
_READ_CHUNK = 1 << 24


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and what is wrong."""


class CheckpointWarning(UserWarning):
    pass


class HashingFile:
    """Write-only file wrapper hashing every byte on its way out (``torch.save`` writes sequentially)."""

    def __init__(self, f: Any):
        self._f = f
        self._sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._sha256.update(view)
        self.bytes += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()


def torch_save_hashed(obj: Any, path: str) -> dict[str, Any]:
    """``torch.save`` to ``path``, fsynced; returns its {"sha256", "bytes"} record, hashed while written."""
    with open(path, "wb") as f:
        out = HashingFile(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": out.hexdigest(), "bytes": out.bytes}


def write_json(path: str, obj: Any) -> None:
    """metadata.json and the per-rank file records: written and fsynced (a rename of their directory follows)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def safetensors_save_hashed(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write a safetensors file in declared order (so it is hashed as written); returns its record."""
    writer = StreamingSafetensorsWriter(path, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, metadata)
    try:
        for key, t in tensors.items():
            writer.write(key, t)
        return {"sha256": writer.close(), "bytes": os.path.getsize(path)}
    except BaseException:
        writer.abort()
        raise


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def write_error(path: str, error: BaseException) -> CheckpointError:
    """A CheckpointError for a file a save could not write: errno by name (ENOSPC, EACCES, ...) and the path."""
    cause: Optional[BaseException] = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        why = f"{errno.errorcode.get(cause.errno, cause.errno)} ({os.strerror(cause.errno)})"
    else:  # torch.save into a full disk says "basic_ios::clear: iostream error", no errno
        why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
        why += f"; {free} bytes free on that filesystem"
    except OSError:
        pass
    return CheckpointError(f"cannot write checkpoint file {path}: {why}")


def check_save_dir_writable(save_dir: str) -> None:
    """Create ``save_dir`` if needed and write (then remove) a probe file: an unusable --save fails now, not
    at the first save hours later."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=save_dir)
        try:
            os.write(fd, b"parallel3d")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save directory {save_dir!r} is not writable ({e.strerror or e}): choose a directory "
                              "this user can create and write, or fix its permissions or mount") from None


def load_torch_file(path: str, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``: a file holding anything but tensors and plain data is refused, not run.

    ``mmap``: map the file (tensors are read when used); a pre-zipfile torch.save is read whole instead.
    """
    try:
        if mmap:
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:
                pass
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(Unsupported global|unsupported GLOBAL)[^\n]*", str(e))
        detail = found.group(0) if found else str(e).strip().splitlines()[0]
        raise CheckpointError(f"refused to load {path}: it holds objects other than tensors and plain data, "
                              f"which could run code when loaded ({detail})") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {path}: {first} (truncated or corrupt file)") from e


_WARNED_UNVERIFIED: set[str] = set()


def warn_unverified(ckpt_dir: str) -> None:
    """One line per checkpoint and process, however many of its files are read."""
    if ckpt_dir not in _WARNED_UNVERIFIED:
        _WARNED_UNVERIFIED.add(ckpt_dir)
        warnings.warn(f"{ckpt_dir} records no checksums (saved before they were kept): its files load unverified",
                      CheckpointWarning, stacklevel=3)


def check_shard_header(path: str, header: Optional[dict[str, str]], meta: dict[str, Any], tp_rank: int,
                       pp_rank: int) -> None:
    """What a model.safetensors header records, checked even where metadata.json lists no checksums: the format
    version that wrote it (one that always records checksums cannot have none: a downgrade) and the (TP, PP) rank
    that wrote it (files swapped between ranks or pipeline stages, whatever their sizes)."""
    header = header or {}
    version = header.get("format_version", "")
    if meta.get(FILES_KEY) is None and version.isdigit() and int(version) >= CHECKSUMS_SINCE:
        raise CheckpointError(f"{path} was written by format version {version}, which always records checksums, but "
                              "metadata.json lists none (removed after the save?): refusing to load it unverified")
    for key, want in (("tp_rank", tp_rank), ("pp_rank", pp_rank)):
        if header.get(key) is not None and header[key] != str(want):
            raise CheckpointError(f"{path} was written by {key}={header[key]}, but this process ({key}={want}) is "
                                  "loading it (files swapped between ranks or pipeline stages?)")


def relpath_problem(rel: Any) -> Optional[str]:
    """Why ``rel`` (a file name metadata.json lists) is not a plain path inside the iteration directory, or None."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        return "not a file name"
    if rel.startswith(("/", "~")) or os.path.isabs(rel):
        return "an absolute path, not one inside the checkpoint directory"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "a path leaving the checkpoint directory ('..' or an empty part)"
    return None


def confined_path(ckpt_dir: str, rel: str) -> str:
    """``ckpt_dir``/``rel``; a CheckpointError when it would leave ``ckpt_dir`` (an absolute path, ``..``, or a
    symlink resolving outside). Nothing about a file outside is looked at or reported, not even whether it exists."""
    problem = relpath_problem(rel)
    if problem:
        raise CheckpointError(f"{os.path.join(ckpt_dir, 'metadata.json')} lists file {rel!r:.80}: {problem}; "
                              "refusing to read it")
    path = os.path.join(ckpt_dir, *rel.split("/"))
    root = os.path.realpath(ckpt_dir)
    if not os.path.realpath(path).startswith(root + os.sep):
        raise CheckpointError(f"{path} is a symlink leaving the checkpoint directory {ckpt_dir}: refusing to read it")
    return path


def check_file(ckpt_dir: str, meta: dict[str, Any], relpath: str, **ranks: int) -> str:
    """Path of ``relpath`` under ``ckpt_dir`` once its size, checksum and ranks match its record.

    ``ranks`` (tp_rank=..., rank=...) are what the loading process expects the record to say.
    """
    path = confined_path(ckpt_dir, relpath)
    files = meta.get(FILES_KEY)
    if files is None:
        warn_unverified(ckpt_dir)
        return path
    record = files.get(relpath)
    if record is None:
        raise CheckpointError(f"{path} is not in the file list of {os.path.join(ckpt_dir, 'metadata.json')}: "
                              "no checksum to verify it against")
    for key, want in ranks.items():
        if record.get(key) != want:
            raise CheckpointError(f"{path} is recorded as written by {key}={record.get(key)}, but this process "
                                  f"({key}={want}) is loading it")
    problem = file_problem(path, record, files)
    if problem:
        raise CheckpointError(f"{path} {problem}")
    return path


def file_problem(path: str, record: dict[str, Any], files: dict[str, dict[str, Any]]) -> Optional[str]:
    """What is wrong with ``path`` against its record ("is missing", "fails its checksum ..."), or None."""
    if not os.path.isfile(path):
        return "is missing"
    size = os.path.getsize(path)
    if size != record.get("bytes") and not any(r.get("bytes") == size for r in files.values()):
        return f"is {size} bytes but was saved as {record.get('bytes')} bytes: truncated or overwritten"
    digest = sha256_file(path)  # the size of another file: swapped (pipeline stages differ in size)?
    if digest == record.get("sha256"):
        return None
    same = sorted(name for name, r in files.items() if r.get("sha256") == digest)
    if same:
        return (f"fails its checksum: its content is that of {same[0]} (files swapped or copied between ranks?)")
    if size != record.get("bytes"):
        return f"is {size} bytes but was saved as {record.get('bytes')} bytes: truncated or overwritten"
    return (f"fails its checksum (SHA-256 {digest[:16]}..., saved as {str(record.get('sha256'))[:16]}...): "
            "its bytes changed since it was saved")


def verify_files(ckpt_dir: str, meta: dict[str, Any], shards: list[str]) -> list[str]:
    """One line per bad file of a checkpoint directory (empty: all good).

    ``shards``: the model files its layout implies (``mp_rank_XX_YYY/model.safetensors``); a training save
    (one with RNG files) must also hold an optimizer state per shard and an RNG state per rank. Every
    recorded file is checked against its checksum, and files on disk that are not recorded are named. A
    checkpoint saved before checksums were kept gets a warning, and each of its files is opened instead.
    """
    files = meta.get(FILES_KEY)
    present = sorted(os.path.relpath(os.path.join(root, n), ckpt_dir).replace(os.sep, "/")
                     for root, _, names in os.walk(ckpt_dir) for n in names
                     if root != ckpt_dir or n not in ("metadata.json", "metadata.json.sha256"))
    problems: list[str] = []

    def inside(rel: str) -> Optional[str]:
        try:
            return confined_path(ckpt_dir, rel)
        except CheckpointError as e:
            problems.append(str(e))
            return None
    if files is None:
        warn_unverified(ckpt_dir)
        problems += [f"{os.path.join(ckpt_dir, rel)} is missing" for rel in shards if rel not in present]
        for rel in present:
            path = inside(rel)
            try:
                if path is not None and rel.endswith(".safetensors"):
                    with safe_open(path, framework="pt") as f:
                        list(f.keys())
                        ranks = _RANK_DIR.match(rel)
                        if ranks:
                            check_shard_header(path, f.metadata(), meta, int(ranks.group(1)), int(ranks.group(2)))
                elif path is not None and rel.endswith(".pt"):
                    load_torch_file(path)
            except CheckpointError as e:
                problems.append(str(e))
            except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
                problems.append(f"cannot read {path}: {e}")
        return problems
    expected = list(shards)
    if any(rel.startswith("rng/") for rel in files):  # a training save, not a converted checkpoint: all state
        expected += [rel.replace("model.safetensors", "optimizer.pt") for rel in shards]
        expected += [f"rng/rank_{r:05d}.pt" for r in range(int(meta.get("world_size", 1)))]
    problems += [f"{os.path.join(ckpt_dir, rel)} belongs to the saved layout but is not in the file list of "
                 "metadata.json" for rel in expected if rel not in files]
    for rel, record in sorted(files.items()):
        path = inside(rel)
        problem = file_problem(path, record, files) if path is not None else None
        if problem:
            problems.append(f"{path} {problem}")
    problems += [f"{os.path.join(ckpt_dir, rel)} is not part of the checkpoint as saved (not in metadata.json)"
                 for rel in present if rel not in files]
    return problems
