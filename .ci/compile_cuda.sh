#!/usr/bin/env bash
# CI compile check of csrc/ (no GPU needed): compile every .cu / .cpp with
# `nvcc -c` against torch's headers for sm_80 and sm_90, to catch syntax and
# template errors before anyone spends GPU time.  Without nvcc it skips, saying
# so.  Where nvcc exists, torch must be importable by $PYTHON (default python3;
# .ci/run passes its venv's): otherwise that is an error, not a silent skip.
# Exit status: 0 when every file compiled (or was skipped as listed in the last
# line), 1 on any compile error or when the check could not run at all.
#
# csrc/grad_accum.cu includes ATen/cuda/CUDAContext.h, which needs the cuBLAS,
# cuSPARSE and cuSOLVER headers.  They are searched for in the CUDA toolkit,
# in pip's nvidia/*/include folders and in $PARALLEL3D_CUDA_EXTRA_INCLUDE
# (colon-separated); without them such a file is SKIPPED: named on its own line
# and in the summary line; COMPILE_CUDA_STRICT=1 makes a skip an error.
# Jobs run in parallel, one per core ($COMPILE_JOBS overrides).
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile_cuda: skipped: nvcc is not on PATH"
  exit 0
fi
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "compile_cuda: ERROR: nvcc is on PATH but $PY cannot import torch (its headers are needed); set PYTHON"
  exit 1
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
mapfile -t CFG < <("$PY" -c "$PYCFG")
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
SKIPPED=()
for src in csrc/*.cu csrc/*.cpp; do
  [ -e "$src" ] || continue
  if [ -n "$MISSING" ] && grep -q "ATen/cuda/CUDAContext.h" "$src"; then
    echo "compile_cuda: SKIPPED $src (headers not found: $MISSING; set PARALLEL3D_CUDA_EXTRA_INCLUDE)"
    SKIPPED+=("$src")
    continue
  fi
  SOURCES+=("$src")
done

JOBS=${COMPILE_JOBS:-$(nproc)}
start=$(date +%s)
status=0
if [ ${#SOURCES[@]} -gt 0 ]; then
  printf '%s\n' "${SOURCES[@]}" | xargs -P "$JOBS" -I{} bash -c 'compile_one "$@"' _ {}
  status=$?
fi
skipped=""
[ ${#SKIPPED[@]} -eq 0 ] || skipped=", ${#SKIPPED[@]} SKIPPED (${SKIPPED[*]})"
echo "compile_cuda: ${#SOURCES[@]} files compiled in $(($(date +%s) - start)) s with $JOBS jobs$skipped"
[ $status -eq 0 ] || { echo "compile_cuda: FAILED"; exit 1; }
if [ ${#SKIPPED[@]} -gt 0 ] && [ "${COMPILE_CUDA_STRICT:-0}" = 1 ]; then
  echo "compile_cuda: FAILED: files skipped under COMPILE_CUDA_STRICT=1"
  exit 1
fi
exit 0
