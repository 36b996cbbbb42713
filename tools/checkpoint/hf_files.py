"""A local Hugging Face model directory's weight files, read lazily and never outside that directory.

``model.safetensors``, ``pytorch_model.bin`` or either sharded with its ``*.index.json``.
An index is input like any other: a shard it names must lie inside the load directory
(no absolute path, no ``..``, no symlink resolving elsewhere; a hub cache snapshot's links
into its own ``blobs/`` are allowed). ``.bin`` files load with ``weights_only=True``.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Optional

import torch
from safetensors import safe_open

from parallel3d.training.checkpoint_integrity import CheckpointError, load_torch_file

from .schema import ConversionError

SAFETENSORS_FILE = "model.safetensors"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _allowed_roots(load_dir: str) -> list[str]:
    real = os.path.realpath(load_dir)
    roots = [real]
    # A Hugging Face hub cache snapshot (models--org--name/snapshots/<rev>/) links its files to ../../blobs/.
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def confined_path(load_dir: str, name: str, listed_in: Optional[str] = None) -> str:
    """``load_dir``/``name``, refused (ConversionError) if it leaves ``load_dir``: an absolute path, a ``..``
    component, or a symlink resolving outside it (an index.json is input, not trusted to point anywhere)."""
    where = f"{listed_in} lists weight file {name!r}" if listed_in else f"{name!r}"
    if not name or "\x00" in name:
        raise ConversionError(f"{where}: not a file name")
    if os.path.isabs(name) or name.startswith("~"):
        raise ConversionError(f"{where}: an absolute path; only files inside {load_dir} are read")
    if ".." in name.replace("\\", "/").split("/"):
        raise ConversionError(f"{where}: a path leaving {load_dir} ('..'); only files inside it are read")
    path = os.path.join(load_dir, name)
    real = os.path.realpath(path)
    if not any(real == root or real.startswith(root + os.sep) for root in _allowed_roots(load_dir)):
        raise ConversionError(f"{path} resolves to {real}, outside {load_dir} (a symlink leaving the model "
                              "directory); refusing to read it")
    return path


def read_json_object(path: str) -> dict[str, Any]:
    """A JSON object from ``path`` (config.json, an index): one ConversionError line naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(64 << 20).decode("utf-8"))
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConversionError(f"{path} is not valid UTF-8 JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} must hold a JSON object, found a {type(data).__name__}")
    return data


class TensorFiles:
    """name -> tensor over a model's weight files, each tensor read only when asked for."""

    def __init__(self, load_dir: str):
        self._stack = contextlib.ExitStack()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._get: dict[str, Any] = {}
        index, files = self._find(load_dir)
        try:
            for name in files:
                path = confined_path(load_dir, name, index)
                if not os.path.isfile(path):
                    raise ConversionError(f"{load_dir}: weight shard {name} listed in {index} is missing")
                self._open(path)
            if index is not None:
                weight_map = read_json_object(confined_path(load_dir, index)).get("weight_map", {})
                absent = sorted(k for k in weight_map if k not in self.shapes)
                if absent:
                    raise ConversionError(f"{load_dir}: {index} lists tensors its shards do not hold: {absent[:5]}")
        except BaseException:
            self._stack.close()
            raise

    @staticmethod
    def _find(load_dir: str) -> tuple[Optional[str], list[str]]:
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            path = confined_path(load_dir, index)
            if os.path.isfile(path):
                weight_map = read_json_object(path).get("weight_map")
                if not weight_map or not isinstance(weight_map, dict):
                    raise ConversionError(f"{path} has no weight_map")
                bad = sorted({repr(v) for v in weight_map.values() if not isinstance(v, str)})
                if bad:
                    raise ConversionError(f"{path}: weight_map values must be file names, found {bad[:3]}")
                return index, sorted(set(weight_map.values()))
        for single in (SAFETENSORS_FILE, "pytorch_model.bin"):
            if os.path.isfile(os.path.join(load_dir, single)):
                return None, [single]
        raise ConversionError(f"{load_dir} holds no weights: expected {SAFETENSORS_FILE}, pytorch_model.bin or "
                              "either's .index.json with its shards")

    def _open(self, path: str) -> None:
        if path.endswith(".safetensors"):
            try:
                f = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as e:  # noqa: BLE001
                raise ConversionError(f"cannot read {path}: {e}") from e
            for k in f.keys():
                sl = f.get_slice(k)
                self._add(k, tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype()), f.get_tensor, path)
            return
        try:  # weights_only: a .bin is a pickle, and a pickle from elsewhere must not run code
            state = load_torch_file(path, mmap=True)  # memory-mapped: pages are read when a tensor is used
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ConversionError(f"{path} is not a state dict of tensors")
        for k, t in state.items():
            self._add(k, tuple(t.shape), t.dtype, state.__getitem__, path)

    def _add(self, name: str, shape: tuple[int, ...], dtype: Optional[torch.dtype], get: Any, path: str) -> None:
        if name in self.shapes:
            raise ConversionError(f"tensor {name} appears in more than one weight file (again in {path})")
        self.shapes[name], self.dtypes[name], self._get[name] = shape, dtype, get

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._get[name](name)

    def close(self) -> None:
        self._stack.close()
