"""A safetensors file written one tensor at a time, so a writer never holds a whole file.

safetensors is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
[begin, end) byte offsets in the data section; ``__metadata__`` -> str), then the raw data.
With every name, dtype and shape known up front the header is written first and each
tensor goes to its offset when it arrives, in any order. The result is the file
``safetensors.torch.save_file`` would write for the same tensors (it loads with
``safe_open``/``load_file``, transformers included).

The file's SHA-256 is computed as it is written: tensors written in declared order (as
``save_checkpoint`` writes them) are hashed from the bytes in hand; only a part written
out of order (a converter's tied output layer, say) is read back at ``close``.
Used by ``save_checkpoint`` and by the converters in tools/checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Optional

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_READ_CHUNK = 1 << 24


class StreamingSafetensorsWriter:
    """``entries``: name -> (dtype, shape), in file order. ``write`` each once, then ``close``."""

    def __init__(self, path: str, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: Optional[dict[str, str]] = None):
        self.path = path
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        offset = 0
        for name, (dtype, shape) in entries.items():
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors here")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._layout[name] = (dtype, tuple(shape), offset, nbytes)
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned (as safetensors writes it)
        self._data_start = 8 + len(text)
        self._size = offset
        self._written: set[str] = set()
        self._file = open(path, "wb")
        preamble = struct.pack("<Q", len(text)) + text
        self._sha256 = hashlib.sha256(preamble)
        self._hashed = 0  # bytes of the data section hashed so far (a prefix)
        self.sha256: Optional[str] = None  # hex digest of the whole file, once closed
        self._file.write(preamble)
        self._file.truncate(self._data_start + self._size)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._layout:
            raise KeyError(f"{self.path}: {name} was not declared")
        if name in self._written:
            raise KeyError(f"{self.path}: {name} written twice")
        dtype, shape, offset, nbytes = self._layout[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: {name} is {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {shape}")
        self._file.seek(self._data_start + offset)
        if nbytes:
            data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            self._file.write(data)
            if offset == self._hashed:
                self._sha256.update(data)
                self._hashed += nbytes
        self._written.add(name)

    def close(self) -> str:
        """Check every declared tensor was written, flush and fsync the file; returns its SHA-256."""
        missing = [n for n in self._layout if n not in self._written]
        if missing:
            self._file.close()
            raise ValueError(f"{self.path}: tensors never written: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._hashed < self._size:  # tensors arrived out of order: hash the rest from the file
            with open(self.path, "rb") as f:
                f.seek(self._data_start + self._hashed)
                for block in iter(lambda: f.read(_READ_CHUNK), b""):
                    self._sha256.update(block)
        self.sha256 = self._sha256.hexdigest()
        return self.sha256

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
