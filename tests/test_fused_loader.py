"""The kernel loader: one process of a node builds at a time, the others wait; a run says what it runs."""
import multiprocessing as mp
import os
import time

from parallel3d.fused import _ext, describe


def _build_in(build_dir, log):
    def build():
        with open(log, "a") as f:
            f.write(f"start {time.monotonic()}\n")
        time.sleep(0.3)
        with open(log, "a") as f:
            f.write(f"end {time.monotonic()}\n")
        return os  # any module: what a build returns

    return _ext.one_at_a_time(build_dir, build) is os


def _worker(build_dir, log, results):
    results.put(_build_in(build_dir, log))


def test_concurrent_builds_run_one_at_a_time(tmp_path):
    ctx = mp.get_context("fork")  # the workers need nothing from a fresh interpreter
    results = ctx.Queue()
    log = str(tmp_path / "log")
    procs = [ctx.Process(target=_worker, args=(str(tmp_path / "build"), log, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [results.get(timeout=5) for _ in procs] == [True] * 3
    events = [line.split() for line in open(log)]
    assert [kind for kind, _ in events] == ["start", "end"] * 3, events  # never two builds at once


def test_a_dead_builder_does_not_block_the_next(tmp_path):
    """The lock is the kernel's (flock): released when its holder dies, unlike a lock file left behind."""
    ctx = mp.get_context("fork")  # the workers need nothing from a fresh interpreter
    p = ctx.Process(target=_build_in, args=(str(tmp_path / "build"), str(tmp_path / "log")))
    p.start()
    time.sleep(0.1)
    p.kill()
    p.join()
    start = time.monotonic()
    assert _build_in(str(tmp_path / "build"), str(tmp_path / "log2"))
    assert time.monotonic() - start < 5


def test_a_cpu_process_says_it_runs_the_pytorch_implementations():
    assert describe().startswith("fused kernels: off (this process computes on the CPU")


def _jit_build_with(monkeypatch, tmp_path, arch_list):
    """_jit_build on a pretend CUDA machine (capability 9.0); returns load()'s keywords."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("HOME", str(tmp_path))  # the build directory goes under ~/.cache
    if arch_list is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or os)
    before = dict(os.environ)
    assert _ext._jit_build() is os
    assert dict(os.environ) == before, "the JIT build changed the process environment"
    return calls[0]


def test_jit_build_passes_this_gpus_arch_to_nvcc_and_leaves_the_environment_alone(monkeypatch, tmp_path):
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    flags = _jit_build_with(monkeypatch, tmp_path, None)["extra_cuda_cflags"]
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert _get_cuda_arch_flags(flags) == []  # torch adds no arch of its own (nor reads the variable)


def test_jit_build_leaves_a_users_arch_list_to_torch(monkeypatch, tmp_path):
    flags = _jit_build_with(monkeypatch, tmp_path, "8.0;9.0")["extra_cuda_cflags"]
    assert not any("arch" in f for f in flags)  # torch's build reads TORCH_CUDA_ARCH_LIST itself
