"""Run one benchmark configuration under torchrun and return its RESULT_JSON (shared by the bench drivers)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.path.join(ROOT, "bench", "gpt_bench.py")
if ROOT not in sys.path:  # a plain checkout: parallel3d from here, installed or not
    sys.path.insert(0, ROOT)

from parallel3d.lifetime import kill_job  # noqa: E402


def _anchor(name: str) -> Optional[str]:
    """A peer's runner from ../shared/anchors, or its copy next to the carried wheels (GPU machine)."""
    return next((p for p in (os.path.join(ROOT, ".whl", "anchors", name), os.path.join(ROOT, "..", "shared", "anchors", name))
                 if os.path.exists(p)), None)


MEGATRON = _anchor("megatron_gpt_bench.py")
PLAIN = _anchor("plain_gpt_bench.py")  # the model written by hand in plain PyTorch (eager or torch.compile)
# torchtitan's own Trainer (bench/torchtitan_bench.py); it needs its wheels in .whl/titan/
TITAN_WHEELS = os.path.join(ROOT, ".whl", "titan")
TITAN = (os.path.join(ROOT, "bench", "torchtitan_bench.py")
         if glob.glob(os.path.join(TITAN_WHEELS, "torchtitan-*.whl")) else None)


def bounded(cmd: list[str], timeout: float, **popen) -> Optional[int]:
    """Run a torchrun command line for at most ``timeout`` seconds; its exit code, None past the timeout. Past
    it, or when this process is interrupted, torchrun and every worker it started are killed: a worker left
    behind would share the GPUs with the next run (``parallel3d.lifetime.kill_job``)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, **popen)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_job(proc)


def run(name: str, nproc: int, script: Optional[str], args: list[str], log_dir: str,
        timeout: Optional[int] = None, env: Optional[dict] = None) -> Optional[dict]:
    """torchrun ``script`` with ``args`` (and ``env`` added to the environment); the parsed RESULT_JSON, or
    None (the log says why)."""
    if script is None:
        print(f"{name}: runner not found, skipped", flush=True)
        return None
    timeout = timeout or int(os.environ.get("BENCH_TIMEOUT", "300"))
    os.makedirs(log_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script] + args
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "w") as f:
        if bounded(cmd, timeout, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}) is None:
            f.write(f"\nTIMEOUT after {timeout}s\n")
    for line in open(log):
        if line.startswith("RESULT_JSON: "):
            result = json.loads(line[len("RESULT_JSON: "):])
            print(f"{name}: {tokens_per_gpu(result):,.0f} tokens/s/GPU", flush=True)
            return result
    print(f"{name}: FAILED, see {log}:\n" + "".join(open(log).readlines()[-12:]), flush=True)
    return None


def tokens_per_gpu(result: Optional[dict]) -> float:
    return float(result.get("tokens_per_s_per_gpu", 0.0)) if result else float("nan")


def iteration_time(result: Optional[dict]) -> float:
    if not result:
        return float("nan")
    return float(result.get("iteration_time_s") or result.get("iter_time_median_s"))
