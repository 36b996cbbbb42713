"""A project-local virtual environment for the README's two commands, leaving the user's Python alone.

    python3 examples/demo.py                  # calls reexec_in_venv(): re-runs itself inside .venv
    python3 parallel3d/bootstrap.py --extras test --print-python   # .ci/run: prints .venv's python

Standard library only: it runs before anything is installed, from Debian's system Python too
(PEP 668 forbids pip there; a venv is the way it allows). What it does, once per change of
pyproject.toml / setup.py (a stamp file in .venv records it):

1. creates ``<checkout>/.venv`` with ``--system-site-packages``: packages of the Python that ran
   it stay visible, so an installed torch (a CUDA build included) is reused, never replaced,
   never downloaded again. A venv's ``--system-site-packages`` means its *base* interpreter's, so
   when the Python that ran it is itself a virtual or conda environment, a ``.pth`` file in .venv
   adds that environment's site-packages too (:func:`outer_site_packages`);
2. only if no torch is importable there, installs torch 2.13.0 into .venv: where no NVIDIA GPU
   is present (``nvidia-smi``) its CPU build (``2.13.0+cpu`` from pip's configured indexes or
   local wheels if they have it, else from PyTorch's CPU index), else the default (CUDA) build;
3. ``pip install -e <checkout>[extras]`` into .venv, with the torch found there pinned, so pip
   can never swap it.

``PARALLEL3D_NO_VENV=1`` skips all of this and uses the running interpreter as it is (a script
whose dependencies are missing there then stops at once with the one pip command that installs them).

The tools and examples/pretrain_gpt.py, run as scripts, call :func:`reexec_unless_ready`: they run in
the Python that started them when it has parallel3d's dependencies, else inside .venv, like the demo.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_STAMP = "parallel3d-install.stamp"
_OUTER_PTH = "parallel3d-outer-env.pth"
# pyproject.toml's [project] dependencies, as import names (tests/test_packaging.py keeps them equal)
REQUIRED_MODULES = ("torch", "safetensors", "numpy", "tqdm")


def _say(message: str) -> None:
    print(f"parallel3d setup: {message}", file=sys.stderr, flush=True)


def venv_dir(root: str = ROOT) -> str:
    return os.path.join(root, ".venv")


def venv_python(root: str = ROOT) -> str:
    return os.path.join(venv_dir(root), "bin", "python")


def running_in_venv(root: str = ROOT) -> bool:
    return os.path.realpath(sys.prefix) == os.path.realpath(venv_dir(root))


def has_nvidia_gpu() -> bool:
    """Whether an NVIDIA GPU is visible, asked without torch (which may not be installed yet)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def torch_install_commands(pip: list[str], gpu: bool) -> list[list[str]]:
    """The pip commands to try, in order, for a torch that is missing from the venv.

    With no GPU, never the default index: on Linux it resolves torch's multi-GB CUDA build."""
    spec = f"torch=={TORCH_VERSION}"
    if gpu:
        return [pip + ["install", spec]]
    # The "+cpu" build from the indexes / find-links pip is configured with, if one has it (PyPI has
    # none: that fails at once), else from PyTorch's CPU index.
    return [pip + ["install", spec + "+cpu"], pip + ["install", "--index-url", TORCH_CPU_INDEX, spec]]


def stamp_text(extras: Sequence[str], root: str = ROOT, outer: Sequence[str] = ()) -> str:
    """What the install depends on: the checkout's path, its build files, the extras asked for and the
    outer environment's site-packages that .venv sees."""
    h = hashlib.sha256(os.path.realpath(root).encode())
    for name in ("pyproject.toml", "setup.py"):
        with open(os.path.join(root, name), "rb") as f:
            h.update(f.read())
    h.update(",".join(sorted(extras)).encode())
    h.update("\n".join(outer).encode())
    return h.hexdigest()


def outer_site_packages(root: str = ROOT) -> list[str]:
    """The running Python's site-packages when it is a virtual env (``sys.prefix != sys.base_prefix``)
    or a conda env (``CONDA_PREFIX``), other than .venv itself; [] for a system Python, whose packages
    ``--system-site-packages`` already shows."""
    if running_in_venv(root) or (sys.prefix == sys.base_prefix and not os.environ.get("CONDA_PREFIX")):
        return []
    return [d for d in site.getsitepackages() if os.path.isdir(d)]


def link_outer_env(outer: Sequence[str], root: str = ROOT) -> None:
    """Make .venv see ``outer`` (after its own packages, before the base's), or stop seeing a previous one.

    ``site.addsitedir`` rather than bare paths, so the outer environment's own .pth files (editable
    installs, its --system-site-packages) apply as they do there."""
    same_python = f"python{sys.version_info[0]}.{sys.version_info[1]}"  # another version's packages would not load
    for packages in glob.glob(os.path.join(venv_dir(root), "lib", "python*", "site-packages")):
        pth = os.path.join(packages, _OUTER_PTH)
        if outer and os.path.basename(os.path.dirname(packages)) == same_python:
            with open(pth, "w") as f:
                f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in outer))
        elif os.path.exists(pth):
            os.remove(pth)


