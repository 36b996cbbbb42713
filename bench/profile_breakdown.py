"""Where a profiled step's GPU time goes: GEMM, attention, other compute, communication exposed, idle.

From the profiler's kernel list (``torch.profiler`` with CUDA activity) of one rank:
- each kernel falls in one class by its name: ``comm`` (NCCL kernels and copies between GPUs), ``gemm``, ``attention``, or ``other`` (elementwise, norms, loss, optimizer);
- ``*_ms`` are the summed kernel times of a class (kernels on several streams can run at once, so the sum
  can exceed the span);
- ``comm_exposed_ms``: communication time during which no compute kernel ran (what overlap should hide);
- ``idle_ms``: the part of the span (first kernel start to last kernel end) with no kernel at all (host
  overhead, launch gaps, waits);
- ``top_other_ms``: the ``other`` kernels with the most time, by name, to say which of them two runs
  differ in (GEMMs and attention are the same cuBLAS and flash kernels in ours and the peers');
- ``top_gaps``: the longest stretches of that idle time, each with when it began and the kernels on either
  side, to say where it comes from (a host synchronisation, a phase whose launches the GPU outruns).
"""
from __future__ import annotations

import torch

GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")
ATTENTION = ("flash", "fmha", "sdpa", "attention")


def kernel_class(name: str) -> str:
    n = name.lower()
    if "nccl" in n or "memcpy ptop" in n:  # PtoP: a copy between GPUs
        return "comm"
    if any(k in n for k in ATTENTION):
        return "attention"
    if any(k in n for k in GEMM):
        return "gemm"
    return "other"


def merge_intervals(intervals: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _length(merged: list[list[float]]) -> float:
    return sum(b - a for a, b in merged)


def _overlap(a: list[list[float]], b: list[list[float]]) -> float:
    """Length of the intersection of two merged interval lists (two-pointer walk)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kernels(prof) -> list:
    """The profile's GPU kernels. Not its GPU-side annotations (``record_function`` ranges such as
    torch's "Optimizer.step#AdamW.step"): they span kernels already counted, and the gaps between them."""
    return [e for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def kernel_breakdown(prof) -> dict:
    """The breakdown (milliseconds) of the profiled kernels; also the DP-overlap figures
    ``nccl_overlap_fraction`` etc. (share of communication that ran beside compute)."""
    kernels = [(kernel_class(e.name), e.time_range.start, e.time_range.end) for e in _kernels(prof)]
    if not kernels:
        return {}
    sums = {c: 0.0 for c in ("gemm", "attention", "other", "comm")}
    for c, a, b in kernels:
        sums[c] += b - a
    comm = merge_intervals([(a, b) for c, a, b in kernels if c == "comm"])
    compute = merge_intervals([(a, b) for c, a, b in kernels if c != "comm"])
    span = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
    beside = _overlap(comm, compute)
    busy = _length(merge_intervals([(a, b) for _, a, b in kernels]))
    us = 1e-3  # profiler times are microseconds
    return {**{f"{c}_ms": v * us for c, v in sums.items()},
            "comm_exposed_ms": (_length(comm) - beside) * us, "idle_ms": (span - busy) * us, "span_ms": span * us,
            "nccl_kernel_us": _length(comm), "nccl_beside_compute_us": beside,
            "nccl_overlap_fraction": beside / _length(comm) if comm else None,
            "nccl_kernels": sum(1 for c, _, _ in kernels if c == "comm"),
            "top_other_ms": _top(prof, "other", 12), "top_host_ms": top_host(prof, 15),
            "top_gaps": top_gaps(_kernels(prof), 10),
            "kernel_launches": sum(1 for e in prof.events() if e.name in _LAUNCHES)}


_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
             "cudaMemsetAsync")


def top_host(prof, n: int) -> dict[str, float]:
    """The ``n`` operators and CUDA runtime calls with the most host (CPU self) time, in ms: where a step bound
    by the host spends it."""
    rows = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)[:n]
    return {r.key[:90]: round(r.self_cpu_time_total * 1e-3, 3) for r in rows}


def top_gaps(kernels: list, n: int) -> list[dict]:
    """The ``n`` longest gaps with no kernel running on any stream, longest first: its length (ms), when it began
    (ms after the first kernel's start), the kernel that ended last before it and the one that started it."""
    order = sorted(kernels, key=lambda e: e.time_range.start)
    gaps, end, before = [], order[0].time_range.start if order else 0.0, None
    for e in order:
        if before is not None and e.time_range.start > end:
            gaps.append({"ms": round((e.time_range.start - end) * 1e-3, 3),
                         "at_ms": round((end - order[0].time_range.start) * 1e-3, 3),
                         "after": before.name[:90], "before": e.name[:90]})
        if before is None or e.time_range.end > end:
            end, before = e.time_range.end, e
    return sorted(gaps, key=lambda g: -g["ms"])[:n]


def _top(prof, cls: str, n: int) -> dict[str, float]:
    """The ``n`` kernel names of class ``cls`` with the most summed time (ms), names cut to 90 characters."""
    by_name: dict[str, float] = {}
    for e in _kernels(prof):
        if kernel_class(e.name) == cls:
            key = e.name[:90]
            by_name[key] = by_name.get(key, 0.0) + (e.time_range.end - e.time_range.start) * 1e-3
    return {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:n]}


def write_op_table(prof, path: str, rows: int = 45) -> None:
    """The operators with the most GPU time (torch's key_averages tables) to ``path``: by name (where the
    step's time goes), then by name and input shapes (which call of the model launched a kernel that
    ``top_other_ms`` names)."""
    by_name = prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)
    by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=rows,
                                                                   max_name_column_width=60, max_shapes_column_width=70)
    with open(path, "w") as f:
        f.write(by_name + "\n\n" + by_shape)
