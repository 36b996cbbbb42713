"""Persistent buffers in NCCL symmetric windows, for the sequence-parallel collectives (issue 26).

NCCL >= 2.28 runs an all-gather on the GPU's copy engines, using no SMs, when its buffers lie in a
symmetric window (memory that every rank of the communicator registered) and the communicator has the
zero-CTA policy (``NCCL_CTA_POLICY=2``). A copy-engine copy runs beside a cuBLAS GEMM, where an NCCL
kernel waits for the GEMM's SMs (BENCHMARKS.md, issue 26), so the backward's re-gather of a
column-parallel input can overlap the input-gradient GEMM. The reduce-scatters use them too, as gathers:
the linear computes the rows the other ranks own first, into a window, and exchanges them while its own
rows run (``tensor_parallel/linear_functions.py``), so every TP collective of a layer is a copy.

Registering memory is a collective and is slow, so each buffer is allocated and registered once (in an
eager step; never inside a CUDA graph's capture) and then reused by every later gather of its shape
and dtype. Stream order keeps the reuse safe: a gather waits for every kernel queued before it, among
them the GEMMs that read the last gather's result. A caller that keeps a gathered tensor alive past its
layer's backward (a deferred weight gradient) must not take one.

The training application uses them under SP with CUDA graphs, where NCCL has them (``gathers_run``;
``--no-tp-symmetric-gathers`` turns them off), and sets ``NCCL_CTA_POLICY=2`` where the user has not
(``nccl_environment_defaults``); with another policy the windows still take NCCL's symmetric kernels.
``initialize_model_parallel(tp_symmetric_gathers=None)`` asks for them from the API (BENCHMARKS.md, issue 26).
"""
from __future__ import annotations

import gc
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

# NCCL reads its policy when a communicator is built: set before init_process_group
NCCL_ENV_DEFAULTS = {"NCCL_CTA_POLICY": "2"}


def gathers_off_reason(asked: bool, sequence_parallel: bool, cuda_graphs: bool) -> Optional[str]:
    """None where a run's SP all-gathers go into symmetric windows: asked for (not --no-tp-symmetric-gathers),
    under sequence parallelism, with the layers replayed as CUDA graphs. With eager layers, where the host
    launches each gather, they measured slower (BENCHMARKS.md, issue 26). Else why not, for the training log."""
    why = [text for off, text in ((not asked, "--no-tp-symmetric-gathers"),
                                  (not sequence_parallel, "no --sequence-parallel"),
                                  (not cuda_graphs, "eager layers: no CUDA graphs, see the log's graph line"))
           if off]
    return "; ".join(why) or None


def gathers_run(asked: bool, sequence_parallel: bool, cuda_graphs: bool) -> bool:
    """Whether a run's SP all-gathers go into symmetric windows (``gathers_off_reason``)."""
    return gathers_off_reason(asked, sequence_parallel, cuda_graphs) is None


