#!/usr/bin/env bash
# Side-by-side GPT training benchmarks on one machine: Megatron-Core (the anchor runner) and
# parallel3d, same presets, same card, same call. Run on the GPU machine from the repo root:
#
#   bash bench/run_gpu_benches.sh dp        # DP=1 vs DP=2 (overlap on/off, bucket sizes), profiler overlap
#   bash bench/run_gpu_benches.sh pp        # PP=2 schedules with measured vs simulated bubble
#   bash bench/run_gpu_benches.sh tp        # TP=2 with sequence parallelism
#
# Needs the megatron-core wheel and the anchor scripts in .whl/ (see ../shared/anchors/README.md).
# Every result is one RESULT_JSON line, collected in $OUT/results.jsonl.
set -u
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT/logs"
PRESET=${PRESET:-gpt-1.3b}
ITERS=${ITERS:-8}
WARMUP=${WARMUP:-3}
TIMEOUT=${TIMEOUT:-150}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/mcore .whl/megatron_core-*.whl && export PYTHONPATH=/tmp/mcore
fi

run() {  # run NAME NPROC SCRIPT ARGS...
  local name=$1 np=$2 script=$3; shift 3
  echo "=== $name" | tee -a "$OUT/summary.txt"
  timeout "$TIMEOUT" torchrun --standalone --nproc-per-node "$np" "$script" --preset "$PRESET" \
      --iters "$ITERS" --warmup "$WARMUP" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  if grep -q "RESULT_JSON" "$OUT/logs/$name.log"; then
    grep -h "RESULT_JSON" "$OUT/logs/$name.log" | sed "s/^RESULT_JSON: /{\"run\": \"$name\", \"result\": /; s/$/}/" \
        >> "$OUT/results.jsonl"
    grep -h "RESULT_JSON" "$OUT/logs/$name.log" | cut -c1-400 | tee -a "$OUT/summary.txt"
  else
    echo "FAILED rc=$rc" | tee -a "$OUT/summary.txt"; tail -n 15 "$OUT/logs/$name.log" | tee -a "$OUT/summary.txt"
  fi
}
MEG=.whl/anchors/megatron_gpt_bench.py
OURS=bench/gpt_bench.py

for what in "$@"; do
  case "$what" in
    dp)
      run megatron_dp1_gbs16 1 $MEG --global-batch-size 16
      run p3d_dp1_gbs16 1 $OURS --global-batch-size 16
      run megatron_dp2_gbs32_overlap 2 $MEG --global-batch-size 32 --overlap-grad-reduce
      run p3d_dp2_gbs32_overlap 2 $OURS --global-batch-size 32 --overlap-grad-reduce --profile-overlap
      run p3d_dp2_gbs32_no_overlap 2 $OURS --global-batch-size 32 --profile-overlap
      ;;
    buckets)
      run p3d_dp2_gbs32_overlap_bucket10M 2 $OURS --global-batch-size 32 --overlap-grad-reduce --ddp-bucket-size 10000000
      run p3d_dp2_gbs32_overlap_bucket200M 2 $OURS --global-batch-size 32 --overlap-grad-reduce --ddp-bucket-size 200000000
      ;;
    pp)
      run p3d_pp2_1f1b 2 $OURS --pp 2 --global-batch-size 32 --schedule-timing
      run p3d_pp2_interleaved 2 $OURS --pp 2 --vpp 2 --global-batch-size 32 --schedule-timing
      run p3d_pp2_gpipe 2 $OURS --pp 2 --schedule gpipe --global-batch-size 32 --schedule-timing
      run megatron_pp2_1f1b 2 $MEG --pp 2 --global-batch-size 32
      run megatron_pp2_interleaved 2 $MEG --pp 2 --vpp 2 --global-batch-size 32
      ;;
    tp)
      run p3d_tp2_sp 2 $OURS --tp 2 --sequence-parallel --global-batch-size 32
      run megatron_tp2_sp 2 $MEG --tp 2 --sequence-parallel --global-batch-size 32
      ;;
    single)
      run megatron_1gpu_gbs4 1 $MEG --global-batch-size 4
      run p3d_1gpu_gbs4 1 $OURS --global-batch-size 4
      ;;
  esac
done
# At most a few files come back from the device machine: pack the logs into one.
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$OUT/logs"
