"""Checkpoint load faults: planted pickles, corrupted / truncated / swapped / unrecorded files, a bad
tracker or metadata.json, and the verify tool. Each must be refused with a message naming the file;
none may load silently. (docs/reliability.md lists them all; save-side faults are in
test_checkpoint_save_faults.py.)

A two-parameter module and SGD with momentum keep saves to milliseconds; one gloo run of two
processes covers what needs real TP ranks (swapped shards, one rank's disk filling up).
"""
import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch

from parallel3d.training import checkpoint_integrity, checkpointing
from parallel3d import parallel_state as ps
from parallel3d.training.checkpointing import CheckpointError, CheckpointWarning
from parallel3d.training.safetensors_stream import StreamingSafetensorsWriter
from parallel3d.testing import run_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blocks import ParallelBlock  # noqa: E402
from checkpoint_faults import (  # noqa: E402
    RANK,
    ROOT,
    ckpt_file,
    drop_checksums,
    edit_metadata,
    enospc,
    flip_byte,
    load_fresh,
    same_weights,
    save_tiny,
    tiny_model,
)


@pytest.fixture
def saved(tmp_path):
    return save_tiny(tmp_path)


def _rerecord(save_dir, rel):
    """An attacker who also rewrites metadata.json: the planted file's checksum matches."""
    path = ckpt_file(save_dir, rel)

    def change(meta):
        meta["files"][rel].update(sha256=checkpoint_integrity.sha256_file(path), bytes=os.path.getsize(path))
    edit_metadata(save_dir, change)


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
        torch.load(ckpt_file(save_dir, rel), weights_only=True)
    other, other_opt = tiny_model(seed=1)
    iteration, meta = checkpointing.load_checkpoint(save_dir, other, other_opt)
    assert iteration == 2 and meta["extra"]["consumed_train_samples"] == 32
    assert same_weights(other, weights)
    assert torch.equal(other_opt.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("rel", [f"{RANK}/optimizer.pt", "rng/rank_00000.pt"])
@pytest.mark.parametrize("metadata", ["rerecorded", "no_checksums", "stale_checksum"])
def test_planted_pickle_payload_is_refused_not_run(saved, tmp_path, rel, metadata):
    save_dir = saved[0]
    marker = str(tmp_path / "payload_ran")
    torch.save({"optimizer": Payload(marker), "cpu": Payload(marker)}, ckpt_file(save_dir, rel))
    if metadata == "rerecorded":
        _rerecord(save_dir, rel)
        message = r"refused to load .*" + rel + r": it holds objects other than tensors.*could run code"
    elif metadata == "no_checksums":
        drop_checksums(save_dir)
        message = r"refused to load .*" + rel
    else:
        message = rel + " (is .* bytes but was saved as|fails its checksum)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match=message):
            load_fresh(save_dir)
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
    flip_byte(ckpt_file(save_dir, rel), offset)
    with pytest.raises(CheckpointError, match=f"{rel} fails its checksum .*its bytes changed since it was saved"):
        load_fresh(save_dir)


@pytest.mark.parametrize("rel", [f"{RANK}/model.safetensors", f"{RANK}/optimizer.pt", "rng/rank_00000.pt"])
def test_truncated_files_are_refused_naming_the_file(saved, rel):
    save_dir = saved[0]
    path = ckpt_file(save_dir, rel)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=f"{rel} is .* bytes but was saved as .* bytes: truncated"):
        load_fresh(save_dir)


def test_a_file_missing_from_the_file_list_is_refused(saved):
    save_dir = saved[0]
    edit_metadata(save_dir, lambda meta: meta["files"].pop(f"{RANK}/optimizer.pt"))
    with pytest.raises(CheckpointError, match=r"optimizer.pt is not in the file list of .*metadata.json"):
        load_fresh(save_dir)


def test_metadata_records_every_file_with_its_ranks(saved):
    save_dir = saved[0]
    meta = checkpointing.read_metadata(checkpointing.iteration_dir(save_dir, 2))
    assert sorted(meta["files"]) == [f"{RANK}/model.safetensors", f"{RANK}/optimizer.pt", "rng/rank_00000.pt"]
    for rel, record in meta["files"].items():
        assert record["sha256"] == checkpoint_integrity.sha256_file(ckpt_file(save_dir, rel))  # hashed as written
        assert record["bytes"] == os.path.getsize(ckpt_file(save_dir, rel))
        assert (record["tp_rank"], record["pp_rank"], record["dp_rank"], record["rank"]) == (0, 0, 0, 0)
    assert not os.path.exists(ckpt_file(save_dir, "checksums"))  # per-rank records are folded into metadata.json


def test_a_record_of_another_rank_is_refused(saved):
    save_dir = saved[0]
    edit_metadata(save_dir, lambda meta: meta["files"][f"{RANK}/model.safetensors"].update(tp_rank=1))
    with pytest.raises(CheckpointError, match=r"model.safetensors is recorded as written by tp_rank=1, but this "
                                              r"process \(tp_rank=0\)"):
        load_fresh(save_dir)


