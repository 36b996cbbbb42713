"""The CPU-testable parts of bench/calibrate_planner.py and bench/validate_planner.py."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import calibrate_planner  # noqa: E402
import validate_planner  # noqa: E402
from parallel3d.planning import GemmCurve, get_cluster, load_cluster  # noqa: E402
from parallel3d.planning.hardware import cluster_from_dict  # noqa: E402


def test_bus_bandwidth_factors_are_nccl_tests():
    assert calibrate_planner.bus_factor("all_reduce", 2) == 1.0
    assert calibrate_planner.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert calibrate_planner.bus_factor("all_gather", 2) == 0.5
    assert calibrate_planner.bus_factor("p2p", 2) == 1.0


def test_calibration_file_loads_with_a_fitted_curve(tmp_path):
    truth = GemmCurve(989.4, 0.82, 140.0)
    measured = {"gpu": "NVIDIA H100 80GB HBM3", "raw": {"collectives_gbs": {"all_reduce": 331.0}},
                "gemm_points": [[m, n, k, truth.efficiency(m, n, k) * 989.4] for m, n, k in calibrate_planner.GEMM_SHAPES],
                "wgrad_factor": 0.93, "copy_gbs": 2950.0, "attention_fwd_efficiency": 0.33,
                "attention_bwd_efficiency": 0.27, "intra_busbw_gbs": 331.0, "memory_gib": 79.2}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(calibrate_planner.cluster_json("h100-sxm", measured)))
    cluster = load_cluster(str(path))
    assert cluster.name == "h100-sxm-calibrated" and cluster.intra_busbw_gbs == 331.0
    assert cluster.gemm.max_efficiency == pytest.approx(0.82) and cluster.gemm.wgrad_factor == 0.93
    assert cluster.nic_gbs == get_cluster("h100-sxm").nic_gbs  # not measured: kept from the base
    assert cluster_from_dict(json.loads(path.read_text())) == cluster


def test_validation_predicts_every_layout_and_prints_the_table():
    cluster = get_cluster("h200")
    rows = []
    for name in validate_planner.LAYOUTS:
        step, mem = validate_planner.predict(name, 32, cluster)
        assert 0.1 < step < 5 and 5 < mem < 80
        rows.append((name, 32, {"iteration_time_s": step * 1.05, "peak_memory_gb": mem * 0.95}, step, mem))
    rows.append(("tp2", 16, None, 0.3, 20.0))
    text = validate_planner.table(rows)
    assert text.count("\n") == 2 + len(rows) - 1
    assert "| pp2-v2 | 32 |" in text and "-4.8%" in text and "+5.3%" in text and "no result" in text
    # PP=2 predicts the LAST stage's memory (the rank whose RESULT_JSON gpt_bench prints).
    assert validate_planner.predict("pp2", 32, cluster)[1] != validate_planner.predict("1gpu", 32, cluster)[1]


def test_the_host_time_per_layer_is_the_difference_of_two_runs_per_layer_and_micro_batch():
    """calibrate_planner's host_layer_us: runs of 2 and 6 layers; their host times' difference per layer and
    micro-batch (the embedding's, loss's and optimizer's launches cancel)."""
    runs = {2: (10.0, 4), 6: (30.0, 4)}  # host ms of forward + backward, micro-batches per step
    assert calibrate_planner.measure_host_layer_us(60, run=lambda layers, timeout: runs[layers]) == 1250.0
    measured = {"gemm_points": [[1024, 1024, 1024, 500.0]], "raw": {}, "host_layer_us": 1250.0}
    assert calibrate_planner.cluster_json("h100-sxm", measured)["host_layer_us"] == 1250.0


def test_one_host_time_run_reports_the_hosts_milliseconds():
    """The measurement's run: a one-process gpt_bench --host-time of the given model (here a tiny one on the CPU,
    where the host also computes: the plumbing, not an H100 host's figure)."""
    tiny = ("--preset", "tiny", "--fp32", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "512", "--micro-batch-size", "1", "--global-batch-size", "2")
    host_ms, microbatches = calibrate_planner.host_fwd_bwd_ms(2, 180, tiny)
    assert host_ms > 0 and microbatches == 2
