"""Checkpoint save faults: a kill at every step of a save and of a re-save of the same iteration, a full
disk at each file, an unwritable --save. A loadable checkpoint must always remain, and a failure must
name the file, the errno and leave no partial directory. (docs/reliability.md lists them all.)
"""
import errno
import json
import os
import shutil
import sys
import warnings

import pytest
import torch

from parallel3d.training import checkpoint_integrity, checkpoint_metadata, checkpointing
from parallel3d.training.checkpointing import CheckpointError, CheckpointWarning
from parallel3d.training.safetensors_stream import StreamingSafetensorsWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_faults import (  # noqa: E402
    enospc,
    load_fresh,
    same_weights,
    save_tiny,
    tiny_model,
    weights_of,
)


@pytest.fixture
def saved(tmp_path):
    return save_tiny(tmp_path)


# ---------------------------------------------------------------- 10: a kill at any step leaves a loadable checkpoint


class Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so no handler in the save path may swallow it."""


# Everything a save does to the filesystem, in order; a kill can fall before any of these calls.
_STEPS = [(os, "replace"), (os, "makedirs"), (os, "remove"), (os, "fsync"), (shutil, "rmtree"),
          (torch, "save"), (json, "dump"), (StreamingSafetensorsWriter, "write"), (StreamingSafetensorsWriter, "close")]


def _kill_at(monkeypatch, k):
    """Patch every step to count calls and raise Killed at call ``k`` (0: never); returns the counter."""
    calls = [0]
    for owner, name in _STEPS:
        real = getattr(owner, name)

        def step(*args, _real=real, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                raise Killed(f"killed at step {k}")
            return _real(*args, **kwargs)
        monkeypatch.setattr(owner, name, step)
    return calls


@pytest.mark.parametrize("iteration", [4, 2], ids=["new_iteration", "resave_same_iteration"])
def test_a_save_killed_at_any_step_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, iteration):
    base = str(tmp_path / "base")
    old_model, old_opt = tiny_model(seed=0)
    checkpointing.save_checkpoint(base, 2, old_model, old_opt)
    old = weights_of(old_model)
    new_model, new_opt = tiny_model(seed=5)
    new = weights_of(new_model)

    shutil.copytree(base, str(tmp_path / "count"))
    with monkeypatch.context() as m:  # count the steps of an uninterrupted save
        calls = _kill_at(m, 0)
        checkpointing.save_checkpoint(str(tmp_path / "count"), iteration, new_model, new_opt)
    steps = calls[0]
    assert steps > 15
    outcomes = set()
    for k in range(1, steps + 1):
        save_dir = str(tmp_path / f"k{k}")
        shutil.copytree(base, save_dir)
        with monkeypatch.context() as m:
            _kill_at(m, k)
            try:
                checkpointing.save_checkpoint(save_dir, iteration, new_model, new_opt)
                finished = True
            except Killed:
                finished = False
        loaded, opt = tiny_model(seed=9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, _ = checkpointing.load_checkpoint(save_dir, loaded, opt)
        state = "new" if same_weights(loaded, new) else "old" if same_weights(loaded, old) else "neither"
        assert state != "neither", f"kill at step {k}: the loaded weights are neither the old nor the new save"
        assert got == (iteration if state == "new" else 2) or iteration == 2, (k, got, state)
        if finished:
            assert state == "new"
        outcomes.add((state, bool(caught)))
        # the next save over the debris succeeds and leaves none
        checkpointing.save_checkpoint(save_dir, iteration, new_model, new_opt)
        assert sorted(n for n in os.listdir(save_dir) if n != checkpointing.LATEST_FILE) == sorted(
            {"iter_0000002", checkpointing.iteration_dir("", iteration)}), (k, os.listdir(save_dir))
        assert not checkpointing.verify_checkpoint(save_dir)[1]
    assert ("old", False) in outcomes and ("new", False) in outcomes
    if iteration == 2:  # killed between the two renames: the .old copy, with a warning
        assert ("old", True) in outcomes


def test_the_old_copy_of_a_half_swapped_resave_is_loaded_with_a_warning(saved):
    save_dir, _, _, weights = saved
    final = checkpointing.iteration_dir(save_dir, 2)
    os.replace(final, final + ".old")
    shutil.copytree(final + ".old", final + ".tmp")
    model, opt = tiny_model(seed=1)
    with pytest.warns(CheckpointWarning, match=r"iter_0000002 is missing \(a re-save was interrupted\): loading "
                                               r"its previous copy .*iter_0000002.old"):
        assert checkpointing.load_checkpoint(save_dir, model, opt)[0] == 2
    assert same_weights(model, weights)


# ---------------------------------------------------------------- 11: disk full


def enospc_on(suffix, real=checkpointing.write_json):
    """``real`` (a writer taking a path first) failing only for files ending in ``suffix``."""

    def write(path, *args):
        if path.endswith(suffix):
            enospc()
        return real(path, *args)
    return write


@pytest.mark.parametrize("target,replacement,name", [
    ((StreamingSafetensorsWriter, "write"), enospc, "model.safetensors"),
    ((checkpoint_integrity.HashingFile, "write"), enospc, "optimizer.pt"),
    ((checkpointing, "write_json"), enospc_on("rank_00000.json"), "checksums/rank_00000.json"),
    ((checkpoint_metadata, "_fsync_write"), enospc_on("metadata.json", checkpoint_metadata._fsync_write),
     "iter_0000004.tmp/metadata.json"),
    ((checkpoint_metadata, "_fsync_write"), enospc_on(".sha256", checkpoint_metadata._fsync_write),
     "iter_0000004.tmp/metadata.json.sha256"),
    ((checkpointing, "_atomic_write_text"), enospc, "latest_checkpointed_iteration.txt"),
], ids=["model", "optimizer", "checksum_record", "metadata", "metadata_checksum", "tracker"])
def test_disk_full_names_enospc_and_the_file_and_removes_the_partial_save(saved, monkeypatch, target, replacement,
                                                                          name):
    save_dir, model, opt, weights = saved
    monkeypatch.setattr(*target, replacement)
    with pytest.raises(CheckpointError, match=rf"cannot write checkpoint file .*{name}: ENOSPC \(No space left "
                                              rf"on device\); \d+ bytes free"):
        checkpointing.save_checkpoint(save_dir, 4, model, opt)
    monkeypatch.undo()
    assert not os.path.exists(checkpointing.iteration_dir(save_dir, 4) + ".tmp")
    assert checkpointing.read_latest_iteration(save_dir) == 2
    assert load_fresh(save_dir)[0] == 2
    checkpointing.save_checkpoint(save_dir, 4, model, opt)  # room again: the save goes through
    assert load_fresh(save_dir)[0] == 4
    assert sorted(os.listdir(save_dir)) == ["iter_0000002", "iter_0000004", checkpointing.LATEST_FILE]


def test_torch_save_iostream_error_without_errno_is_named(saved, monkeypatch):
    save_dir, model, opt, _ = saved

    def iostream_error(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")
    monkeypatch.setattr(torch, "save", iostream_error)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint file .*optimizer.pt: RuntimeError: "
                                              r"basic_ios::clear: iostream error; \d+ bytes free"):
        checkpointing.save_checkpoint(save_dir, 4, model, opt)
    assert not os.path.exists(checkpointing.iteration_dir(save_dir, 4) + ".tmp")


# ---------------------------------------------------------------- 12: an unwritable --save fails up front


def test_unwritable_save_dir_is_refused_up_front(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"--save directory '.*a_file/sub' is not writable \(Not a directory\)"):
        checkpointing.check_save_dir_writable(str(blocker / "sub"))
    fresh = tmp_path / "new" / "dir"
    checkpointing.check_save_dir_writable(str(fresh))  # created, probe removed
    assert fresh.is_dir() and os.listdir(fresh) == []

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(checkpoint_integrity.tempfile, "mkstemp", read_only)
    with pytest.raises(CheckpointError, match=r"is not writable \(Permission denied\): choose a directory"):
        checkpointing.check_save_dir_writable(str(fresh))
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint_integrity.os, "fsync", enospc)
    with pytest.raises(CheckpointError, match=r"is not writable \(No space left on device\)"):
        checkpointing.check_save_dir_writable(str(fresh))
    monkeypatch.undo()
    assert os.listdir(fresh) == []  # the probe is removed even when its write failed


def test_pretrain_checks_the_save_dir_before_building_anything(tmp_path):
    from parallel3d.training import gpt

    from parallel3d.training.arguments import parse_args, validate_args
    from parallel3d.training import pretrain

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    args = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                                     "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2",
                                     "--lr", "1e-3", "--vocab-size", "16", "--save", str(blocker / "ckpt")],
                                    extra_args_provider=gpt.add_sampling_args), 1)

    def never(*args, **kwargs):
        raise AssertionError("pretrain built the model before checking --save")
    with pytest.raises(CheckpointError, match=r"--save directory .*a_file/ckpt' is not writable"):
        pretrain(args, never, never, never)
