#!/usr/bin/env bash
# CI compile check of csrc/ (no GPU needed): compile every .cu / .cpp with
# `nvcc -c` against torch's headers for sm_80 and sm_90, to catch syntax and
# template errors before anyone spends GPU time.  Skips, saying why, when nvcc
# or torch is missing.  Exit status: 0 when everything that could be compiled
# compiled, 1 on any compile error.
#
# csrc/grad_accum.cu includes ATen/cuda/CUDAContext.h, which needs the cuBLAS,
# cuSPARSE and cuSOLVER headers.  They are searched for in the CUDA toolkit,
# in pip's nvidia/*/include folders and in $PARALLEL3D_CUDA_EXTRA_INCLUDE
# (colon-separated); without them that one file is skipped with a note.
# Jobs run in parallel, one per core ($COMPILE_JOBS overrides).
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile_cuda: skipped: nvcc is not on PATH"
  exit 0
fi
if ! python3 -c "import torch" >/dev/null 2>&1; then
  echo "compile_cuda: skipped: python3 cannot import torch (its headers are needed)"
  exit 0
fi

# Include flags, C++ standard and defines, as torch's own extension build uses them.
read -r -d '' PYCFG <<'EOF'
import glob, inspect, os, sys, sysconfig
import torch.utils.cpp_extension as ce
incs = list(ce.include_paths()) + [sysconfig.get_paths()["include"]]
cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(os.popen("command -v nvcc").read().strip())))
extra = [p for p in os.environ.get("PARALLEL3D_CUDA_EXTRA_INCLUDE", "").split(":") if p]
cands = [os.path.join(cuda_home, "include")] + extra
for path in sys.path:
    cands += sorted(glob.glob(os.path.join(path, "nvidia", "*", "include")))
need = ["cublas_v2.h", "cusparse.h", "cusolverDn.h"]
found = {h: next((d for d in cands if os.path.exists(os.path.join(d, h))), None) for h in need}
incs += sorted({d for d in found.values() if d})
std = "c++20" if "'-std=c++20'" in inspect.getsource(ce) else "c++17"
defs = list(ce.COMMON_NVCC_FLAGS)
if not os.path.exists(os.path.join(ce.include_paths()[0], "c10", "cuda", "impl", "cuda_cmake_macros.h")):
    defs.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")  # a CPU-only torch lacks this generated header
print(" ".join("-I" + i for i in incs))
print("-std=" + std + " " + " ".join(defs))
print(" ".join(h for h, d in found.items() if d is None))
EOF
mapfile -t CFG < <(python3 -c "$PYCFG")
INCLUDES=${CFG[0]}
FLAGS=${CFG[1]}
MISSING=${CFG[2]:-}

OUTDIR=$(mktemp -d)
trap 'rm -rf "$OUTDIR"' EXIT
export INCLUDES FLAGS OUTDIR

compile_one() {
  local src=$1 start end log
  start=$(date +%s)
  log="$OUTDIR/$(basename "$src").log"
  # shellcheck disable=SC2086
  if nvcc -c "$src" -o "$OUTDIR/$(basename "$src").o" $INCLUDES $FLAGS -O3 --use_fast_math \
      -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -Xcompiler -fPIC -diag-suppress 3306,20015 >"$log" 2>&1; then
    end=$(date +%s)
    echo "compile_cuda: ok    $src ($((end - start)) s)"
  else
    end=$(date +%s)
    echo "compile_cuda: ERROR $src ($((end - start)) s)"
    grep -E "error|Error" "$log" | head -20
    return 1
  fi
}
export -f compile_one

SOURCES=()
for src in csrc/*.cu csrc/*.cpp; do
  [ -e "$src" ] || continue
  if [ -n "$MISSING" ] && grep -q "ATen/cuda/CUDAContext.h" "$src"; then
    echo "compile_cuda: skip  $src (headers not found: $MISSING; set PARALLEL3D_CUDA_EXTRA_INCLUDE)"
    continue
  fi
  SOURCES+=("$src")
done

JOBS=${COMPILE_JOBS:-$(nproc)}
start=$(date +%s)
printf '%s\n' "${SOURCES[@]}" | xargs -P "$JOBS" -I{} bash -c 'compile_one "$@"' _ {}
status=$?
echo "compile_cuda: ${#SOURCES[@]} files in $(($(date +%s) - start)) s with $JOBS jobs"
[ $status -eq 0 ] || { echo "compile_cuda: FAILED"; exit 1; }
exit 0
