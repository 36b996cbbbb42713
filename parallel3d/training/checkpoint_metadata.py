"""Finding a checkpoint (the tracker, ``iter_N``) and its metadata.json: written with its own checksum beside
it, read through a schema.

A directory holding ``iter_*`` checkpoints but no tracker is refused (naming the newest complete
iteration and the command that restores the tracker), never taken as empty: a run starting from
scratch there would overwrite them. The iteration metadata.json records must be the one its
directory name and the tracker say.

Format versions: 1 recorded file checksums only in later saves (a checkpoint without them loads with
a warning); 2 (written now) always records every file's checksum in ``files`` and keeps
``metadata.json.sha256`` (``sha256sum`` format) beside metadata.json. A version-2 checkpoint
without either is refused: deleting the checksums cannot turn verification off. A sidecar that is
present is checked whatever the version says.

Every field a loader or tool uses is checked, with bounds, before use: a malformed file is refused
in one line naming metadata.json and the field, never a traceback or an unbounded loop. File names
in ``files`` must be plain relative paths inside the iteration directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from typing import Any, Optional

from parallel3d.training.checkpoint_integrity import (
    CHECKSUMS_SINCE,
    FILES_KEY,
    CheckpointError,
    CheckpointWarning,
    confined_path,
    relpath_problem,
    write_error,
)

LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
METADATA_CHECKSUM_FILE = METADATA_FILE + ".sha256"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_PARALLEL_SIZE = 1 << 16  # any of TP, PP, virtual PP, DP; and TP x PP (files per checkpoint)
MAX_WORLD_SIZE = 1 << 20
_MAX_METADATA_BYTES = 256 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SAVED = re.compile(r"^iter_(\d+)(\.old)?$")


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_metadata(ckpt_dir: str, meta: dict[str, Any]) -> None:
    """metadata.json, then its checksum file, both fsynced (the caller renames the directory into place); a
    CheckpointError naming the file that cannot be written."""
    data = json.dumps(meta, indent=2, sort_keys=True).encode()
    checksum = f"{hashlib.sha256(data).hexdigest()}  {METADATA_FILE}\n".encode()
    for name, content in ((METADATA_FILE, data), (METADATA_CHECKSUM_FILE, checksum)):
        path = os.path.join(ckpt_dir, name)
        try:
            _fsync_write(path, content)
        except OSError as e:
            raise write_error(path, e) from e


def _is_int(x: Any, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _schema_problem(meta: Any) -> Optional[str]:
    """The first field of a metadata dict that is missing, of the wrong type or out of bounds, or None."""
    if not isinstance(meta, dict):
        return f"expected a JSON object, found {type(meta).__name__}"
    if not _is_int(meta.get("iteration"), 0, 1 << 62):
        return f"field 'iteration' must be an integer >= 0, found {meta.get('iteration')!r:.60}"
    layout = meta.get("layout")
    if not isinstance(layout, dict):
        return f"field 'layout' must be a JSON object, found {layout!r:.60}"
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "data_parallel_size"):
        value = layout.get(key)
        optional = key == "virtual_pipeline_model_parallel_size" or key == "data_parallel_size"
        if not (optional and value is None) and not _is_int(value, 1, MAX_PARALLEL_SIZE):
            return f"field 'layout.{key}' must be an integer in [1, {MAX_PARALLEL_SIZE}], found {value!r:.60}"
    if layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"] > MAX_PARALLEL_SIZE:
        return (f"fields 'layout.tensor_model_parallel_size' x 'layout.pipeline_model_parallel_size' exceed "
                f"{MAX_PARALLEL_SIZE} files")
    if "world_size" in meta and not _is_int(meta["world_size"], 1, MAX_WORLD_SIZE):
        return f"field 'world_size' must be an integer in [1, {MAX_WORLD_SIZE}], found {meta['world_size']!r:.60}"
    for key, types in (("model_config", dict), ("args", dict), ("extra", dict), ("layer_numbers", list)):
        if meta.get(key) is not None and not isinstance(meta[key], types):
            return f"field {key!r} must be a JSON {'object' if types is dict else 'array'} or null"
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        value = (meta.get("extra") or {}).get(key)
        if value is not None and not _is_int(value, 0, 1 << 62):
            return f"field 'extra.{key}' must be an integer >= 0, found {value!r:.60}"
    files = meta.get(FILES_KEY)
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"field {FILES_KEY!r} must be a JSON object, found {type(files).__name__}"
    for rel, record in files.items():
        problem = relpath_problem(rel)
        if problem:
            return f"'{FILES_KEY}' lists file {rel!r:.80}: {problem}; refusing to read it"
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), str) \
                or not _SHA256.match(record["sha256"]) or not _is_int(record.get("bytes"), 0, 1 << 62):
            return f"field '{FILES_KEY}.{rel}' must hold a 64-digit hex 'sha256' and a byte count 'bytes'"
        for key in ("tp_rank", "pp_rank", "dp_rank", "rank"):
            if key in record and not _is_int(record[key], 0, MAX_WORLD_SIZE):
                return f"field '{FILES_KEY}.{rel}.{key}' must be an integer >= 0, found {record[key]!r:.60}"
    return None


def read_metadata(ckpt_dir: str, iteration: Optional[int] = None) -> dict[str, Any]:
    """metadata.json of ``ckpt_dir``, checked: its checksum file, its schema, and (given ``iteration``, the
    number its directory name and the tracker say) the iteration it records."""
    path = os.path.join(ckpt_dir, METADATA_FILE)
    if not os.path.lexists(path):
        raise CheckpointError(f"{ckpt_dir} is not a complete checkpoint: {METADATA_FILE} is missing")
    confined_path(ckpt_dir, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if len(raw) > _MAX_METADATA_BYTES:
        raise CheckpointError(f"{path} is corrupt: larger than {_MAX_METADATA_BYTES} bytes")
    sidecar = confined_path(ckpt_dir, METADATA_CHECKSUM_FILE)
    recorded = None
    if os.path.lexists(sidecar):
        with open(sidecar, "rb") as f:
            recorded = f.read(200).split(b" ")[0].decode("ascii", errors="replace").strip()
        if recorded != hashlib.sha256(raw).hexdigest():
            raise CheckpointError(f"{path} fails its checksum ({METADATA_CHECKSUM_FILE}): it was edited or damaged "
                                  "since it was saved")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(f"{path}: format version {version!r:.40} is not one this version of parallel3d "
                              f"reads ({', '.join(map(str, READABLE_VERSIONS))})")
    problem = _schema_problem(meta)
    if problem:
        raise CheckpointError(f"{path} is corrupt: {problem}")
    if version >= CHECKSUMS_SINCE and (meta.get(FILES_KEY) is None or recorded is None):
        what = f"its '{FILES_KEY}' list" if meta.get(FILES_KEY) is None else METADATA_CHECKSUM_FILE
        raise CheckpointError(f"{path}: format version {version} always records checksums, but {what} is missing "
                              "(removed after the save?): refusing to load it unverified")
    if iteration is not None and meta["iteration"] != iteration:
        raise CheckpointError(f"{path} records iteration {meta['iteration']}, but its directory name and the "
                              f"tracker say iteration {iteration} (a renamed directory or an edited tracker?): "
                              "refusing to load it")
    return meta


def read_latest_iteration(load_dir: str) -> Optional[int]:
    """The last complete iteration under ``load_dir``, or None when there is no checkpoint."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load directory {load_dir!r} does not exist")
    if not os.path.lexists(path):
        _refuse_untracked_checkpoints(load_dir)
        return None
    confined_path(load_dir, LATEST_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit() or not text.isascii():
        raise CheckpointError(f"{path} is corrupt: expected an iteration number, found {raw[:40]!r}")
    return int(text)


def _refuse_untracked_checkpoints(save_dir: str) -> None:
    """A directory holding iteration directories but no tracker (deleted, or a first save killed before writing
    it) is refused: starting from scratch there would overwrite them."""
    saved = sorted({int(m.group(1)) for m in map(_SAVED.match, os.listdir(save_dir)) if m})
    if not saved:
        return
    complete = [n for n in saved if any(os.path.isfile(os.path.join(iteration_dir(save_dir, n) + old, METADATA_FILE))
                                        for old in ("", ".old"))]
    tracker = os.path.join(save_dir, LATEST_FILE)
    if complete:
        fix = (f"the newest complete one is iteration {complete[-1]}: to resume from it, run "
               f"echo {complete[-1]} > {tracker}")
    else:
        fix = "none of them is complete (no metadata.json): move them away to start from scratch"
    raise CheckpointError(f"{save_dir} holds checkpoints (iterations {saved[0]}..{saved[-1]}) but no {LATEST_FILE}; "
                          f"refusing to start from scratch over them. {fix}")


def find_checkpoint_dir(load_dir: str, iteration: int) -> str:
    """``iter_N`` of ``load_dir``; or ``iter_N.old``, with a warning, where a re-save of N was killed between
    swapping the old copy out and the new one in."""
    ckpt_dir = iteration_dir(load_dir, iteration)
    old = ckpt_dir + ".old"
    for path in (ckpt_dir, old):
        if os.path.islink(path):
            confined_path(load_dir, os.path.basename(path))
    if not os.path.isdir(ckpt_dir) and os.path.isfile(os.path.join(old, METADATA_FILE)):
        warnings.warn(f"{ckpt_dir} is missing (a re-save was interrupted): loading its previous copy {old}",
                      CheckpointWarning, stacklevel=2)
        return old
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} is missing although {os.path.join(load_dir, LATEST_FILE)} names "
                              f"iteration {iteration}")
    return ckpt_dir


def open_checkpoint(load_dir: str, iteration: Optional[int] = None) -> tuple[int, str, dict[str, Any]]:
    """(iteration, its directory, its checked metadata) of the latest (or given) checkpoint under ``load_dir``;
    a CheckpointError when there is none, naming what is missing."""
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            raise CheckpointError(f"{load_dir} holds no checkpoint ({LATEST_FILE} is missing)")
    ckpt_dir = find_checkpoint_dir(load_dir, iteration)
    return iteration, ckpt_dir, read_metadata(ckpt_dir, iteration)
