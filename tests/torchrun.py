"""Launch a script under torchrun from a test, bounded, and time how long it takes to exit.

``run(nproc, argv, timeout, env)`` starts ``python -m torch.distributed.run`` in a new session, reads
its output line by line with the time each line arrived, and kills torchrun and every worker
(``parallel3d.lifetime.kill_job``) at ``timeout``, so a hung job fails the test in bounded time and
leaves nothing behind.

``start(...)`` launches without waiting (output to ``out.txt``/``err.txt``) for tests that act on a
running job: ``workers`` finds its worker processes by rank, ``wait_for`` a line, ``alive`` a pid,
and ``cleanup`` (in a ``finally``) kills everything started, SIGSTOPped workers included.
The workers import parallel3d from the checkout the tests run from (``checkout_env``), installed or not.
"""
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

from parallel3d.lifetime import children, kill_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Launch:
    returncode: int  # -9 when it was killed at the timeout
    lines: list  # (seconds since start, line)
    exited_at: float  # seconds since start

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def exit_delay(self, marker: str) -> float:
        """Seconds between the last line containing ``marker`` and the end of the job."""
        times = [t for t, line in self.lines if marker in line]
        assert times, f"no output line contains {marker!r}:\n{self.output[-3000:]}"
        return self.exited_at - times[-1]


def checkout_env(env: dict) -> dict:
    """``env`` with this checkout first on PYTHONPATH: a worker script (tests/gpu/parity_worker.py) is not
    started from the checkout's root, so without it a plain checkout's workers cannot import parallel3d."""
    return dict(env, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p]))


def run(nproc: int, argv: list, timeout: float, env: dict | None = None) -> Launch:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + list(argv)
    full_env = checkout_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {})))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:  # past the timeout, or pytest itself interrupted (tests/conftest.py): no job outlives its test
        kill_job(proc)  # torchrun and every worker (each in a session of its own)
    exited_at = time.monotonic() - start
    reader.join(timeout=10)
    return Launch(proc.returncode, lines, exited_at)


def start(nproc: int, script: str, argv: list, tmp_path, extra_env: dict | None = None,
          launcher_args: tuple = ("--standalone",), name: str = "") -> subprocess.Popen:
    """torchrun ``script argv`` in ``tmp_path`` (PARALLEL3D_CACHE there), stdout/stderr to ``{name}out.txt``/``err``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLEL3D_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    env = checkout_env({**env, **(extra_env or {})})
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, f"--nproc-per-node={nproc}", script, *argv]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=open(tmp_path / f"{name}out.txt", "w"),
                            stderr=open(tmp_path / f"{name}err.txt", "w"), start_new_session=True)


def workers(agent: subprocess.Popen) -> dict:
    """{global rank: pid} of the agent's worker processes (its children with RANK in their environment)."""
    found = {}
    for pid in children(agent.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            found[int(env[b"RANK"])] = pid
        except (OSError, KeyError, ValueError):
            continue
    return found


def wait_for(path, text: str, agent: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert agent.poll() is None, f"exited early:\n{path.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not seen in {timeout} s:\n{path.read_text()[-3000:]}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cleanup(agent: subprocess.Popen, pids) -> None:
    for pid in pids:  # a stopped worker ignores everything but SIGKILL until continued
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    kill_job(agent)
