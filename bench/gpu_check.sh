#!/usr/bin/env bash
# One GPU-machine call: build the extension (JIT), run the fused-op tests and/or
# the kernel benchmark, logs under $OUT.  Usage: bench/gpu_check.sh [all|tests|bench|quick]
#   all   = build + tests + full bench;  quick = build + tests + bench --quick
# Liger-Kernel travels as a wheel in .whl-fused/ (git-ignored) and is installed
# into /tmp/site here, since the GPU machine has no registry.
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-/tmp/p3d_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PARALLEL3D_JIT=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl-fused/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-fused/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2
  ls /usr/local/cuda/include/cublas_v2.h 2>&1
} 2>&1 | tee "$OUT/env.txt"

start=$(date +%s)
python3 - <<'PY' 2>&1 | tee "$OUT/build.log"
import time, torch
from parallel3d.fused import _ext
t = time.time()
ext = _ext.get_ext()
print(f"extension: {ext}, error: {_ext.load_error()}, {time.time() - t:.0f} s")
PY
echo "build step: $(( $(date +%s) - start )) s"

if [ "$MODE" = all ] || [ "$MODE" = tests ] || [ "$MODE" = quick ]; then
  start=$(date +%s)
  timeout 180 python3 -m pytest -q -rs --durations=8 \
    tests/test_fused_norms.py tests/test_fused_rope.py tests/test_fused_elementwise.py 2>&1 | tee "$OUT/pytest.log" | tail -40
  echo "tests step: $(( $(date +%s) - start )) s"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 320 python3 bench/kernels_bench.py --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | grep -v "^  "
elif [ "$MODE" = quick ]; then
  timeout 240 python3 bench/kernels_bench.py --quick --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | grep -v "^  "
fi
