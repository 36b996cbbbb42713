"""Loader for the CUDA extension and the global fusion switch.

The extension is looked up lazily, the first time a wrapper sees CUDA tensors,
so importing parallel3d on a CPU machine never touches a compiler or a GPU:

1. ``import parallel3d._C`` (built by ``pip install -e . --no-build-isolation``
   on a machine with CUDA);
2. else, if ``PARALLEL3D_JIT=1`` and torch has CUDA and nvcc is found, build
   csrc/ with ``torch.utils.cpp_extension.load`` into
   ``~/.cache/parallel3d/jit-<key>`` (key: sources, torch and CUDA versions,
   target archs), so later processes reuse the build;
3. else None, and every wrapper runs its PyTorch implementation.

``set_fusion_enabled(False)`` or ``PARALLEL3D_DISABLE_FUSION=1`` turns the
kernels off without unloading anything.
"""
from __future__ import annotations

import glob
import hashlib
import os
import sys
import threading
from types import ModuleType

import torch

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")

_fusion_enabled: bool = os.environ.get("PARALLEL3D_DISABLE_FUSION", "0") != "1"
_ext: ModuleType | None = None
_ext_tried: bool = False
_ext_error: str | None = None
_lock = threading.Lock()


def set_fusion_enabled(enabled: bool) -> None:
    """Turn the fused CUDA kernels on or off for this process (PyTorch fallbacks run when off)."""
    global _fusion_enabled
    _fusion_enabled = bool(enabled)


def fusion_enabled() -> bool:
    return _fusion_enabled


def load_error() -> str | None:
    """Why the extension is unavailable (None if it loaded or was never looked up)."""
    return _ext_error


def _cuda_include_dirs() -> list[str]:
    """Header folders of pip-installed CUDA libraries (cuBLAS etc.) when the toolkit lacks them."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "include", "cublas_v2.h")):
        return []
    dirs = []
    for path in sys.path:
        for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
            for d in sorted(glob.glob(os.path.join(path, pattern))):
                if os.path.exists(os.path.join(d, "cublas_v2.h")) or os.path.exists(os.path.join(d, "cusparse.h")):
                    dirs.append(d)
    return sorted(set(dirs))


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import CUDA_HOME, load

    if torch.version.cuda is None:
        raise RuntimeError("this torch is a CPU build")
    if CUDA_HOME is None:
        raise RuntimeError("nvcc / CUDA_HOME not found")
    sources = sorted(glob.glob(os.path.join(_CSRC, "*.cu")) + glob.glob(os.path.join(_CSRC, "*.cpp")))
    headers = sorted(glob.glob(os.path.join(_CSRC, "*.h")) + glob.glob(os.path.join(_CSRC, "*.cuh")))
    if not sources:
        raise RuntimeError(f"no CUDA sources under {_CSRC}")
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch:
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}.{minor}"
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    h = hashlib.sha1()
    for path in sources + headers:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch}".encode())
    build_dir = os.path.join(os.path.expanduser("~"), ".cache", "parallel3d", f"jit-{h.hexdigest()[:16]}")
    os.makedirs(build_dir, exist_ok=True)
    print(f"parallel3d: building CUDA kernels into {build_dir} (first use only)", file=sys.stderr)
    return load(
        name="parallel3d_C",
        sources=sources,
        build_directory=build_dir,
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
        extra_include_paths=[_CSRC] + _cuda_include_dirs(),
        verbose=os.environ.get("PARALLEL3D_JIT_VERBOSE") == "1",
    )


def get_ext() -> ModuleType | None:
    """The compiled extension, or None where it is neither installed nor JIT-buildable."""
    global _ext, _ext_tried, _ext_error
    if _ext_tried:
        return _ext
    with _lock:
        if _ext_tried:
            return _ext
        try:
            from parallel3d import _C  # type: ignore[attr-defined]

            _ext = _C
        except ImportError as e:
            _ext_error = f"parallel3d._C is not installed ({e})"
            if os.environ.get("PARALLEL3D_JIT") == "1":
                try:
                    _ext = _jit_build()
                    _ext_error = None
                except Exception as jit_error:  # a failed build must leave the fallbacks usable
                    _ext_error = f"{_ext_error}; JIT build failed: {jit_error}"
                    print(f"parallel3d: {_ext_error}", file=sys.stderr)
        _ext_tried = True
    return _ext


def use_kernel(*tensors: torch.Tensor | None) -> bool:
    """True when the fused kernel should run: fusion on, all given tensors on CUDA, extension loaded."""
    if not _fusion_enabled:
        return False
    present = [t for t in tensors if t is not None]
    if not present or not all(t.is_cuda for t in present):
        return False
    return get_ext() is not None