def test_old_checkpoint_without_checksums_loads_with_one_warning(saved):
    save_dir, _, _, weights = saved
    drop_checksums(save_dir)
    model, opt = tiny_model(seed=1)
    with pytest.warns(CheckpointWarning, match="records no checksums .*load unverified") as caught:
        checkpointing.load_checkpoint(save_dir, model, opt)
    assert same_weights(model, weights)
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
        load_fresh(save_dir)


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe\x00binary", r"metadata.json is corrupt"),
    (b'{"format_version": 1, "layout"', r"metadata.json is corrupt"),
    (b"[1, 2]", r"metadata.json: format version None is not one this version of parallel3d reads \(1, 2\)"),
    (b'{"format_version": 1, "iteration": 2, "layout": 3}',
     r"metadata.json is corrupt: field 'layout' must be a JSON object, found 3"),
], ids=["binary_garbage", "truncated", "not_an_object", "layout_not_an_object"])
def test_a_bad_metadata_file_is_named(saved, content, message):
    save_dir = saved[0]
    os.remove(ckpt_file(save_dir, "metadata.json.sha256"))  # else the checksum file names the damage first
    with open(ckpt_file(save_dir, checkpointing.METADATA_FILE), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=message):
        load_fresh(save_dir)


def test_damage_in_a_checkpoint_without_checksums_is_named(saved):
    """Without checksums the readers themselves must say which file is bad and why."""
    save_dir = saved[0]
    drop_checksums(save_dir)
    opt_path, rng_path = ckpt_file(save_dir, f"{RANK}/optimizer.pt"), ckpt_file(save_dir, "rng/rank_00000.pt")
    good_opt, good_rng = open(opt_path, "rb").read(), open(rng_path, "rb").read()
    warnings.simplefilter("ignore", CheckpointWarning)
    with open(opt_path, "wb") as f:
        f.write(good_opt[: len(good_opt) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*optimizer.pt: PytorchStreamReader failed .*central "
                                              r"directory.*\(truncated or corrupt file\)"):
        load_fresh(save_dir)
    torch.save({"optimizer": {"state": {}, "param_groups": []}, "opt_param_scheduler": None}, opt_path)
    with pytest.raises(CheckpointError, match=r"optimizer.pt does not fit this optimizer or LR scheduler"):
        load_fresh(save_dir)
    with open(opt_path, "wb") as f:
        f.write(good_opt)
    state = torch.get_rng_state()
    torch.save({"cpu": torch.zeros_like(state), "cuda": None, "tracker": {}}, rng_path)
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt holds no valid RNG state: .*Invalid mt19937 state"):
        load_fresh(save_dir)
    torch.save({"cuda": None}, rng_path)
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt holds no valid RNG state: KeyError"):
        load_fresh(save_dir)
    with open(rng_path, "wb") as f:
        f.write(good_rng)
    model_path = ckpt_file(save_dir, f"{RANK}/model.safetensors")
    with open(model_path, "r+b") as f:
        f.write(b"\xff" * 8)  # header length: absurd
    with pytest.raises(CheckpointError, match=r"cannot read .*model.safetensors"):
        load_fresh(save_dir)


# ---------------------------------------------------------------- 3: whole-checkpoint verification tool


def _verify_cli(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "verify_checkpoint.py"), *argv],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))


def _verify_in_process(capsys, *argv):
    """The tool's main() here, its exit code and output as _verify_cli's (one interpreter start, not one a call)."""
    from parallel3d.tools import verify_checkpoint

    capsys.readouterr()
    code = verify_checkpoint.main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["verify_checkpoint.py", *argv], code, out.out, out.err)


def test_verify_checkpoint_tool_names_every_bad_file(saved, capsys):
    save_dir, model, opt, _ = saved
    checkpointing.save_checkpoint(save_dir, 3, model, opt)
    ok = _verify_cli("--load", save_dir)  # the script, once; the other verdicts from its main() in this process
    assert ok.returncode == 0 and "iter_0000003: every file matches its checksum" in ok.stdout, ok.stderr
    _verify = functools.partial(_verify_in_process, capsys)
    flip_byte(ckpt_file(save_dir, f"{RANK}/model.safetensors", 3))
    with open(ckpt_file(save_dir, f"{RANK}/optimizer.pt", 3), "r+b") as f:
        f.truncate(100)
    os.remove(ckpt_file(save_dir, "rng/rank_00000.pt", 3))
    open(ckpt_file(save_dir, "stray.bin", 3), "wb").write(b"?")
    bad = _verify("--load", save_dir)
    assert bad.returncode == 1
    for line in ("model.safetensors fails its checksum", "optimizer.pt is 100 bytes but was saved as",
                 "rng/rank_00000.pt is missing", "stray.bin is not part of the checkpoint as saved",
                 "4 bad file(s)"):
        assert line in bad.stderr, bad.stderr
    assert _verify("--load", save_dir, "--iteration", "2").returncode == 0  # the older one is intact
    drop_checksums(save_dir, 2)
    old = _verify("--load", save_dir, "--iteration", "2")
    assert old.returncode == 0 and "records no checksums" in old.stderr and "every file opens" in old.stdout
    open(os.path.join(save_dir, checkpointing.LATEST_FILE), "wb").write(b"\xff\x00")
    broken = _verify("--load", save_dir)
    assert broken.returncode == 2 and "latest_checkpointed_iteration.txt is corrupt" in broken.stderr
    gone = _verify("--load", save_dir, "--iteration", "9")
    assert gone.returncode == 2 and "iter_0000009 is missing" in gone.stderr


def test_verify_checkpoint_names_layout_files_never_recorded(saved):
    save_dir = saved[0]
    edit_metadata(save_dir, lambda meta: meta.update(world_size=2))
    _, problems = checkpointing.verify_checkpoint(save_dir)
    assert problems == [f"{ckpt_file(save_dir, 'rng/rank_00001.pt')} belongs to the saved layout but is not in the "
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
            StreamingSafetensorsWriter.write = enospc
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
