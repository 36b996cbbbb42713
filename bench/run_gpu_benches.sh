#!/usr/bin/env bash
# On the GPU machine, from the repo root: Megatron-Core and parallel3d side by side, same card, same call.
#   bash bench/run_gpu_benches.sh fused-tests single ddp pipeline kernels   (single: one GPU)
#   bash bench/run_gpu_benches.sh planner          (calibrate this machine, then validate on 1-2 GPUs)
#   bash bench/run_gpu_benches.sh nccl             (the link: all-gather / reduce-scatter / all-reduce bus bandwidth)
#   bash bench/run_gpu_benches.sh nccl-ce          (the same at 16 MiB, and on NCCL symmetric windows with the
#                                                   zero-CTA policy: the copy-engine all-gather, also from a graph)
#   LAYOUTS="1gpu pp4-1f1b pp4-zb-h2" bash bench/run_gpu_benches.sh layouts   (bench/layouts_bench.py)
#   AB_PATCH=x.patch LAYOUTS="tp2-sp-graph" bash bench/run_gpu_benches.sh ab   (the rows before and after
#                                                   `git apply x.patch`, a branch's diff, in one call: $OUT/before, $OUT/after;
#                                                   parallel3d's runs only)
#   bash bench/run_gpu_benches.sh fp8              (bf16 and FP8 recipes against plain + compile and torchtitan
#                                                   float8, one GPU per preset; FP8_PRESETS, FP8_GPUS presets at
#                                                   once, FP8_BUDGET_S seconds in all; FP8_RECIPES; FP8_WITHOUT:
#                                                   the first recipe without each named speed-up, gpt_bench.py
#                                                   --fp8-disable)
#   bash bench/run_gpu_benches.sh fp8-convergence  (one GPU: bench/fp8_convergence.py, FP8 against bf16)
#   bash bench/run_gpu_benches.sh fp8-tests        (tests/gpu/test_fp8_speedups.py, test_fp8_parity.py: 1 GPU, and 2 where present)
#   bash bench/run_gpu_benches.sh graphs           (--enable-cuda-graph: the graph layouts against one GPU, then
#                                                   LAYOUTS, e.g. "tp2-dp2 tp2-dp2-graph 7b-tp4 7b-tp4-graph" on 4 GPUs)
# PARALLEL3D_JIT=1 (set here) builds csrc/ once into ~/.cache; the GPT runs then use the kernels.
# Needs .whl/ with the megatron-core wheel and the anchor scripts (see ../shared/anchors/README.md), and
# .whl/titan/ for the torchtitan row of "single" (bench/fetch_titan_wheels.sh); .whl/torchao-*.whl for FP8.
set -u
export OUT=${OUT:-/tmp/bench_out} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PARALLEL3D_JIT=${PARALLEL3D_JIT:-1}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
mkdir -p "$OUT"
# A side-by-side run without its peer measures nothing: refuse before any work where a mode needs the
# peers' runners and none were carried (the GPU machine has no ../shared).
# Where the runners are looked for is bench/launch.py's rule (_anchor), asked here rather than repeated.
for what in "$@"; do
  case "$what" in single|ddp|pipeline|layouts|fp8|graphs)
    if ! (cd bench && python3 -c "import sys, launch; sys.exit(0 if launch.PLAIN and launch.MEGATRON else 1)"); then
      echo "run_gpu_benches: '$what' runs the peers, but their runners were not found (.whl/anchors/ or" \
           "../shared/anchors/): on the CPU machine, mkdir -p .whl/anchors && cp ../shared/anchors/*.py .whl/anchors/"; exit 2
    fi ;;
  esac
done
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/mcore .whl/megatron_core-*.whl
  export PYTHONPATH=/tmp/mcore${PYTHONPATH:+:$PYTHONPATH}
fi
if ls .whl/torchao-*.whl >/dev/null 2>&1 && ! python3 -c "import torchao" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/torchao .whl/torchao-*.whl
  export PYTHONPATH=/tmp/torchao${PYTHONPATH:+:$PYTHONPATH}
