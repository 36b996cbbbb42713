"""Workers die with their launcher (parallel3d/lifetime.py): a SIGKILLed torchrun leaves no worker behind."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "1000",
        "--no-progress-bar", "--train-iters", "100000"]
DIE_WITHIN_S = 5.0


def _kill(pids, proc: subprocess.Popen) -> None:
    """A test's cleanup: whatever it started and is still alive."""
    for pid in pids:
        if torchrun.alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()


def _gone_within(pids, seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(torchrun.alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if torchrun.alive(p)]


def test_workers_die_when_torchrun_is_sigkilled(tmp_path):
    ckpt = tmp_path / "ckpt"
    agent = torchrun.start(2, SCRIPT, TINY + ["--tensor-model-parallel-size", "2", "--save", str(ckpt),
                                              "--save-interval", "2"], tmp_path)
    workers = {}
    try:
        torchrun.wait_for(tmp_path / "out.txt", "iteration      3/", agent, 180)
        workers = torchrun.workers(agent)
        assert sorted(workers) == [0, 1], workers
        os.kill(agent.pid, signal.SIGKILL)  # torchrun alone: its workers live in sessions of their own
        agent.wait(timeout=10)
        left = _gone_within(list(workers.values()), DIE_WITHIN_S)
        assert not left, f"workers {left} outlived the SIGKILLed torchrun by {DIE_WITHIN_S} s"
    finally:
        torchrun.cleanup(agent, workers.values())


_CHAIN = textwrap.dedent("""
    import os, subprocess, sys, time
    if sys.argv[1] == "launcher":  # stands in for torchrun: starts a worker in its own session, then waits
        child = subprocess.Popen([sys.executable, __file__, "worker"], env=dict(os.environ, TORCHELASTIC_RUN_ID="t"),
                                 start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
    else:
        sys.path.insert(0, os.environ["ROOT"])
        from parallel3d import lifetime
        lifetime.exit_with_launcher(use_prctl=os.environ["USE_PRCTL"] == "1")
        time.sleep(600)
""")


def _orphan_outcome(tmp_path, use_prctl: bool):
    """Kill a stand-in launcher with SIGKILL; return (worker pids still alive after the limit, worker stderr)."""
    script = tmp_path / "chain.py"
    script.write_text(_CHAIN)
    env = dict(os.environ, ROOT=ROOT, USE_PRCTL="1" if use_prctl else "0")
    env.pop("TORCHELASTIC_RUN_ID", None)
    err = open(tmp_path / "worker_err.txt", "w")
    launcher = subprocess.Popen([sys.executable, str(script), "launcher"], env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    worker = int(launcher.stdout.readline())
    try:
        time.sleep(1.0)  # the worker has armed its guard (no torch import: well under a second)
        launcher.kill()
        launcher.wait()
        return _gone_within([worker], DIE_WITHIN_S), (tmp_path / "worker_err.txt").read_text()
    finally:
        if torchrun.alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_parent_death_signal_and_the_polling_fallback(tmp_path):
    left, _ = _orphan_outcome(tmp_path, use_prctl=True)
    assert not left, "the parent-death signal did not end the worker"
    left, err = _orphan_outcome(tmp_path, use_prctl=False)  # other platforms: the getppid() watcher
    assert not left, "the polling watcher did not end the worker"
    assert "error: rank 0: the launcher (pid " in err and "is gone: exiting" in err, err


def test_no_launcher_no_guard(tmp_path):
    """A plain `python pretrain_gpt.py` under nohup must outlive its shell: nothing is armed without torchrun."""
    from parallel3d import lifetime

    env_had = os.environ.pop(lifetime.LAUNCHER_ENV, None)
    try:
        assert lifetime.exit_with_launcher() is False
    finally:
        if env_had is not None:
            os.environ[lifetime.LAUNCHER_ENV] = env_had


_HARNESS = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, os.environ["ROOT"])
    from parallel3d.testing import run_distributed


    def worker(rank, world_size, out_dir):
        with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)


    if __name__ == "__main__":
        run_distributed(worker, 2, args=(sys.argv[1],), timeout=600)