def _run(cmd: list[str], quiet: bool = False) -> bool:
    _say("running " + " ".join(cmd[2:] if cmd[1:3] == ["-m", "pip"] else cmd))
    return subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None).returncode == 0


def _venv_torch_version(py: str) -> Optional[str]:
    out = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def _create_venv(root: str) -> None:
    _say(f"creating {venv_dir(root)} (--system-site-packages: {sys.executable}'s packages stay visible)")
    proc = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv_dir(root)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(venv_dir(root), ignore_errors=True)
        hint = (" Debian/Ubuntu: sudo apt install python3-venv." if "ensurepip" in proc.stderr + proc.stdout else "")
        raise SystemExit(f"parallel3d setup: cannot create {venv_dir(root)}: {proc.stderr.strip()[-500:]}.{hint} "
                         "Or set PARALLEL3D_NO_VENV=1 to use this Python as it is.")


def ensure_venv(extras: Sequence[str] = (), root: str = ROOT) -> str:
    """Create or reuse ``root/.venv`` holding parallel3d (editable) and its dependencies; return its python."""
    py = venv_python(root)
    if not os.path.exists(py):
        _create_venv(root)
    outer = outer_site_packages(root)
    link_outer_env(outer, root)
    stamp = os.path.join(venv_dir(root), _STAMP)
    want = stamp_text(extras, root, outer)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == want:
                return py
    if outer:
        _say(f"{sys.prefix} is a virtual/conda environment: .venv sees its packages ({', '.join(outer)})")
    pip = [py, "-m", "pip", "--disable-pip-version-check", "-q"]
    version = _venv_torch_version(py)
    if version is None:
        gpu = has_nvidia_gpu()
        _say(f"no torch importable: installing torch {TORCH_VERSION} ({'GPU' if gpu else 'CPU'} build) into .venv")
        if not any(_run(cmd) for cmd in torch_install_commands(pip, gpu)):
            raise SystemExit("parallel3d setup: could not install torch; install it yourself (pytorch.org), "
                             "then re-run")
        version = _venv_torch_version(py)
    else:
        _say(f"using the installed torch {version}")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={version}\n")  # pip may add packages, never swap this torch
    target = root + (f"[{','.join(extras)}]" if extras else "")
    try:
        ok = _run(pip + ["install", "-c", f.name, "-e", target])
    finally:
        os.remove(f.name)
    if not ok:
        raise SystemExit(f"parallel3d setup: pip install -e {target} into {venv_dir(root)} failed (see above)")
    with open(stamp, "w") as f:
        f.write(want)
    return py


def missing_modules() -> list[str]:
    """The dependencies this Python cannot import (looked up, not imported: cheap)."""
    return [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]


def _refuse_missing(missing: Sequence[str], why: str) -> None:
    raise SystemExit(f"parallel3d: {why}, and this Python ({sys.executable}) lacks {', '.join(missing)}; install "
                     f"them with: {sys.executable} -m pip install -e {ROOT}")


def reexec_in_venv(script: str, argv: Sequence[str], extras: Sequence[str] = ()) -> None:
    """Run ``script argv`` inside the project's .venv (set up first); returns only when already there.

    With PARALLEL3D_NO_VENV=1 it returns at once, or stops naming the install command if a dependency
    is missing (rather than every process failing later on its import)."""
    if running_in_venv():
        return
    if os.environ.get("PARALLEL3D_NO_VENV") == "1":
        missing = missing_modules()
        if missing:
            _refuse_missing(missing, "PARALLEL3D_NO_VENV=1 uses the running Python as it is")
        return
    py = ensure_venv(extras)
    os.execv(py, [py, script, *argv])


def reexec_unless_ready(script: str) -> None:
    """For a script of the checkout (tools/*.py, examples/pretrain_gpt.py): return when this Python has
    parallel3d's dependencies, else re-run ``script`` with the same arguments inside .venv.

    Under torchrun (whose workers must not each set up .venv) a missing dependency stops the job with the
    install command, printed by local rank 0 only."""
    missing = missing_modules()
    if not missing or running_in_venv():
        return
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            raise SystemExit(1)
        _refuse_missing(missing, "the launcher started this worker")
    reexec_in_venv(os.path.abspath(script), sys.argv[1:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="create or reuse the project's .venv (see the module's docstring)")
    p.add_argument("--extras", default="", help="comma-separated extras of parallel3d to install, e.g. test")
    p.add_argument("--print-python", action="store_true", help="print the interpreter to use on stdout")
    args = p.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    py = sys.executable if os.environ.get("PARALLEL3D_NO_VENV") == "1" else ensure_venv(extras)
    if args.print_python:
        print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
