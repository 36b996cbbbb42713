"""The SM clock and power of a run's GPUs while its timed steps ran: is the step bound by the card's power limit?

A step dense in GEMMs can draw the card's power limit (700 W on an H200); the driver then lowers the SM clock
(the clock-event reason "SW power cap"), and the same cuBLAS kernel runs slower than it does in a step with
more idle or memory-bound time between its GEMMs. Two frameworks' kernel times compare only at their clocks.

``ClockSampler`` runs ``nvidia-smi --query-gpu ... -lms 100`` beside a run and keeps its samples;
``summary(start, end)`` gives, over the samples in that window (the timed steps): the mean and lowest SM clock,
the mean power draw, and the share of samples in which the power cap held the clock down. Without nvidia-smi
(a machine with no GPU) there are no samples and no summary.
"""
from __future__ import annotations

import datetime
import shutil
import subprocess
import threading
from typing import Optional

FIELDS = "timestamp,index,clocks.sm,power.draw,{reasons}"
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW thermal, HW thermal slowdown, HW power brake


def _reasons_field(smi: str) -> str:
    """The clock-event reasons' query name: drivers from 535 call it clocks_event_reasons, older ones
    clocks_throttle_reasons."""
    probe = subprocess.run([smi, "--query-gpu=clocks_event_reasons.active", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    return "clocks_event_reasons.active" if probe.returncode == 0 else "clocks_throttle_reasons.active"


def parse_sample(line: str) -> Optional[tuple[float, str, float, float, int]]:
    """(unix time, GPU index, SM MHz, power W, reasons bit mask) of one ``--format=csv,noheader,nounits``
    line; None for a line that is not a sample (a warning, "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5:
        return None
    try:  # nvidia-smi prints local time, as datetime reads it
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return t, parts[1], float(parts[2]), float(parts[3]), int(parts[4], 16)
    except ValueError:
        return None


def summarize(samples: list, start: float, end: float) -> Optional[dict]:
    """The samples taken in [start, end], over all GPUs sampled: SM clock (mean, lowest), power (mean), and the
    shares of samples held down by the power cap and by a hardware or thermal slowdown. None without samples."""
    s = [x for x in samples if start <= x[0] <= end]
    if not s:
        return None
    n = len(s)
    return {"samples": n, "sm_mhz_mean": round(sum(x[2] for x in s) / n), "sm_mhz_min": round(min(x[2] for x in s)),
            "power_w_mean": round(sum(x[3] for x in s) / n),
            "power_capped_share": round(sum(1 for x in s if x[4] & SW_POWER_CAP) / n, 3),
            "slowdown_share": round(sum(1 for x in s if x[4] & SLOWDOWN) / n, 3)}


class ClockSampler:
    """Samples ``gpus`` (nvidia-smi's ``-i``: indices or UUIDs) every ``period_ms`` between ``__enter__`` and
    ``__exit__``; a no-op where nvidia-smi is missing."""

    def __init__(self, gpus: list[str], period_ms: int = 100):
        self.gpus, self.period_ms, self.samples = gpus, period_ms, []
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None

    def __enter__(self) -> "ClockSampler":
        smi = shutil.which("nvidia-smi")
        if smi is None or not self.gpus:
            return self
        try:  # a sampler that cannot start leaves the run unsampled, never failed
            query = FIELDS.format(reasons=_reasons_field(smi))
            self._proc = subprocess.Popen([smi, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                           f"-lms={self.period_ms}", "-i", ",".join(self.gpus)],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (OSError, subprocess.SubprocessError):
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._reader.join(timeout=5)

    def summary(self, start: float, end: float) -> Optional[dict]:
        return summarize(self.samples, start, end)


def visible_gpus(nproc: int, env: dict) -> list[str]:
    """The GPUs a torchrun of ``nproc`` ranks takes: the first ``nproc`` of CUDA_VISIBLE_DEVICES (indices or
    UUIDs, as nvidia-smi's ``-i`` takes them), else 0 .. nproc - 1."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in visible.split(",") if g.strip()] if visible is not None else [str(i) for i in range(nproc)]
    return ids[:nproc]
