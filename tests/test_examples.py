"""The examples a newcomer runs first keep working."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(nproc: int, script: str, *args: str, timeout: int = 240) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_custom_model_tp_example_matches_dense():
    out = _torchrun(4, "examples/custom_model_tp.py")
    assert "TP=4: matches the dense model" in out, out


def test_demo_command_trains_saves_and_samples(tmp_path):
    """README's first command, shortened: TP2 x PP2 (interleaved) x DP2 on 8 CPU processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLEL3D_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--train-iters", "4",
                           "--lr-warmup-iters", "1", "--log-interval", "2", "--eval-interval", "2",
                           "--sample-tokens", "8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "world 8 = TP 2 x PP 2 (virtual 2) x DP 2" in out
    assert "built the default dataset" in out and "iteration      4/4" in out, out[-3000:]
    assert "saved checkpoint of iteration 4" in out
    assert "sample (greedy" in out
    assert (tmp_path / "demo_checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "4"
