"""Persistent buffers in NCCL symmetric windows, for the sequence-parallel all-gathers (issue 26).

NCCL >= 2.28 runs an all-gather on the GPU's copy engines, using no SMs, when its buffers lie in a
symmetric window (memory that every rank of the communicator registered) and the communicator has the
zero-CTA policy (``NCCL_CTA_POLICY=2``). A copy-engine copy runs beside a cuBLAS GEMM, where an NCCL
kernel waits for the GEMM's SMs (BENCHMARKS.md, issue 26), so the backward's re-gather of a
column-parallel input can overlap the input-gradient GEMM.

Registering memory is a collective and is slow, so each buffer is allocated and registered once (in an
eager step; never inside a CUDA graph's capture) and then reused by every later gather of its shape
and dtype. Stream order keeps the reuse safe: a gather waits for every kernel queued before it, among
them the GEMMs that read the last gather's result. A caller that keeps a gathered tensor alive past its
layer's backward (a deferred weight gradient) must not take one.

EXPERIMENT (branch tp-ce-allgather): switched on by ``PARALLEL3D_TP_SYMMETRIC=1`` in the environment
until measured against the plain gathers (bench/layouts_bench.py rows ``*-symm``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

ENV = "PARALLEL3D_TP_SYMMETRIC"


def requested() -> bool:
    """Whether this run asked for the TP all-gathers in symmetric windows (the experiment's switch)."""
    return os.environ.get(ENV, "0") == "1"


def unavailable_reason(group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """Why symmetric windows cannot serve ``group`` here, or None when they can."""
    if group is None or dist.get_world_size(group) == 1:
        return "no tensor-parallel group"
    if dist.get_backend(group) != "nccl":
        return f"the {dist.get_backend(group)} backend (symmetric windows are NCCL's)"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory"
    if not hasattr(symm_mem, "set_backend"):
        return f"torch {torch.__version__}'s symmetric memory has no NCCL backend"
    if torch.cuda.nccl.version() < (2, 28, 0):
        return f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} (copy-engine all-gathers need 2.28)"
    return None


class SymmetricBuffers:
    """One all-gather output per (shape, dtype) for ``group``, in an NCCL symmetric window."""

    def __init__(self, group: dist.ProcessGroup):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self._symm_mem = symm_mem
        self._buffers: dict[tuple, torch.Tensor] = {}
        try:
            symm_mem.set_backend("NCCL")
        except Exception:  # fixed once the process has allocated symmetric memory: fine where it is NCCL already
            if symm_mem.get_backend(torch.device("cuda", torch.cuda.current_device())) != "NCCL":
                raise

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The persistent buffer of this shape; the first call for a shape is collective over the group."""
        key = (tuple(shape), dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"a symmetric all-gather buffer of shape {tuple(shape)} first asked for inside a "
                                   "CUDA graph's capture: registering it is a collective; run an eager step first")
            symm_mem = self._symm_mem
            if hasattr(symm_mem, "get_mem_pool"):
                with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
                    buffer = torch.empty(shape, dtype=dtype, device=device)
            else:
                buffer = symm_mem.empty(shape, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group=self.group.group_name)
            self._buffers[key] = buffer
        return buffer

    def release(self) -> None:
        """Forget every buffer (before the group is destroyed)."""
        self._buffers.clear()
