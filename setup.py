"""The CUDA extension build of parallel3d; everything else is in pyproject.toml.

On a machine without CUDA (or without torch at build time, as under pip's build
isolation) this installs pure Python and says so once; the fused ops then run
their PyTorch fallbacks.  On a CUDA machine, build the kernels in csrc/ with
``pip install -e . --no-build-isolation`` (TORCH_CUDA_ARCH_LIST is respected).
"""
import glob
import os
import sys

from setuptools import setup


def _cuda_extension():
    """Return (ext_modules, cmdclass, why not) for csrc/; empty lists where CUDA can't be built."""
    if os.environ.get("PARALLEL3D_NO_CUDA_EXT") == "1":
        return [], {}, "PARALLEL3D_NO_CUDA_EXT=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}, "torch is not importable at build time (use --no-build-isolation to build kernels)"
    if torch.version.cuda is None:
        return [], {}, "this torch is a CPU build"
    if CUDA_HOME is None:
        return [], {}, "nvcc/CUDA_HOME not found"
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu"))
    if not sources:
        return [], {}, "csrc/ holds no sources"
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    ext = CUDAExtension(
        name="parallel3d._C",
        sources=sources,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension}, None


ext_modules, cmdclass, why_not = _cuda_extension()
if why_not and not any(a in sys.argv for a in ("egg_info", "dist_info", "--version")):
    print(f"parallel3d: installing pure Python, CUDA kernels not built ({why_not})", file=sys.stderr)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
