"""Launch a script under torchrun from a test, bounded, and time how long it takes to exit.

``run(nproc, argv, timeout, env)`` starts ``python -m torch.distributed.run`` in a new session, reads
its output line by line with the time each line arrived, and kills the whole session (torchrun and
every worker) at ``timeout``, so a hung job fails the test in bounded time and leaves nothing behind.
The workers import parallel3d from the checkout the tests run from (``checkout_env``), installed or not.
"""
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

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
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and all its workers
        proc.wait()
    exited_at = time.monotonic() - start
    reader.join(timeout=10)
    return Launch(proc.returncode, lines, exited_at)
