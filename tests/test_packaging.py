"""Packaging (issue 14, items 1-5 and 20): license, metadata, the parallel3d.models / parallel3d.tools
namespace, console scripts, the project-local venv of the README's commands, and the CUDA compile check."""
import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from parallel3d import bootstrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    PYPROJECT = tomllib.load(_f)
# import name -> distribution name, where they differ
_DIST = {"yaml": "pyyaml"}


def _python_files(*folders):
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(dirpath, f) for f in files if f.endswith(".py"))


def _top_level_imports(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_license_file_and_metadata():
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "LICENSE" in PYPROJECT["project"]["license-files"]
    assert "Apache-2.0" in open(os.path.join(ROOT, "README.md")).read()


def test_dependencies_are_the_imported_ones():
    """Every third-party import of the installed code is a dependency or an extra, and each dependency is used."""
    project = PYPROJECT["project"]
    deps = {d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]}
    extras = {re.split(r"[<>=!~ ]", d)[0] for group in project["optional-dependencies"].values() for d in group}
    own = {"parallel3d"} | set(sys.stdlib_module_names)
    imported = {_DIST.get(m, m) for f in _python_files("parallel3d", "models", "tools") for m in _top_level_imports(f)}
    third_party = imported - own
    assert third_party <= deps | extras, third_party - deps - extras
    assert deps <= imported, deps - imported  # einops was declared and imported nowhere
    assert {"hf", "plot", "tensorboard", "wandb", "test"} <= set(project["optional-dependencies"])
    assert "tokenizers" in project["optional-dependencies"]["hf"]


def test_every_package_is_listed_and_models_tools_live_under_parallel3d():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert mapping == {"parallel3d.models": "models", "parallel3d.tools": "tools", "parallel3d.csrc": "csrc"}
    found = set()
    for top, name in (("parallel3d", "parallel3d"), ("models", "parallel3d.models"), ("tools", "parallel3d.tools")):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, top))
                found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert found | {"parallel3d.csrc"} == listed  # csrc: the CUDA sources as package data, no Python
    assert not any(p == "models" or p.startswith("models.") for p in listed)


def test_nothing_imports_the_bare_models_or_tools_name():
    for path in _python_files("parallel3d", "models", "tools", "examples", "bench", "tests"):
        bare = {m for m in _top_level_imports(path) if m in ("models", "tools")}
        assert not bare, f"{path} imports {bare}: use parallel3d.models / parallel3d.tools"


def test_console_scripts_resolve():
    scripts = PYPROJECT["project"]["scripts"]
    assert {"parallel3d-preprocess-data", "parallel3d-convert-checkpoint", "parallel3d-generate",
            "parallel3d-verify-checkpoint", "parallel3d-plot-log", "parallel3d-plan"} <= set(scripts)
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


@pytest.mark.parametrize("script", ["tools/verify_checkpoint.py", "tools/convert_checkpoint.py",
                                    "tools/preprocess_data.py", "examples/pretrain_gpt.py"])
