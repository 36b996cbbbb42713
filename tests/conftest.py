"""The suite's device rule (README, "Tests"): the tests outside tests/gpu run on the CPU on every
machine, with gloo ranks; their single-process references are then exact, and a machine with GPUs
passes them as CI does. tests/gpu proves the same on CUDA with NCCL, one process per GPU, and starts
its processes with PARALLEL3D_DEVICE=cuda."""
import os
import signal

os.environ["PARALLEL3D_DEVICE"] = "cpu"

import pytest  # noqa: E402

_PYTEST_PID = os.getpid()


def _interrupt(signum, frame):
    """SIGTERM (``timeout``, a batch system) stops pytest like Ctrl-C, so the tests' cleanup runs: a torchrun
    job started in its own session (tests/torchrun.py) would otherwise keep the GPUs busy after pytest died."""
    if os.getpid() != _PYTEST_PID:  # a forked worker inherited this handler: end it as SIGTERM would
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"pytest received signal {signum}")


signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """A test that leaves torch.distributed initialised in the pytest process fails itself, by name,
    instead of failing the unrelated tests after it (its groups are torn down first)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from parallel3d import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left torch.distributed initialised", pytrace=False)


@pytest.fixture
def poisoned():
    """The fused CUDA kernels fill each output they allocate with NaN before writing it (tests/test_fused_*.py;
    only GPU tests, which skip where the extension is missing, use it)."""
    from parallel3d.fused import _ext

    ext = _ext.get_ext()
    ext.set_poison_outputs(True)
    try:
        yield
    finally:
        ext.set_poison_outputs(False)


@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    """family -> (HF dir, model, greedy tokens, their logprobs): the tiny transformers models of
    tests/hf_checkpoints.py, for tests/test_checkpoint_conversion.py and tests/test_checkpoint_generation.py."""
    from hf_checkpoints import hf_references

    return hf_references(tmp_path_factory)


@pytest.fixture(scope="session")
def checkpoints(hf, tmp_path_factory):
    """family -> {layout name: parallel3d dir, "hf": the round-tripped HF dir} (tests/hf_checkpoints.py)."""
    from hf_checkpoints import converted_checkpoints

    return converted_checkpoints(hf, tmp_path_factory)
