"""bench/gpu_clocks.py and its use in bench/launch.py: each bench run's result carries the SM clock and power of
its GPUs over its timed steps (a fake nvidia-smi stands in for the GPU machine's)."""
import os
import stat
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import gpu_clocks  # noqa: E402
import launch  # noqa: E402


def test_a_sample_line_parses_and_other_lines_do_not():
    t, gpu, mhz, watts, reasons = gpu_clocks.parse_sample("2026/11/28 19:20:00.548, 3, 1455, 699.12, 0x0000000000000004\n")
    assert (gpu, mhz, watts, reasons) == ("3", 1455.0, 699.12, 4)
    later = gpu_clocks.parse_sample("2026/11/28 19:20:00.648, 3, 1455, 699.12, 0x4")
    assert abs(later[0] - t - 0.1) < 1e-6
    for junk in ("", "Failed to initialize NVML", "2026/11/28 19:20:00.548, 0, [N/A], 70.0, 0x0"):
        assert gpu_clocks.parse_sample(junk) is None


def test_the_summary_takes_the_window_only():
    samples = [(0.0, "0", 1980.0, 100.0, 0x0), (1.0, "0", 1500.0, 700.0, 0x4), (2.0, "0", 1700.0, 650.0, 0x0),
               (3.0, "0", 1600.0, 690.0, 0x4 | 0x8), (9.0, "0", 1980.0, 90.0, 0x1)]
    s = gpu_clocks.summarize(samples, 1.0, 3.0)
    assert s == {"samples": 3, "sm_mhz_mean": 1600, "sm_mhz_min": 1500, "power_w_mean": 680,
                 "power_capped_share": round(2 / 3, 3), "slowdown_share": round(1 / 3, 3)}
    assert gpu_clocks.summarize(samples, 4.0, 8.0) is None


def test_visible_gpus_follow_cuda_visible_devices():
    assert gpu_clocks.visible_gpus(2, {}) == ["0", "1"]
    assert gpu_clocks.visible_gpus(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2"]
    assert gpu_clocks.visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb,GPU-cc"}) == ["GPU-aa", "GPU-bb"]


FAKE_SMI = """\
#!{python}
import datetime, os, sys, time
args = " ".join(sys.argv[1:])
if "-lms" not in args:  # the query-name probe
    print("0x0000000000000000")
    sys.exit(0)
assert "-i 5" in args, args  # the run's GPU, from CUDA_VISIBLE_DEVICES
open(os.environ["FAKE_SMI_STARTED"], "w").close()
while True:
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{{now}}, 5, 1455, 699.50, 0x0000000000000004", flush=True)
    time.sleep(0.02)
"""

# A runner's "timed steps" start once the sampler samples (a loaded machine may start it late).
WAIT_FOR_SAMPLER = """\
import json, os, time
assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # CUDA's GPU numbers are nvidia-smi's
deadline = time.time() + 60
while not os.path.exists(os.environ["FAKE_SMI_STARTED"]) and time.time() < deadline:
    time.sleep(0.01)
"""

RUNNER = WAIT_FOR_SAMPLER + """\
time.sleep(1.0)  # three "timed steps" of 0.3 s, then the result
print("RESULT_JSON: " + json.dumps({"iteration_time_s": 0.3, "tokens_per_s_per_gpu": 1.0}), flush=True)
"""


def _fake_smi_and_runner(tmp_path, monkeypatch, smi_text: str, runner_text: str) -> str:
    """An nvidia-smi on PATH running smi_text, and the runner's path."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(smi_text.format(python=sys.executable))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    runner = tmp_path / "runner.py"
    runner.write_text(textwrap.dedent(runner_text))
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_STARTED", str(tmp_path / "smi_started"))
    return str(runner)


def test_a_bench_run_reports_its_gpus_clocks_over_its_timed_steps(tmp_path, monkeypatch):
    runner = _fake_smi_and_runner(tmp_path, monkeypatch, FAKE_SMI, RUNNER)
    result = launch.run("fake", 1, runner, ["--iters", "3"], str(tmp_path / "logs"), timeout=120,
                        env={"CUDA_VISIBLE_DEVICES": "5", "OMP_NUM_THREADS": "1"})
    clocks = result["gpu_clocks"]
    assert clocks["samples"] >= 10, clocks  # 0.9 s of samples every 20 ms
    assert (clocks["sm_mhz_mean"], clocks["power_capped_share"], clocks["slowdown_share"]) == (1455, 1.0, 0.0)
    assert "RESULT_JSON" in (tmp_path / "logs" / "fake.log").read_text()  # the log is still written


def test_without_nvidia_smi_a_run_has_no_clocks(tmp_path, monkeypatch):
    runner = tmp_path / "runner.py"
    runner.write_text('import json\nprint("RESULT_JSON: " + json.dumps({"iteration_time_s": 0.3, "tokens_per_s_per_gpu": 1.0}))\n')
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    result = launch.run("plain", 1, str(runner), ["--iters", "3"], str(tmp_path / "logs"), timeout=120,
                        env={"OMP_NUM_THREADS": "1"})
    assert result["tokens_per_s_per_gpu"] == 1.0 and result["gpu_clocks"] is None


FAKE_SMI_TEARDOWN = """\
#!{python}
import datetime, os, sys, time
if "-lms" not in " ".join(sys.argv[1:]):
    print("0x0000000000000000")
    sys.exit(0)
open(os.environ["FAKE_SMI_STARTED"], "w").close()
while True:  # 1455 MHz at the power cap while the steps run, 1980 MHz idle once the teardown began
    idle = os.path.exists(os.environ["FAKE_TEARDOWN"])
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{{now}}, 0, {{1980 if idle else 1455}}, 699.50, {{'0x0' if idle else '0x0000000000000004'}}", flush=True)
    time.sleep(0.02)
"""

RUNNER_TEARDOWN = WAIT_FOR_SAMPLER + """\
time.sleep(1.0)  # three "timed steps" of 0.3 s
end = time.time()
time.sleep(0.05)  # the samples' times are whole milliseconds: none after the steps can read as before their end
open(os.environ["FAKE_TEARDOWN"], "w").close()
time.sleep(1.5)  # a teardown longer than the timed steps, then the result
print("RESULT_JSON: " + json.dumps({"iteration_time_s": 0.3, "tokens_per_s_per_gpu": 1.0, "timed_end_unix": end}),
      flush=True)
"""


def test_a_run_that_reports_after_its_teardown_is_sampled_over_its_steps(tmp_path, monkeypatch):
    runner = _fake_smi_and_runner(tmp_path, monkeypatch, FAKE_SMI_TEARDOWN, RUNNER_TEARDOWN)
    monkeypatch.setenv("FAKE_TEARDOWN", str(tmp_path / "teardown"))
    result = launch.run("titan-like", 1, runner, ["--iters", "3"], str(tmp_path / "logs"), timeout=120,
                        env={"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1"})
    clocks = result["gpu_clocks"]
    assert clocks["samples"] >= 10, clocks
    assert (clocks["sm_mhz_mean"], clocks["power_capped_share"]) == (1455, 1.0), clocks