def nccl_environment_defaults() -> dict[str, str]:
    """Set ``NCCL_ENV_DEFAULTS`` where the user has not (before init_process_group); return what was set.
    The zero-CTA policy moves only collectives on symmetric windows to the copy engines; others keep NCCL's
    kernels."""
    applied = {k: v for k, v in NCCL_ENV_DEFAULTS.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


def describe(buffers: Optional["SymmetricBuffers"], reason: Optional[str]) -> str:
    """The training log's line on which TP all-gather path runs."""
    if buffers is None:
        return f"TP all-gathers and reduce-scatters: NCCL's own buffers ({reason})"
    engines = "copy engines" if os.environ.get("NCCL_CTA_POLICY") == "2" else "NCCL symmetric kernels"
    return (f"TP all-gathers and reduce-scatters: NCCL symmetric windows, on the {engines}, each beside its "
            "GEMM split by rank (--no-tp-symmetric-gathers: off)")


def unavailable_reason(group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """Why symmetric windows cannot serve ``group`` here, or None when they can."""
    if group is None or dist.get_world_size(group) == 1:
        return "no tensor-parallel group"
    if "nccl" not in dist.get_backend(group):
        return f"the {dist.get_backend(group)} backend (symmetric windows are NCCL's)"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory"
    if not hasattr(symm_mem, "set_backend") or not hasattr(symm_mem._SymmetricMemory, "empty_strided_p2p"):
        return f"torch {torch.__version__}'s symmetric memory has no NCCL backend"
    if torch.cuda.nccl.version() < (2, 28, 0):
        return f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} (copy-engine all-gathers need 2.28)"
    return None


class SymmetricBuffers:
    """One collective buffer per (shape, dtype, tag) for ``group``, in an NCCL symmetric window."""

    def __init__(self, group: dist.ProcessGroup):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self._symm_mem = symm_mem
        self._buffers: dict[tuple, torch.Tensor] = {}
        device = torch.device("cuda", torch.cuda.current_device())
        try:
            symm_mem.set_backend("NCCL")
        except Exception:  # fixed once the process has allocated symmetric memory: fine where it is NCCL already
            if symm_mem.get_backend(device) != "NCCL":
                raise
        # torch's NCCL rendezvous registers a window on the group's communicator, which NCCL creates at the
        # group's first collective; before that it registers on a null one and the process segfaults. On a
        # later pipeline stage the first TP collective is a gather into a window (4 x H200, TP=2 x PP=2 with
        # graphs). One collective here, on every rank of the group (we are built in
        # initialize_model_parallel), creates the communicator first.
        dist.all_reduce(torch.zeros(1, device=device), group=group)

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tag: str = "") -> torch.Tensor:
        """The persistent buffer of this shape (and ``tag``: a second buffer of one shape, for a collective
        that reads one window and writes another); the first call for a key is collective over the group."""
        key = (tuple(shape), dtype, device, tag)
        buffer = self._buffers.get(key)
        if buffer is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"a symmetric all-gather buffer of shape {tuple(shape)} first asked for inside a "
                                   "CUDA graph's capture: registering it is a collective; run an eager step first")
            symm_mem = self._symm_mem
            # an allocation of its own, not from torch's symmetric pool: freed, it deregisters its window, which
            # release() needs while the communicator lives. A pool keeps freed blocks registered to the end of
            # the process, when NCCL's deregistration reads a destroyed communicator (a segfault at exit after a
            # group was destroyed, 2 x H200; NCCL frees windows with their communicator)
            stride = torch._prims_common.make_contiguous_strides_for(tuple(shape))
            buffer = symm_mem._SymmetricMemory.empty_strided_p2p(tuple(shape), stride, dtype, device)
            symm_mem.rendezvous(buffer, group=self.group.group_name)
            self._buffers[key] = buffer
        return buffer

    def release(self, wait_s: float = 5.0) -> None:
        """Free every buffer, deregistering its window: before the group is destroyed, after the GPU is done
        with them (the last gathers may still run). A window still viewed elsewhere (a finished gather's work
        object that NCCL's watchdog thread has not dropped yet, an autograd cycle) would be freed later,
        through the destroyed communicator (a worker's segfault at exit, 2 x H200): wait up to ``wait_s``
        for those views to go, and name any that stay."""
        if self._buffers:
            torch.cuda.synchronize()
            deadline = time.monotonic() + wait_s
            while viewed_elsewhere(self._buffers) and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.01)
            held = viewed_elsewhere(self._buffers)
            if held:
                rank = dist.get_rank() if dist.is_initialized() else 0
                print(f"warning: rank {rank}: symmetric all-gather windows {held} are still viewed after "
                      f"{wait_s:.0f} s; they will be freed after the TP group is destroyed", flush=True)
        self._buffers.clear()


def viewed_elsewhere(buffers: dict) -> list:
    """The keys of ``buffers`` whose storage another tensor (a view, a saved tensor) still holds."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # a torch without it: nothing to wait for that we could see
        return []
    # the count includes the buffer itself and the temporary storage object made to ask
    return [key[0] for key, t in buffers.items() if use_count(t.untyped_storage()._cdata) > 2]
