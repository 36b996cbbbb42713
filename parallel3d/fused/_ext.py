"""Loader for the CUDA extension and the global fusion switch.

The extension is looked up lazily, the first time a wrapper sees CUDA tensors (a training
script asks once at start, see :func:`describe`), so importing parallel3d on a CPU machine
never touches a compiler or a GPU:

1. ``import parallel3d._C`` (built by ``pip install -e . --no-build-isolation``
   on a machine with CUDA);
2. else, where torch has CUDA and nvcc is found, build csrc/ with
   ``torch.utils.cpp_extension.load`` into ``~/.cache/parallel3d/jit-<key>`` (key: sources,
   torch and CUDA versions, target archs), so later processes reuse the build. The first
   process of a node to get there builds under an exclusive file lock while the others wait
   for it, then load the finished build. ``PARALLEL3D_JIT=0`` turns this step off;
3. else None, and every wrapper runs its PyTorch implementation (:func:`describe` says why).

``set_fusion_enabled(False)`` or ``PARALLEL3D_DISABLE_FUSION=1`` turns the
kernels off without unloading anything.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import sys
import threading
from types import ModuleType
from typing import Callable

import torch

# The kernels' sources: the copy a wheel ships in the package (pyproject's package data), else a checkout's csrc/.
_CSRC_DIRS = [os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), up, "csrc"))
              for up in ("..", "../..")]
_CSRC = next((d for d in _CSRC_DIRS if os.path.isfile(os.path.join(d, "bindings.cpp"))), _CSRC_DIRS[1])

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
    # The user's TORCH_CUDA_ARCH_LIST, which torch's build reads; else this GPU's architecture, passed
    # as nvcc's -gencode (torch then adds no arch flags of its own), not written into os.environ.
    arch, arch_flags = os.environ.get("TORCH_CUDA_ARCH_LIST"), []
    if not arch:
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}.{minor}"
        arch_flags = [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    h = hashlib.sha1()
    for path in sources + headers:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch}".encode())
    build_dir = os.path.join(os.path.expanduser("~"), ".cache", "parallel3d", f"jit-{h.hexdigest()[:16]}")

    def build() -> ModuleType:
        if not os.path.exists(os.path.join(build_dir, "parallel3d_C.so")):
            print(f"parallel3d: building CUDA kernels into {build_dir} (first use only)", file=sys.stderr)
        return load(
            name="parallel3d_C",
            sources=sources,
            build_directory=build_dir,
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"] + arch_flags,
            extra_include_paths=[_CSRC] + _cuda_include_dirs(),
            verbose=os.environ.get("PARALLEL3D_JIT_VERBOSE") == "1",
        )

    return one_at_a_time(build_dir, build)


def one_at_a_time(build_dir: str, build: Callable[[], ModuleType]) -> ModuleType:
    """Run ``build`` under an exclusive lock on a file in ``build_dir``: the first process of the node
    builds, the others wait and then only load the finished build (ninja finds it up to date).

    flock, not a lock file: the kernel releases it when its holder dies, so a rank killed mid-build
    cannot leave the others waiting on a stale lock.
    """
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "parallel3d_build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return build()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
            if os.environ.get("PARALLEL3D_JIT") == "0":
                _ext_error += "; PARALLEL3D_JIT=0 turned the JIT build off"
            else:
                try:
                    _ext = _jit_build()
                    _ext_error = None
                except Exception as jit_error:  # a failed build must leave the fallbacks usable
                    _ext_error = f"{_ext_error}; JIT build failed: {jit_error}"
                    print(f"parallel3d: {_ext_error}", file=sys.stderr)
        _ext_tried = True
    return _ext


def use_kernel(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """True when the fused kernel should run: fusion on, x (the op's input) in fp32, fp16 or bf16, all given
    tensors on CUDA, extension loaded, and not inside a region torch.compile traces (there Inductor fuses the
    PyTorch fallback with its neighbours; the kernel would break the graph)."""
    if not _fusion_enabled or torch.compiler.is_compiling():
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not all(
            t.is_cuda for t in (x, *tensors) if t is not None):
        return False
    return get_ext() is not None


def check_bias(op: str, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The bias wrappers' rule: None, or one value per feature of x's last dimension, in x's dtype."""
    if bias is None:
        return
    if bias.shape != (x.shape[-1],):
        raise ValueError(f"{op}: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise ValueError(f"{op}: bias dtype {bias.dtype} differs from x dtype {x.dtype}")


def describe() -> str:
    """One line for a run's log: whether this process runs the fused kernels, and if not, why.

    On a GPU process this loads (or builds, on first use) the extension, so the build happens at
    start-up rather than inside the first step.
    """
    from parallel3d.device import uses_cuda

    if not uses_cuda():
        return "fused kernels: off (this process computes on the CPU: PyTorch implementations)"
    if not _fusion_enabled:
        return "fused kernels: off (PARALLEL3D_DISABLE_FUSION=1 or set_fusion_enabled(False))"
    ext = get_ext()
    if ext is None:
        return f"fused kernels: off, PyTorch fallbacks run instead ({_ext_error})"
    origin = "installed parallel3d._C" if getattr(ext, "__name__", "") == "parallel3d._C" else "JIT build"
    return f"fused kernels: on ({origin}, {getattr(ext, '__file__', '?')})"
