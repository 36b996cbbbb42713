"""Where parallel3d puts its tensors: one rule for the library, its tools and its tests.

1. ``PARALLEL3D_DEVICE=cpu`` (or ``cuda``), when set, decides. The CPU test suite sets ``cpu``
   so that its references are exact on any machine; ``tests/gpu`` runs on CUDA explicitly.
2. Otherwise a default process group on the gloo backend means the CPU: gloo ranks move CPU
   tensors, so a machine with GPUs can still run more CPU ranks than it has GPUs.
3. Otherwise CUDA's current device where CUDA is available, else the CPU.

``default_backend()`` is the matching choice for ``init_process_group``: nccl where rule 1 or 3
picks CUDA, gloo otherwise. A training script binds each rank to its GPU (``LOCAL_RANK``) before
any of this is asked.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_ENV = "PARALLEL3D_DEVICE"


def _forced() -> str | None:
    value = os.environ.get(_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("cpu", "cuda"):
        raise ValueError(f"{_ENV}={value!r}: use cpu, cuda or auto (unset)")
    if value == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{_ENV}=cuda, but CUDA is not available to this process (unset {_ENV} to use the CPU)")
    return value


def default_device() -> torch.device:
    """The device for new parameters, buffers and communication tensors of this process."""
    forced = _forced()
    if forced is None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        forced = "cpu"
    if forced == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def uses_cuda() -> bool:
    """True when :func:`default_device` is a GPU (the RNG tracker then drives CUDA's generator)."""
    return default_device().type == "cuda"


def default_backend() -> str:
    """nccl where this process will compute on a GPU, gloo where it computes on the CPU."""
    forced = _forced()
    if forced == "cpu" or not torch.cuda.is_available():
        return "gloo"
    return "nccl"