""")


def test_the_test_harness_workers_die_with_a_killed_test_process(tmp_path):
    """parallel3d/testing.py's workers (children of its forkserver) end when the pytest process is SIGKILLed."""
    script = tmp_path / "harness.py"
    script.write_text(_HARNESS)
    harness = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=dict(os.environ, ROOT=ROOT))
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1) if (tmp_path / f"pid{r}").exists()
                    and (tmp_path / f"pid{r}").read_text()]
        assert len(pids) == 2, "the workers did not start"
        harness.kill()
        harness.wait()
        left = _gone_within(pids, DIE_WITHIN_S)
        assert not left, f"harness workers {left} outlived the killed test process by {DIE_WITHIN_S} s"
    finally:
        _kill(pids, harness)


def test_a_finished_script_exits_with_its_code_and_its_output_flushed():
    """exit_after_run: no interpreter finalization (where gloo's worker threads aborted finished runs now and
    then), the status given, and what was printed, unflushed, still reaches the pipe."""
    code = textwrap.dedent("""
        import sys, threading
        from parallel3d.lifetime import exit_after_run
        print("last line", end="")                  # no newline: still in the buffer
        sys.stderr.write("last error line")
        threading.Thread(target=threading.Event().wait, daemon=False).start()  # would block a normal exit
        exit_after_run(3)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout == "last line" and proc.stderr == "last error line", proc


# a torchrun worker that writes "<its launcher's pid> <its pid>" to argv[1], then sleeps
_SLEEPER = ("import os, sys, time\n"
            "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getppid()} {os.getpid()}')\n"
            "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\ntime.sleep(600)\n")


def test_a_terminated_pytest_takes_its_torchrun_jobs_with_it(tmp_path):
    """SIGTERM to pytest (what ``timeout`` sends) ends the torchrun job a test started through tests/torchrun.py:
    the job runs in its own session, and once outlived a killed pytest, busying the GPUs of the next run."""
    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    pids_file = tmp_path / "pids"
    (tmp_path / "test_job.py").write_text(
        "import torchrun\n\ndef test_job():\n"
        f"    torchrun.run(1, [{str(tmp_path / 'sleeper.py')!r}, {str(pids_file)!r}], timeout=600)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, ROOT]))
    pytest_proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                                    str(tmp_path / "test_job.py")], cwd=tmp_path, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while not pids_file.exists() and time.monotonic() < deadline and pytest_proc.poll() is None:
            time.sleep(0.2)
        assert pids_file.exists(), "the torchrun job did not start"
        pids = [int(p) for p in pids_file.read_text().split()]  # torchrun's agent, its worker
        pytest_proc.send_signal(signal.SIGTERM)
        pytest_proc.wait(timeout=30)
        # the worker too: it sits in a session of its own and arms no guard (a test worker, a peer's script)
        left = _gone_within(pids, DIE_WITHIN_S)
        assert not left, f"torchrun / its worker {left} outlived the SIGTERMed pytest by {DIE_WITHIN_S} s"
    finally:
        _kill(pids, pytest_proc)


def test_a_timed_out_bench_run_leaves_no_worker_behind(tmp_path):
    """bench/launch.py: a run past its timeout ends with every worker, so none shares the GPUs with the next run
    (a 4-GPU bench call once ran at half speed behind the workers of a stopped test)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from launch import bounded

    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    pids_file = tmp_path / "pids"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(tmp_path / "sleeper.py"), str(pids_file)]
    pids = []
    try:
        assert bounded(cmd, 20, env=dict(os.environ, OMP_NUM_THREADS="1")) is None  # the sleeper never ends
        assert pids_file.exists(), "the worker did not start within the timeout"
        pids = [int(p) for p in pids_file.read_text().split()]
        assert not _gone_within(pids, DIE_WITHIN_S), "torchrun or its worker outlived the timed-out run"
    finally:
        for pid in pids:
            if torchrun.alive(pid):
                os.kill(pid, signal.SIGKILL)
