"""Checkpoint faults: planted pickles, corrupted / truncated / swapped files, kills at every step of a
save, a full disk and an unwritable --save. Each must be refused or survived with a message naming
the file; none may load silently. (docs/reliability.md lists them all.)

A two-parameter module and SGD with momentum keep saves to milliseconds; one gloo run of two
processes covers what needs real TP ranks (swapped shards, one rank's disk filling up).
"""
import errno
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from parallel3d import checkpoint_integrity, checkpointing
from parallel3d import parallel_state as ps
from parallel3d.checkpointing import CheckpointError, CheckpointWarning
from parallel3d.safetensors_stream import StreamingSafetensorsWriter
from parallel3d.testing import run_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blocks import ParallelBlock  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = "mp_rank_00_000"


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def _model(seed=0):
    torch.manual_seed(seed)
    model = [Tiny()]
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    model[0].fc(torch.ones(2, 4)).sum().backward()
    opt.step()  # momentum buffers: optimizer.pt holds real state
    return model, opt


def _weights(model):
    return {k: v.clone() for k, v in model[0].state_dict().items()}


def _same(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model[0].state_dict().items())


@pytest.fixture
def saved(tmp_path):
    """(save dir, model, optimizer, weights) with iteration 2 saved."""
    model, opt = _model()
    save_dir = str(tmp_path / "ckpt")
    checkpointing.save_checkpoint(save_dir, 2, model, opt, extra={"consumed_train_samples": 32})
    return save_dir, model, opt, _weights(model)


def _file(save_dir, rel, iteration=2):
    return os.path.join(checkpointing.iteration_dir(save_dir, iteration), rel)


def _flip_byte(path, offset=-20):
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        f.seek(offset % size)
        b = f.read(1)
        f.seek(offset % size)
        f.write(bytes([b[0] ^ 0xFF]))


def _edit_metadata(save_dir, change, iteration=2):
    path = _file(save_dir, checkpointing.METADATA_FILE, iteration)
    meta = json.load(open(path))
    change(meta)
    json.dump(meta, open(path, "w"))


def _rerecord(save_dir, rel):
    """An attacker who also rewrites metadata.json: the planted file's checksum matches."""
    path = _file(save_dir, rel)

    def change(meta):
        meta["files"][rel].update(sha256=checkpoint_integrity.sha256_file(path), bytes=os.path.getsize(path))
    _edit_metadata(save_dir, change)


def _drop_checksums(save_dir, iteration=2):
    """What a checkpoint saved before checksums were kept looks like."""
    _edit_metadata(save_dir, lambda meta: meta.pop("files"), iteration)


def _load(save_dir, model=None, opt=None, **kw):
    if model is None:
        model, opt = _model(seed=1)
    return checkpointing.load_checkpoint(save_dir, model, opt, **kw)


# ---------------------------------------------------------------- 1: loading runs no code