def test_checkout_scripts_run_without_install(script, tmp_path):
    """python3 tools/x.py from a checkout finds parallel3d.models / parallel3d.tools in the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_checkout_shim_lets_only_models_and_tools_through():
    import importlib.util

    import parallel3d
    import parallel3d.models
    import parallel3d.tools

    assert parallel3d.__path__ == [os.path.join(ROOT, "parallel3d")]
    assert os.path.dirname(parallel3d.models.__file__) == os.path.join(ROOT, "models")
    assert os.path.dirname(parallel3d.tools.__file__) == os.path.join(ROOT, "tools")
    for name in ("setup", "bench", "tests", "csrc", "examples"):  # the rest of the checkout stays out
        assert importlib.util.find_spec(f"parallel3d.{name}") is None, name


def test_wheel_holds_models_and_tools_inside_parallel3d(tmp_path):
    """A non-editable build: parallel3d/models and parallel3d/tools in the wheel, no top-level models."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    for f in files:
        if os.path.exists(os.path.join(ROOT, f)):
            os.makedirs(src / os.path.dirname(f), exist_ok=True)
            shutil.copy(os.path.join(ROOT, f), src / f)
    env = dict(os.environ, PARALLEL3D_NO_CUDA_EXT="1")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 and "setuptools>=77" in proc.stderr:
        pytest.skip("setuptools too old here to build")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import zipfile

    (wheel,) = (tmp_path / "dist").iterdir()
    names = zipfile.ZipFile(wheel).namelist()
    assert "parallel3d/models/gpt.py" in names and "parallel3d/tools/checkpoint/hf.py" in names
    sources = sorted(f for f in os.listdir(os.path.join(ROOT, "csrc")) if f.endswith((".cu", ".cpp", ".h", ".cuh")))
    assert [n for n in names if n.startswith("parallel3d/csrc/")] == [f"parallel3d/csrc/{f}" for f in sources]
    assert not any(n.startswith(("models/", "tools/")) for n in names)
    assert any(n.endswith("licenses/LICENSE") for n in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "parallel3d-convert-checkpoint" in entry_points
    # Installed (unpacked where no checkout is near), the JIT build finds the sources in the package.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    found = subprocess.run([sys.executable, "-c", "from parallel3d.fused import _ext; print(_ext._CSRC)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0 and found.stdout.strip() == str(site / "parallel3d" / "csrc"), found.stderr[-2000:]


# ----------------------------------------------------------------------------- the project-local venv


def test_torch_install_never_takes_the_default_cuda_build_without_a_gpu():
    pip = ["py", "-m", "pip"]
    for cmd in bootstrap.torch_install_commands(pip, gpu=False):
        spec = cmd[-1]
        assert spec.endswith("+cpu") or bootstrap.TORCH_CPU_INDEX in cmd, cmd
    assert bootstrap.torch_install_commands(pip, gpu=True) == [pip + ["install", f"torch=={bootstrap.TORCH_VERSION}"]]


def _fake_checkout(tmp_path):
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    py = tmp_path / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    return str(tmp_path)


def test_venv_keeps_an_installed_torch_and_pins_it(tmp_path, monkeypatch):
    root = _fake_checkout(tmp_path)
    ran = []
    monkeypatch.setattr(bootstrap, "_venv_torch_version", lambda py: "2.5.1+cu124")
    monkeypatch.setattr(bootstrap, "_run", lambda cmd, quiet=False: ran.append(
        (cmd, open(cmd[cmd.index("-c") + 1]).read())) or True)
    py = bootstrap.ensure_venv(["test"], root)
    assert py == os.path.join(root, ".venv", "bin", "python")
    ((cmd, constraint),) = ran  # one pip call: the package; torch is not installed
    assert cmd[-2:] == ["-e", root + "[test]"] and constraint == "torch==2.5.1+cu124\n"
    ran.clear()
    bootstrap.ensure_venv(["test"], root)  # the stamp matches: no pip at all
    assert ran == []


def test_venv_installs_cpu_torch_only_when_missing(tmp_path, monkeypatch):
    root = _fake_checkout(tmp_path)
    versions = iter([None, "2.13.0+cpu"])
    ran = []
    monkeypatch.setattr(bootstrap, "_venv_torch_version", lambda py: next(versions))
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(bootstrap, "_run", lambda cmd, quiet=False: ran.append(cmd) or True)
    bootstrap.ensure_venv([], root)
    assert ran[0][-1] == f"torch=={bootstrap.TORCH_VERSION}+cpu" and ran[1][-2:] == ["-e", root]


def test_bootstrap_cli_respects_no_venv(tmp_path):
    env = dict(os.environ, PARALLEL3D_NO_VENV="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "parallel3d", "bootstrap.py"), "--print-python"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == sys.executable


# ----------------------------------------------------------------------------- item 20: CUDA compile check


def _compile_check(tmp_path, sources, python=sys.executable):
    (tmp_path / ".ci").mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, ".ci", "compile_cuda.sh"), tmp_path / ".ci" / "compile_cuda.sh")
    csrc = tmp_path / "csrc"
    shutil.rmtree(csrc, ignore_errors=True)
    csrc.mkdir()
    for name, text in sources.items():
        (csrc / name).write_text(text)
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"  # a CUDA "toolkit" without the cuBLAS headers
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text('#!/bin/sh\ncase "$2" in *bad*) echo "$2(3): error: expected a \';\'"; exit 1;; esac\n'
                    'touch "$4"\n')
    nvcc.chmod(0o755)
    env = dict(os.environ, PATH=f"{nvcc.parent}:{os.environ['PATH']}", PYTHON=python, COMPILE_JOBS="2")
    return subprocess.run(["bash", str(tmp_path / ".ci" / "compile_cuda.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def test_compile_check_fails_on_a_compile_error_and_names_skips(tmp_path):
    cublas = '#include <ATen/cuda/CUDAContext.h>\n'
    proc = _compile_check(tmp_path, {"good.cu": "", "bad.cu": "", "grad_accum.cu": cublas})
    assert proc.returncode == 1, proc.stdout
    assert "ERROR csrc/bad.cu" in proc.stdout and "ok    csrc/good.cu" in proc.stdout
    assert "SKIPPED csrc/grad_accum.cu" in proc.stdout and "FAILED" in proc.stdout
    proc = _compile_check(tmp_path, {"good.cu": "", "grad_accum.cu": cublas})
    assert proc.returncode == 0, proc.stdout
    assert "1 files compiled" in proc.stdout and "1 SKIPPED (csrc/grad_accum.cu)" in proc.stdout


def test_compile_check_is_an_error_when_nvcc_exists_but_torch_does_not(tmp_path):
    fake = tmp_path / "python-without-torch"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    proc = _compile_check(tmp_path, {"good.cu": ""}, python=str(fake))
    assert proc.returncode == 1 and "cannot import torch" in proc.stdout


_ENSURE = """import json, sys
sys.path.insert(0, sys.argv[1])
from parallel3d import bootstrap
ran = []
bootstrap._run = lambda cmd, quiet=False: ran.append(cmd) or True  # pip: recorded, not run
bootstrap.ensure_venv([], sys.argv[2])
print(json.dumps(ran))
"""


def _ensure_from(python, root, env=None):
    out = subprocess.run([python, "-c", _ENSURE, ROOT, root], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **(env or {})))
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout)


def _checkout(tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(os.path.join(ROOT, name), root / name)
    return str(root)


def test_venv_from_a_virtual_env_reuses_its_torch(tmp_path):
    """Issue 30 item 1: from a venv with torch, .venv saw only the base interpreter and installed a second torch."""
    outer = tmp_path / "myenv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True, timeout=120)
    (packages,) = (outer / "lib").glob("python*/site-packages")
    (packages / "torch").mkdir()
    (packages / "torch" / "__init__.py").write_text("__version__ = '9.9.9+outer'\n")
    root = _checkout(tmp_path)
    ran = _ensure_from(str(outer / "bin" / "python"), root, {"CONDA_PREFIX": ""})
    assert len(ran) == 1 and ran[0][-2:] == ["-e", root], ran  # only parallel3d, no torch install
    seen = subprocess.run([bootstrap.venv_python(root), "-c", "import torch; print(torch.__version__, torch.__file__)"],
                          capture_output=True, text=True, timeout=60).stdout.split()
    assert seen == ["9.9.9+outer", str(packages / "torch" / "__init__.py")]
    # the same .venv run from the base Python again: the outer env is no longer linked
    base = os.path.join(sys.base_prefix, "bin", "python3")
    _ensure_from(base, root, {"CONDA_PREFIX": ""})
    assert not list(tmp_path.glob("checkout/.venv/lib/python*/site-packages/" + bootstrap._OUTER_PTH))


def test_venv_from_a_system_python_links_nothing_more(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    monkeypatch.setenv("CONDA_PREFIX", "")
    assert bootstrap.outer_site_packages(str(tmp_path)) == []  # --system-site-packages already shows them
    monkeypatch.setenv("CONDA_PREFIX", sys.base_prefix)  # a conda env's python is its own base
    import site
    assert bootstrap.outer_site_packages(str(tmp_path)) == [d for d in site.getsitepackages() if os.path.isdir(d)]


def test_torchrun_workers_of_the_tests_import_this_checkout(tmp_path):
    """Issue 30 item 13: tests/gpu's workers died with `No module named 'parallel3d'` in a checkout not installed."""
    import torchrun

    script = tmp_path / "worker.py"  # outside the checkout, as tests/gpu/parity_worker.py is outside its root
    script.write_text("import parallel3d\nprint('imported', parallel3d.__file__)\n")
    result = torchrun.run(1, [str(script)], timeout=120, env={"PYTHONPATH": ""})
    assert result.returncode == 0, result.output[-3000:]
    assert f"imported {os.path.join(ROOT, 'parallel3d', '__init__.py')}" in result.output


SCRIPTS = ["tools/preprocess_data.py", "tools/convert_checkpoint.py", "tools/generate.py", "tools/plan.py",
           "tools/verify_checkpoint.py", "examples/pretrain_gpt.py", "examples/custom_model_tp.py"]


def _bare_python(script, argv, env=None, cwd=None):
    """``script`` run by this interpreter without its site-packages (-S): a Python without torch & co."""
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    return subprocess.run([sys.executable, "-S", script, *argv], capture_output=True, text=True, timeout=60,
                          env=dict(full, **(env or {})), cwd=cwd)


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_rerun_inside_the_venv_from_a_python_without_torch(tmp_path, script):
    """Issue 30 item 3: `python3 tools/x.py` ended in `No module named 'torch'` where the demo re-runs in .venv."""
    root = _checkout(tmp_path)
    for name in ("parallel3d/__init__.py", "parallel3d/bootstrap.py", script):
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), os.path.join(root, name))
    py = bootstrap.venv_python(root)  # a set-up .venv whose python shows how it was called
    os.makedirs(os.path.dirname(py))
    with open(py, "w") as f:
        f.write('#!/bin/sh\necho "in .venv: $@"\n')
    os.chmod(py, 0o755)
    with open(os.path.join(bootstrap.venv_dir(root), bootstrap._STAMP), "w") as f:
        f.write(bootstrap.stamp_text([], root))
    out = _bare_python(os.path.join(root, script), ["--help", "x y"], {"CONDA_PREFIX": ""})
    assert out.returncode == 0 and out.stdout == f"in .venv: {os.path.join(root, script)} --help x y\n", out.stderr
    # under torchrun no worker sets up .venv: local rank 0 names the install command, the others just stop
    for rank, said in (("0", "lacks torch, safetensors, numpy, tqdm; install them with: "), ("1", "")):
        out = _bare_python(os.path.join(root, script), [], {"LOCAL_RANK": rank})
        assert out.returncode == 1 and said in out.stderr and (said or not out.stderr), out.stderr


def test_no_venv_without_the_dependencies_names_the_install_command():
    """Issue 30 item 11: PARALLEL3D_NO_VENV=1 failed after 24 s on every rank with `No module named 'safetensors'`."""
    out = _bare_python(os.path.join(ROOT, "examples", "demo.py"), ["--train-iters", "2"],
                       {"PARALLEL3D_NO_VENV": "1"})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"parallel3d: PARALLEL3D_NO_VENV=1 uses the running Python as it is, and this Python "
                          f"({sys.executable}) lacks torch, safetensors, numpy, tqdm; install them with: "
                          f"{sys.executable} -m pip install -e {ROOT}\n")


def test_required_modules_are_the_projects_dependencies():
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in PYPROJECT["project"]["dependencies"]]
    assert list(bootstrap.REQUIRED_MODULES) == names
