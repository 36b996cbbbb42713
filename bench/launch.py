"""Run one benchmark configuration under torchrun and return its RESULT_JSON (shared by the bench drivers)."""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.path.join(ROOT, "bench", "gpt_bench.py")
if ROOT not in sys.path:  # a plain checkout: parallel3d from here, installed or not
    sys.path.insert(0, ROOT)

from parallel3d.lifetime import kill_job  # noqa: E402

from gpu_clocks import ClockSampler, visible_gpus  # noqa: E402


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


def bounded(cmd: list[str], timeout: float, on_line: Optional[Callable[[str], None]] = None, **popen) -> Optional[int]:
    """Run a torchrun command line for at most ``timeout`` seconds; its exit code, None past the timeout. Past
    it, or when this process is interrupted, torchrun and every worker it started are killed: a worker left
    behind would share the GPUs with the next run (``parallel3d.lifetime.kill_job``). With ``on_line``, the
    run's output (stdout and stderr) goes to it line by line, as each line comes."""
    if on_line is not None:
        # errors="replace": a byte that is not UTF-8 must not stop the reader, which would leave the pipe full
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, **popen)
    reader = None
    if on_line is not None:
        reader = threading.Thread(target=lambda: [on_line(line) for line in proc.stdout], daemon=True)
        reader.start()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_job(proc)
        if reader is not None:
            reader.join(timeout=10)


def run(name: str, nproc: int, script: Optional[str], args: list[str], log_dir: str,
        timeout: Optional[int] = None, env: Optional[dict] = None) -> Optional[dict]:
    """torchrun ``script`` with ``args`` (and ``env`` added to the environment); the parsed RESULT_JSON, or
    None (the log says why). Where nvidia-smi runs, the result also has ``gpu_clocks``: the SM clock and power
    of the run's GPUs over its timed steps (bench/gpu_clocks.py), the ``--iters`` steps before its RESULT_JSON
    line came, or before ``timed_end_unix`` where the result has it (a runner that reports only after a
    teardown: torchtitan's Trainer sleeps and destroys its process groups first)."""
    if script is None:
        print(f"{name}: runner not found, skipped", flush=True)
        return None
    timeout = timeout or int(os.environ.get("BENCH_TIMEOUT", "300"))
    os.makedirs(log_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script] + args
    log = os.path.join(log_dir, f"{name}.log")
    # CUDA numbers the GPUs fastest first unless told otherwise, nvidia-smi by PCI bus: the same order on a
    # node of one kind of card, not on a mixed one. PCI order makes CUDA_VISIBLE_DEVICES name, for the run
    # and for the clock sampler alike, the card nvidia-smi reports.
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **os.environ, **(env or {})}
    result_line, result_at = None, 0.0  # the first RESULT_JSON line, and when it came

    def line(text: str) -> None:
        nonlocal result_line, result_at
        f.write(text)
        if result_line is None and text.startswith("RESULT_JSON: "):
            result_line, result_at = text, time.time()

    with open(log, "w") as f, ClockSampler(visible_gpus(nproc, env)) as clocks:
        if bounded(cmd, timeout, on_line=line, env=env) is None:
            f.write(f"\nTIMEOUT after {timeout}s\n")
    if result_line is None:
        print(f"{name}: FAILED, see {log}:\n" + "".join(open(log).readlines()[-12:]), flush=True)
        return None
    result = json.loads(result_line[len("RESULT_JSON: "):])
    timed = _flag(args, "--iters") * iteration_time(result)  # NaN where either is unknown
    if not math.isnan(timed):
        end = float(result.get("timed_end_unix", result_at))
        result["gpu_clocks"] = clocks.summary(end - timed, end)
    c = result.get("gpu_clocks")
    at = (f" (SM {c['sm_mhz_mean']} MHz, {c['power_w_mean']} W, power-capped in "
          f"{100 * c['power_capped_share']:.0f}% of samples)" if c else "")
    print(f"{name}: {tokens_per_gpu(result):,.0f} tokens/s/GPU{at}", flush=True)
    return result


def _flag(args: list[str], flag: str) -> float:
    """The value of ``flag`` in a command line, NaN where it is absent."""
    return float(args[args.index(flag) + 1]) if flag in args else float("nan")


def tokens_per_gpu(result: Optional[dict]) -> float:
    return float(result.get("tokens_per_s_per_gpu", 0.0)) if result else float("nan")


def iteration_time(result: Optional[dict]) -> float:
    if not result:
        return float("nan")
    value = result.get("iteration_time_s") or result.get("iter_time_median_s")
    return float("nan") if value is None else float(value)
