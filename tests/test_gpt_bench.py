"""bench/gpt_bench.py on CPU ranks: the diagnosis options produce their figures (the GPU runs are in BENCHMARKS.md)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--preset", "tiny", "--fp32", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1", "--vocab-size", "512", "--iters", "1", "--warmup", "0"]


def run_bench(nproc: int, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "bench", "gpt_bench.py"), *TINY, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT_JSON: ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT_JSON: "):])


def test_host_time_reports_the_host_and_the_device_time_of_forward_and_backward():
    # TP=2 + SP on two CPU ranks: forward_backward is timed for 4 steps, and put back afterwards.
    result = run_bench(2, "--tp", "2", "--sequence-parallel", "--global-batch-size", "2", "--host-time")
    pairs = result["host_gpu_fwd_bwd_ms"]
    assert len(pairs) == 4 and all(h > 0 and g >= h for h, g in pairs)  # on CPU the device time is the host's
    assert result["host_fwd_bwd_ms"] <= result["gpu_fwd_bwd_ms"]
    assert 0 < result["gpu_fwd_bwd_ms"] < 1e3 * result["iteration_time_s"] * 10
