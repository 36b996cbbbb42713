"""bench/profile_breakdown.py: the GPU-time breakdown BENCHMARKS.md quotes, on a made-up kernel list."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from profile_breakdown import kernel_breakdown, kernel_class  # noqa: E402


def _kernel(name, start, end, annotation=False):
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))


def test_kernel_classes():
    assert kernel_class("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "comm"
    assert kernel_class("Memcpy PtoP (Device -> Device)") == "comm"
    assert kernel_class("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "gemm"
    assert kernel_class("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kernel_class("vectorized_elementwise_kernel") == "other"


def test_breakdown_counts_exposed_communication_and_idle():
    cpu_op = SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU,
                             time_range=SimpleNamespace(start=0, end=10_000))
    launch = SimpleNamespace(name="cudaLaunchKernel", device_type=torch.autograd.DeviceType.CPU,
                             time_range=SimpleNamespace(start=0, end=5))
    host_rows = [SimpleNamespace(key="cudaLaunchKernel", self_cpu_time_total=1500.0),
                 SimpleNamespace(key="aten::mm", self_cpu_time_total=3000.0)]
    prof = SimpleNamespace(key_averages=lambda: host_rows, events=lambda: [
        launch, launch,                          # the host's launches, counted
        _kernel("nvjet_gemm", 0, 1000),          # compute 0-1 ms
        _kernel("ncclAllGather", 500, 1500),     # comm 0.5-1.5: half beside the GEMM
        _kernel("flash_fwd", 2000, 2500),        # idle 1.5-2.0
        _kernel("elementwise", 2400, 3000),
        cpu_op,                                  # CPU events are not kernels
        _kernel("Optimizer.step#AdamW.step", 0, 3000, annotation=True),  # nor GPU-side annotation ranges
    ])
    r = kernel_breakdown(prof)
    assert r["gemm_ms"] == pytest.approx(1.0) and r["attention_ms"] == pytest.approx(0.5)
    assert r["other_ms"] == pytest.approx(0.6) and r["comm_ms"] == pytest.approx(1.0)
    assert r["span_ms"] == pytest.approx(3.0)
    assert r["comm_exposed_ms"] == pytest.approx(0.5)
    assert r["idle_ms"] == pytest.approx(0.5)
    assert r["nccl_overlap_fraction"] == pytest.approx(0.5)
    assert r["top_other_ms"] == {"elementwise": pytest.approx(0.6)}
    assert list(r["top_host_ms"].items()) == [("aten::mm", 3.0), ("cudaLaunchKernel", 1.5)]  # most host time first
    assert r["kernel_launches"] == 2
    assert r["top_gaps"] == [{"ms": pytest.approx(0.5), "at_ms": pytest.approx(1.5), "after": "ncclAllGather",
                              "before": "flash_fwd"}]  # the idle stretch, between the kernels around it
    assert kernel_breakdown(SimpleNamespace(events=lambda: [cpu_op])) == {}


def test_collective_table_joins_each_nccl_kernel_to_its_launch():
    """bench/collective_profile.py on a made-up trace: a GEMM 0-100 us; an all-gather launched at 10, started
    at 90 (queued behind the GEMM), running 90-130 (10 us beside the GEMM, 30 exposed)."""
    from collective_profile import collective_table

    ev = lambda cat, name, ts, dur, corr, stream=7: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                                     "args": {"correlation": corr, "stream": stream}}
    trace = {"traceEvents": [
        ev("cuda_runtime", "cudaLaunchKernel", 0, 2, 1), ev("kernel", "nvjet_gemm", 0, 100, 1),
        ev("cuda_driver", "cuLaunchKernelEx", 10, 2, 2), ev("kernel", "ncclDevKernel_AllGather_RING_LL", 90, 40, 2, 19),
    ]}
    result = collective_table(trace)
    ag = result["collectives"]["AllGather"]
    assert ag["count"] == 1 and ag["median_run_us"] == 40.0 and ag["median_queued_us"] == 78.0
    assert ag["beside_compute_ms"] == 0.01 and ag["exposed_ms"] == 0.03 and ag["streams"] == [19]
    assert result["span_ms"] == 0.13 and result["compute_busy_ms"] == 0.1


def test_top_gaps_are_the_longest_first_with_their_neighbours():
    from profile_breakdown import top_gaps

    kernels = [_kernel("c", 4500, 5000), _kernel("a", 0, 1000), _kernel("long", 200, 1200), _kernel("b", 3000, 4000)]
    assert top_gaps(kernels, 5) == [
        {"ms": pytest.approx(1.8), "at_ms": pytest.approx(1.2), "after": "long", "before": "b"},  # a ran inside long
        {"ms": pytest.approx(0.5), "at_ms": pytest.approx(4.0), "after": "b", "before": "c"}]
    assert len(top_gaps(kernels, 1)) == 1 and top_gaps([], 3) == []
