"""Where a profiled step's collectives spend their time, collective by collective (from a chrome trace).

    python3 bench/collective_profile.py trace.json      # a trace torch.profiler exported (gpt_bench --trace-out)

For every NCCL kernel of the trace, joined to the host call that launched it (the ``correlation`` id):
- ``run``: how long the kernel ran (on NCCL this includes spinning until the peer arrives);
- ``queued``: launch call -> kernel start (the collective's stream waited for the compute it was ordered
  after, or for the collective before it);
- ``after_compute``: the last compute kernel's end -> kernel start (how late after its input was ready);
- ``beside``: the share of its run with a compute kernel running (hidden communication);
- ``exposed``: its run with nothing else running.
Summed per collective kind with medians, and the host's share: when the host's last launch of the step
came (against the last kernel's end) says whether the host or the GPU set the pace.
"""
from __future__ import annotations

import bisect
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_breakdown import merge_intervals  # noqa: E402

KINDS = ("AllGather", "ReduceScatter", "AllReduce", "SendRecv", "Broadcast")


def _kind(name: str) -> str:
    return next((k for k in KINDS if k.lower() in name.lower()), "other")


def _covered(a: float, b: float, merged) -> float:
    """Length of [a, b] covered by the merged intervals (a linear scan; the traces are small)."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if y > a and x < b)


def collective_table(trace: dict) -> dict:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
                and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    if not kernels:
        return {}
    comm = sorted((k for k in kernels if "nccl" in k["name"].lower()), key=lambda k: k["ts"])
    compute = sorted((k for k in kernels if "nccl" not in k["name"].lower()), key=lambda k: k["ts"])
    compute_merged = merge_intervals([(k["ts"], k["ts"] + k["dur"]) for k in compute])
    compute_ends = sorted(k["ts"] + k["dur"] for k in compute)
    rows: dict[str, dict[str, list]] = {}
    for k in comm:
        a, b = k["ts"], k["ts"] + k["dur"]
        launch = launches.get(k.get("args", {}).get("correlation"))
        queued = a - (launch["ts"] + launch.get("dur", 0)) if launch else None
        i = bisect.bisect_right(compute_ends, a)
        after = a - compute_ends[i - 1] if i else None
        beside = _covered(a, b, compute_merged)
        r = rows.setdefault(_kind(k["name"]), {"run": [], "queued": [], "after_compute": [], "beside": [],
                                                "stream": set()})
        r["run"].append(k["dur"])
        r["beside"].append(beside)
        r["stream"].add(k.get("args", {}).get("stream"))
        if queued is not None:
            r["queued"].append(queued)
        if after is not None:
            r["after_compute"].append(after)
    span_start = min(k["ts"] for k in kernels)
    span_end = max(k["ts"] + k["dur"] for k in kernels)
    host_last = max((e["ts"] + e.get("dur", 0) for e in launches.values()), default=None)
    med = lambda v: round(statistics.median(v), 1) if v else None  # noqa: E731
    table = {
        kind: {"count": len(r["run"]), "run_ms": round(sum(r["run"]) / 1e3, 2), "median_run_us": med(r["run"]),
               "p90_run_us": round(sorted(r["run"])[int(0.9 * (len(r["run"]) - 1))], 1),
               "median_queued_us": med(r["queued"]), "median_after_compute_us": med(r["after_compute"]),
               "beside_compute_ms": round(sum(r["beside"]) / 1e3, 2),
               "exposed_ms": round((sum(r["run"]) - sum(r["beside"])) / 1e3, 2),
               "streams": sorted(s for s in r["stream"] if s is not None)}
        for kind, r in rows.items()
    }
    return {"collectives": table, "span_ms": round((span_end - span_start) / 1e3, 2),
            "compute_busy_ms": round(sum(b - a for a, b in compute_merged) / 1e3, 2),
            "host_last_launch_before_end_ms": None if host_last is None else round((span_end - host_last) / 1e3, 2)}


def print_table(result: dict, out=sys.stdout) -> None:
    print(f"span {result['span_ms']} ms, compute busy {result['compute_busy_ms']} ms, host's last launch "
          f"{result['host_last_launch_before_end_ms']} ms before the last kernel ended", file=out)
    cols = ("count", "run_ms", "median_run_us", "p90_run_us", "median_queued_us", "median_after_compute_us",
            "beside_compute_ms", "exposed_ms", "streams")
    print("kind            " + " ".join(f"{c:>14s}" for c in cols), file=out)
    for kind, r in result["collectives"].items():
        print(f"{kind:15s} " + " ".join(f"{str(r[c]):>14s}" for c in cols), file=out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        res = collective_table(json.load(f))
    print_table(res)
    print("RESULT_JSON: " + json.dumps(res))