class Payload:
    """Unpickling this creates a directory: the observable trace of code run by torch.load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_genuine_files_load_with_weights_only(saved):
    save_dir, model, opt, weights = saved
    for rel in (f"{RANK}/optimizer.pt", "rng/rank_00000.pt"):
        torch.load(_file(save_dir, rel), weights_only=True)
    other, other_opt = _model(seed=1)
    iteration, meta = checkpointing.load_checkpoint(save_dir, other, other_opt)
    assert iteration == 2 and meta["extra"]["consumed_train_samples"] == 32
    assert _same(other, weights)
    assert torch.equal(other_opt.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("rel", [f"{RANK}/optimizer.pt", "rng/rank_00000.pt"])
@pytest.mark.parametrize("metadata", ["rerecorded", "no_checksums", "stale_checksum"])
def test_planted_pickle_payload_is_refused_not_run(saved, tmp_path, rel, metadata):
    save_dir = saved[0]
    marker = str(tmp_path / "payload_ran")
    torch.save({"optimizer": Payload(marker), "cpu": Payload(marker)}, _file(save_dir, rel))
    if metadata == "rerecorded":
        _rerecord(save_dir, rel)
        message = r"refused to load .*" + rel + r": it holds objects other than tensors.*could run code"
    elif metadata == "no_checksums":
        _drop_checksums(save_dir)
        message = r"refused to load .*" + rel
    else:
        message = rel + " (is .* bytes but was saved as|fails its checksum)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match=message):
            _load(save_dir)
    assert not os.path.exists(marker)
    # the verify tool refuses it too, without running it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        _, problems = checkpointing.verify_checkpoint(save_dir)
    assert any(rel in p for p in problems) or metadata == "rerecorded", problems
    assert not os.path.exists(marker)


# ---------------------------------------------------------------- 3: corruption never loads silently


@pytest.mark.parametrize("rel,offset", [
    (f"{RANK}/model.safetensors", -3),     # a weight's bytes
    (f"{RANK}/model.safetensors", 12),     # the safetensors header
    (f"{RANK}/optimizer.pt", -200),
    ("rng/rank_00000.pt", -200),
], ids=["model_data", "model_header", "optimizer", "rng"])
def test_flipped_bytes_are_refused_naming_the_file(saved, rel, offset):
    save_dir = saved[0]
    _flip_byte(_file(save_dir, rel), offset)
    with pytest.raises(CheckpointError, match=f"{rel} fails its checksum .*its bytes changed since it was saved"):
        _load(save_dir)


@pytest.mark.parametrize("rel", [f"{RANK}/model.safetensors", f"{RANK}/optimizer.pt", "rng/rank_00000.pt"])
def test_truncated_files_are_refused_naming_the_file(saved, rel):
    save_dir = saved[0]
    path = _file(save_dir, rel)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=f"{rel} is .* bytes but was saved as .* bytes: truncated"):
        _load(save_dir)


def test_a_file_missing_from_the_file_list_is_refused(saved):
    save_dir = saved[0]
    _edit_metadata(save_dir, lambda meta: meta["files"].pop(f"{RANK}/optimizer.pt"))
    with pytest.raises(CheckpointError, match=r"optimizer.pt is not in the file list of .*metadata.json"):
        _load(save_dir)


def test_metadata_records_every_file_with_its_ranks(saved):
    save_dir = saved[0]
    meta = checkpointing.read_metadata(checkpointing.iteration_dir(save_dir, 2))
    assert sorted(meta["files"]) == [f"{RANK}/model.safetensors", f"{RANK}/optimizer.pt", "rng/rank_00000.pt"]
    for rel, record in meta["files"].items():
        assert record["sha256"] == checkpoint_integrity.sha256_file(_file(save_dir, rel))  # hashed as written
        assert record["bytes"] == os.path.getsize(_file(save_dir, rel))
        assert (record["tp_rank"], record["pp_rank"], record["dp_rank"], record["rank"]) == (0, 0, 0, 0)
    assert not os.path.exists(_file(save_dir, "checksums"))  # per-rank records are folded into metadata.json


def test_a_record_of_another_rank_is_refused(saved):
    save_dir = saved[0]
    _edit_metadata(save_dir, lambda meta: meta["files"][f"{RANK}/model.safetensors"].update(tp_rank=1))
    with pytest.raises(CheckpointError, match=r"model.safetensors is recorded as written by tp_rank=1, but this "
                                              r"process \(tp_rank=0\)"):
        _load(save_dir)


def test_old_checkpoint_without_checksums_loads_with_one_warning(saved):
    save_dir, _, _, weights = saved
    _drop_checksums(save_dir)
    model, opt = _model(seed=1)
    with pytest.warns(CheckpointWarning, match="records no checksums .*load unverified") as caught:
        checkpointing.load_checkpoint(save_dir, model, opt)
    assert _same(model, weights)
    assert len({str(w.message) for w in caught}) == 1 and "\n" not in str(caught[0].message)


# ---------------------------------------------------------------- 4: every load error names the file


@pytest.mark.parametrize("content,message", [
    (b"\x89\xfe\x00\xffgarbage\x80", r"latest_checkpointed_iteration.txt is corrupt: expected an iteration number"),
    (b"", r"latest_checkpointed_iteration.txt is corrupt"),
    (b"-3", r"latest_checkpointed_iteration.txt is corrupt"),
    (b"\xd9\xa3", r"latest_checkpointed_iteration.txt is corrupt"),  # not ASCII (a digit in another script)
    (b"7", r"iter_0000007 is missing although .*latest_checkpointed_iteration.txt names iteration 7"),
], ids=["binary_garbage", "empty", "negative", "non_ascii", "missing_iteration"])
def test_a_bad_tracker_file_is_named(saved, content, message):
    save_dir = saved[0]
    with open(os.path.join(save_dir, checkpointing.LATEST_FILE), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=message):
        _load(save_dir)


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe\x00binary", r"metadata.json is corrupt"),
    (b'{"format_version": 1, "layout"', r"metadata.json is corrupt"),
    (b"[1, 2]", r"metadata.json: format version None is not 1"),
    (b'{"format_version": 1, "layout": 3}', r"metadata.json is corrupt: its layout or file list"),
], ids=["binary_garbage", "truncated", "not_an_object", "layout_not_an_object"])
def test_a_bad_metadata_file_is_named(saved, content, message):
    save_dir = saved[0]
    with open(_file(save_dir, checkpointing.METADATA_FILE), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=message):
        _load(save_dir)


def test_damage_in_a_checkpoint_without_checksums_is_named(saved):
    """Without checksums the readers themselves must say which file is bad and why."""
    save_dir = saved[0]
    _drop_checksums(save_dir)
    opt_path, rng_path = _file(save_dir, f"{RANK}/optimizer.pt"), _file(save_dir, "rng/rank_00000.pt")
    good_opt, good_rng = open(opt_path, "rb").read(), open(rng_path, "rb").read()
    warnings.simplefilter("ignore", CheckpointWarning)
    with open(opt_path, "wb") as f:
        f.write(good_opt[: len(good_opt) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*optimizer.pt: PytorchStreamReader failed .*central "
                                              r"directory.*\(truncated or corrupt file\)"):
        _load(save_dir)
    torch.save({"optimizer": {"state": {}, "param_groups": []}, "opt_param_scheduler": None}, opt_path)
    with pytest.raises(CheckpointError, match=r"optimizer.pt does not fit this optimizer or LR scheduler"):
        _load(save_dir)
    with open(opt_path, "wb") as f:
        f.write(good_opt)
    state = torch.get_rng_state()
    torch.save({"cpu": torch.zeros_like(state), "cuda": None, "tracker": {}}, rng_path)
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt holds no valid RNG state: .*Invalid mt19937 state"):
        _load(save_dir)
    torch.save({"cuda": None}, rng_path)
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt holds no valid RNG state: KeyError"):
        _load(save_dir)
    with open(rng_path, "wb") as f:
        f.write(good_rng)
    model_path = _file(save_dir, f"{RANK}/model.safetensors")
    with open(model_path, "r+b") as f:
        f.write(b"\xff" * 8)  # header length: absurd
    with pytest.raises(CheckpointError, match=r"cannot read .*model.safetensors"):
        _load(save_dir)


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
    old_model, old_opt = _model(seed=0)
    checkpointing.save_checkpoint(base, 2, old_model, old_opt)
    old = _weights(old_model)
    new_model, new_opt = _model(seed=5)
    new = _weights(new_model)

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
        loaded, opt = _model(seed=9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, _ = checkpointing.load_checkpoint(save_dir, loaded, opt)
        state = "new" if _same(loaded, new) else "old" if _same(loaded, old) else "neither"
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
    model, opt = _model(seed=1)
    with pytest.warns(CheckpointWarning, match=r"iter_0000002 is missing \(a re-save was interrupted\): loading "
                                               r"its previous copy .*iter_0000002.old"):
        assert checkpointing.load_checkpoint(save_dir, model, opt)[0] == 2
    assert _same(model, weights)


# ---------------------------------------------------------------- 11: disk full


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _enospc_on(suffix):
    """write_json failing only for files ending in ``suffix``."""
    real = checkpointing.write_json

    def write_json(path, obj):
        if path.endswith(suffix):
            _enospc()
        return real(path, obj)
    return write_json


@pytest.mark.parametrize("target,replacement,name", [
    ((StreamingSafetensorsWriter, "write"), _enospc, "model.safetensors"),
    ((checkpoint_integrity.HashingFile, "write"), _enospc, "optimizer.pt"),
    ((checkpointing, "write_json"), _enospc_on("rank_00000.json"), "checksums/rank_00000.json"),
    ((checkpointing, "write_json"), _enospc_on("metadata.json"), "iter_0000004.tmp/metadata.json"),
    ((checkpointing, "_atomic_write_text"), _enospc, "latest_checkpointed_iteration.txt"),
], ids=["model", "optimizer", "checksum_record", "metadata", "tracker"])
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
    assert _load(save_dir)[0] == 2
    checkpointing.save_checkpoint(save_dir, 4, model, opt)  # room again: the save goes through
    assert _load(save_dir)[0] == 4
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
    monkeypatch.setattr(checkpoint_integrity.os, "fsync", _enospc)
    with pytest.raises(CheckpointError, match=r"is not writable \(No space left on device\)"):
        checkpointing.check_save_dir_writable(str(fresh))
    monkeypatch.undo()
    assert os.listdir(fresh) == []  # the probe is removed even when its write failed


def test_pretrain_checks_the_save_dir_before_building_anything(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import pretrain_gpt

    from parallel3d.arguments import parse_args, validate_args
    from parallel3d.training import pretrain

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    args = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                                     "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2",
                                     "--lr", "1e-3", "--vocab-size", "16", "--save", str(blocker / "ckpt")],
                                    extra_args_provider=pretrain_gpt.add_example_args), 1)

    def never(*args, **kwargs):
        raise AssertionError("pretrain built the model before checking --save")
    with pytest.raises(CheckpointError, match=r"--save directory .*a_file/ckpt' is not writable"):
        pretrain(args, never, never, never)


# ---------------------------------------------------------------- 3: whole-checkpoint verification tool


def _verify_cli(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "verify_checkpoint.py"), *argv],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))


def test_verify_checkpoint_tool_names_every_bad_file(saved):
    save_dir, model, opt, _ = saved
    checkpointing.save_checkpoint(save_dir, 3, model, opt)
    ok = _verify_cli("--load", save_dir)
    assert ok.returncode == 0 and "iter_0000003: every file matches its checksum" in ok.stdout, ok.stderr
    _flip_byte(_file(save_dir, f"{RANK}/model.safetensors", 3))
    with open(_file(save_dir, f"{RANK}/optimizer.pt", 3), "r+b") as f:
        f.truncate(100)
    os.remove(_file(save_dir, "rng/rank_00000.pt", 3))
    open(_file(save_dir, "stray.bin", 3), "wb").write(b"?")
    bad = _verify_cli("--load", save_dir)
    assert bad.returncode == 1
    for line in ("model.safetensors fails its checksum", "optimizer.pt is 100 bytes but was saved as",
                 "rng/rank_00000.pt is missing", "stray.bin is not part of the checkpoint as saved",
                 "4 bad file(s)"):
        assert line in bad.stderr, bad.stderr
    assert _verify_cli("--load", save_dir, "--iteration", "2").returncode == 0  # the older one is intact
    _drop_checksums(save_dir, 2)
    old = _verify_cli("--load", save_dir, "--iteration", "2")
    assert old.returncode == 0 and "records no checksums" in old.stderr and "every file opens" in old.stdout
    open(os.path.join(save_dir, checkpointing.LATEST_FILE), "wb").write(b"\xff\x00")
    broken = _verify_cli("--load", save_dir)
    assert broken.returncode == 2 and "latest_checkpointed_iteration.txt is corrupt" in broken.stderr
    gone = _verify_cli("--load", save_dir, "--iteration", "9")
    assert gone.returncode == 2 and "iter_0000009 is missing" in gone.stderr


def test_verify_checkpoint_names_layout_files_never_recorded(saved):
    save_dir = saved[0]
    _edit_metadata(save_dir, lambda meta: meta.update(world_size=2))
    _, problems = checkpointing.verify_checkpoint(save_dir)
    assert problems == [f"{_file(save_dir, 'rng/rank_00001.pt')} belongs to the saved layout but is not in the "
                        "file list of metadata.json"]


# ---------------------------------------------------------------- real TP ranks: swapped shards, one rank's full disk


def _swap_tp_files(save_dir, name):
    a, b = (os.path.join(save_dir, "iter_0000001", f"mp_rank_{t:02d}_000", name) for t in (0, 1))
    os.replace(a, a + ".x")
    os.replace(b, a)
    os.replace(a + ".x", b)


def _tp2_worker(rank, world_size, save_dir):
    ps.initialize_model_parallel(2, 1)
    out = {}
    try:
        torch.manual_seed(0)
        model = [ParallelBlock()]
        opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
        model[0](torch.ones(2, 1, 16)).sum().backward()
        opt.step()
        checkpointing.save_checkpoint(save_dir, 1, model, opt)
        # rank 1's disk fills up during the next save: both ranks fail, naming what happened
        real = StreamingSafetensorsWriter.write
        if rank == 1:
            StreamingSafetensorsWriter.write = _enospc
        try:
            checkpointing.save_checkpoint(save_dir, 2, model, opt)
        except CheckpointError as e:
            out["enospc"] = str(e)
        finally:
            StreamingSafetensorsWriter.write = real
        out["after_enospc"] = sorted(os.listdir(save_dir))
        checkpointing.load_checkpoint(save_dir, model, opt)
        # swap the two TP ranks' shards (then back), then their optimizer states
        for name in ("model.safetensors", "optimizer.pt"):
            torch.distributed.barrier()
            if rank == 0:
                _swap_tp_files(save_dir, name)
            torch.distributed.barrier()
            try:
                checkpointing.load_checkpoint(save_dir, model, opt)
            except CheckpointError as e:
                out[name] = str(e)
            torch.distributed.barrier()
            if rank == 0:
                _swap_tp_files(save_dir, name)
    finally:
        ps.destroy_model_parallel()
    return out


def test_swapped_tp_shards_and_one_ranks_full_disk(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_tp2_worker, 2, args=(save_dir,), timeout=180)
    assert "cannot write checkpoint file" in results[1]["enospc"] and "ENOSPC" in results[1]["enospc"]
    assert "mp_rank_01_000/model.safetensors" in results[1]["enospc"]
    assert "failed on another rank" in results[0]["enospc"] and "was removed" in results[0]["enospc"]
    assert results[0]["after_enospc"] == ["iter_0000001", checkpointing.LATEST_FILE]
    for rank, other in ((0, 1), (1, 0)):
        for name in ("model.safetensors", "optimizer.pt"):
            msg = results[rank][name]
            assert f"mp_rank_{rank:02d}_000/{name} fails its checksum: its content is that of " \
                   f"mp_rank_{other:02d}_000/{name} (files swapped" in msg, msg
    assert not checkpointing.verify_checkpoint(save_dir)[1]
    _swap_tp_files(save_dir, "model.safetensors")
    _swap_tp_files(save_dir, "optimizer.pt")
    _, problems = checkpointing.verify_checkpoint(save_dir)
    assert len(problems) == 4 and all("files swapped" in p for p in problems), problems
