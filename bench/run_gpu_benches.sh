#!/usr/bin/env bash
# On the GPU machine, from the repo root: Megatron-Core and parallel3d side by side, same card, same call.
#   bash bench/run_gpu_benches.sh fused-tests ddp pipeline kernels
# PARALLEL3D_JIT=1 (set here) builds csrc/ once into ~/.cache; the GPT runs then use the kernels.
# Needs .whl/ with the megatron-core wheel and the anchor scripts (see ../shared/anchors/README.md).
set -u
export OUT=${OUT:-/tmp/bench_out} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PARALLEL3D_JIT=${PARALLEL3D_JIT:-1}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/mcore .whl/megatron_core-*.whl
  export PYTHONPATH=/tmp/mcore${PYTHONPATH:+:$PYTHONPATH}
fi
for what in "$@"; do
  case "$what" in
    fused-tests) OUT=$OUT/fused bash bench/gpu_check.sh tests > "$OUT/fused_tests.log" 2>&1; tail -n 25 "$OUT/fused_tests.log" ;;
    ddp) python3 bench/ddp_bench.py ;;
    pipeline) python3 bench/pipeline_bench.py ;;
    kernels) python3 bench/kernels_bench.py ;;
    *) echo "unknown benchmark $what (fused-tests, ddp, pipeline, kernels)"; exit 2 ;;
  esac
done
# At most a few files come back from the device machine: pack the logs into one.
[ -d "$OUT/logs" ] && tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$OUT/logs"
exit 0