fi
# Build the kernels once here, before any multi-process run: two ranks JIT-building at the same time
# stalled a PP=2 run past its 240 s timeout once (2 x H200, 2026-11-26).
if [ "$PARALLEL3D_JIT" = 1 ]; then
  python3 -c "from parallel3d.fused import _ext; _ext.get_ext() or print('kernels not built:', _ext.load_error())"
fi
for what in "$@"; do
  case "$what" in
    fused-tests) OUT=$OUT/fused bash bench/gpu_check.sh tests > "$OUT/fused_tests.log" 2>&1; tail -n 25 "$OUT/fused_tests.log" ;;
    ddp) python3 bench/ddp_bench.py ;;
    single) python3 bench/single_gpu_bench.py ;;
    pipeline) python3 bench/pipeline_bench.py ;;
    kernels) python3 bench/kernels_bench.py ;;
    nccl) timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node ${NCCL_GPUS:-2} \
            bench/nccl_bench.py --json-out "$OUT/nccl_bench.json" ;;
    nccl-ce) NCCL_CTA_POLICY=2 timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node ${NCCL_GPUS:-2} \
            bench/nccl_bench.py --symmetric --sizes-mib 16 --json-out "$OUT/nccl_ce_bench.json" ;;
    planner) python3 bench/calibrate_planner.py --base h100-sxm --out "$OUT/planner_cluster.json" --nproc 2 \
               --timeout 150 && BENCH_TIMEOUT=110 python3 bench/validate_planner.py --batches 32 \
               --cluster-file "$OUT/planner_cluster.json" --log-dir "$OUT/logs" --out "$OUT/validate_planner.md" ;;
    layouts) python3 bench/layouts_bench.py --runs ${LAYOUTS:-1gpu tp2-sp} --timeout 110 --out "$OUT" ;;
    ab) python3 bench/layouts_bench.py --runs $LAYOUTS --timeout 110 --no-peer --out "$OUT/before" \
          && git apply "$AB_PATCH" && python3 bench/layouts_bench.py --runs $LAYOUTS --timeout 110 --no-peer --out "$OUT/after"
        git apply -R "$AB_PATCH" 2>/dev/null ;;
    fp8) python3 bench/single_gpu_bench.py --fp8 --presets ${FP8_PRESETS:-llama-3b llama-1b gpt-1.3b} \
           ${FP8_RECIPES:+--recipes $FP8_RECIPES} ${FP8_WITHOUT:+--fp8-without $FP8_WITHOUT} \
           --gpus ${FP8_GPUS:-1} --budget-s $(( ${FP8_BUDGET_S:-510} - SECONDS )) ;;
    fp8-convergence) python3 bench/fp8_convergence.py --out "$OUT" ;;
    graphs) timeout 300 python3 -m pytest -q -rs tests/gpu/test_nccl_parity.py -k "graph" 2>&1 | tee "$OUT/graph_tests.log" | tail -n 15
            python3 bench/layouts_bench.py --runs ${LAYOUTS:-1gpu tp2-sp tp2-sp-graph llama-tp2-sp llama-tp2-sp-graph} \
              --timeout 110 --out "$OUT" ;;
    fp8-tests) timeout 480 python3 -m pytest -q -rs tests/gpu/test_fp8_speedups.py tests/gpu/test_fp8_parity.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -n 40 ;;
    *) echo "unknown benchmark $what (fused-tests, single, ddp, pipeline, kernels, nccl, planner, layouts, fp8," \
            "fp8-convergence, fp8-tests, graphs, nccl-ce, ab)"; exit 2 ;;
  esac
done
# At most a few files come back from the device machine: pack the logs into one.
for dir in "$OUT" "$OUT/before" "$OUT/after"; do
  [ -d "$dir/logs" ] && tar czf "$dir/logs.tgz" -C "$dir" logs && rm -r "$dir/logs"
done
exit 0
