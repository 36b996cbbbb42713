"""Checkpoint inputs an attacker (or an accident) controls: metadata.json entries and symlinks leaving the
checkpoint, a lost tracker, checksums removed (a downgrade), a renamed iteration, malformed metadata and
swapped pipeline-stage files. Each is refused in one line naming the file; nothing about a file outside
the checkpoint (its size, hash or existence) is ever printed. (docs/reliability.md, "Checkpoint safety".)
"""
import io
import json
import os
import re
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from parallel3d.training import checkpoint_integrity, checkpointing
from parallel3d.training.checkpointing import CheckpointError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_faults import (  # noqa: E402
    RANK,
    ckpt_file,
    drop_checksums,
    edit_metadata,
    load_fresh,
    save_tiny,
    tiny_model,
)
from parallel3d.tools.verify_checkpoint import main as verify_main  # noqa: E402

SECRET = b"secret bytes outside the checkpoint\n" * 7  # 252 bytes: a size to look for in messages


def _says_the_size(text: str) -> bool:
    """Whether a message gives the secret's size: the number as a word, outside paths (pytest's temporary
    directories carry a run counter, pytest-252 one day)."""
    return re.search(rf"\b{len(SECRET)}\b", re.sub(r"\S*/\S*", " ", text)) is not None


@pytest.fixture
def saved(tmp_path):
    return save_tiny(tmp_path)


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return path


class _Verified:
    def __init__(self, argv):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            self.returncode = verify_main(list(argv))
        self.stdout, self.stderr = out.getvalue(), err.getvalue()


def _verify(*argv):
    """tools/verify_checkpoint.py in this process (its exit code and output): a traceback fails the test."""
    return _Verified(argv)


# ---------------------------------------------------------------- 1: entries of metadata.json leaving the directory


@pytest.mark.parametrize("entry", ["../../secret", "ABSOLUTE", "rng/../../../secret", "", "a//b", "a\\b"])
def test_metadata_entries_leaving_the_iteration_dir_are_refused_without_a_word_about_them(saved, secret, entry):
    save_dir = saved[0]
    entry = str(secret) if entry == "ABSOLUTE" else entry
    edit_metadata(save_dir, lambda meta: meta["files"].update({entry: {"sha256": "0" * 64, "bytes": 1}}))
    with pytest.raises(CheckpointError, match=r"metadata.json is corrupt: 'files' lists file .*refusing to read it"):
        load_fresh(save_dir)
    out = _verify("--load", save_dir)
    assert out.returncode == 2 and "metadata.json is corrupt: 'files' lists file" in out.stderr, out.stderr
    assert repr(entry)[:40] in out.stderr
    assert not _says_the_size(out.stderr + out.stdout) and "bytes but was saved" not in out.stderr


# ---------------------------------------------------------------- 2: symlinks leaving the checkpoint


@pytest.mark.parametrize("rel", [f"{RANK}/model.safetensors", f"{RANK}/optimizer.pt", "rng/rank_00000.pt"])
def test_a_symlink_leaving_the_checkpoint_is_refused_even_with_the_right_bytes(saved, tmp_path, rel):
    """The link's target holds the very bytes saved: before, it loaded and verified silently."""
    save_dir = saved[0]
    path = ckpt_file(save_dir, rel)
    outside = tmp_path / "elsewhere"
    shutil.copy(path, outside)
    os.remove(path)
    os.symlink(outside, path)
    with pytest.raises(CheckpointError, match=rf"{rel} is a symlink leaving the checkpoint directory"):
        load_fresh(save_dir)
    out = _verify("--load", save_dir)
    assert out.returncode == 1 and f"{rel} is a symlink leaving the checkpoint directory" in out.stderr, out.stderr
    if rel.endswith("model.safetensors"):
        with pytest.raises(CheckpointError, match="symlink leaving"):
            checkpointing.load_model_shards(checkpointing.iteration_dir(save_dir, 2), 0, 0)


def test_a_symlink_to_a_private_file_discloses_nothing(saved, secret):
    save_dir = saved[0]
    path = ckpt_file(save_dir, "rng/rank_00000.pt")
    os.remove(path)
    os.symlink(secret, path)
    with pytest.raises(CheckpointError) as refused:
        load_fresh(save_dir)
    out = _verify("--load", save_dir)
    for text in (str(refused.value), out.stderr + out.stdout):
        assert "symlink leaving the checkpoint directory" in text and not _says_the_size(text), text
        assert checkpoint_integrity.sha256_file(str(secret))[:16] not in text


@pytest.mark.parametrize("link", ["tracker", "iteration_dir", "metadata"])
def test_the_tracker_the_iteration_dir_and_metadata_may_not_link_outside(saved, tmp_path, link):
    save_dir = saved[0]
    name = {"tracker": checkpointing.LATEST_FILE, "iteration_dir": "iter_0000002",
            "metadata": "iter_0000002/metadata.json"}[link]
    path = os.path.join(save_dir, name)
    moved = tmp_path / "moved"
    shutil.move(path, moved)
    os.symlink(moved, path)
    with pytest.raises(CheckpointError, match=r"is a symlink leaving the checkpoint directory"):
        load_fresh(save_dir)
    assert _verify("--load", save_dir).returncode == 2


# ---------------------------------------------------------------- 3: a lost tracker never means "start from scratch"


def test_checkpoints_without_a_tracker_are_refused_naming_the_newest_and_the_fix(saved):
    save_dir, model, opt, _ = saved
    checkpointing.save_checkpoint(save_dir, 5, model, opt)
    os.makedirs(os.path.join(save_dir, "iter_0000007"))  # incomplete: no metadata.json
    tracker = os.path.join(save_dir, checkpointing.LATEST_FILE)
    os.remove(tracker)
    message = (rf"holds checkpoints \(iterations 2..7\) but no latest_checkpointed_iteration.txt; refusing to start "
               rf"from scratch over them. the newest complete one is iteration 5: to resume from it, run echo 5 > "
               rf"{tracker}")
    with pytest.raises(CheckpointError, match=message):
        load_fresh(save_dir)
    with open(tracker, "w") as f:
        f.write("5")
    assert load_fresh(save_dir)[0] == 5  # the one-line fix works


def test_pretrain_refuses_a_save_dir_with_untracked_checkpoints_before_any_work(saved):
    from parallel3d.training import gpt

    from parallel3d.training import pretrain
    from parallel3d.training.arguments import parse_args, validate_args

    save_dir = saved[0]
    os.remove(os.path.join(save_dir, checkpointing.LATEST_FILE))
    before = os.stat(ckpt_file(save_dir, f"{RANK}/model.safetensors")).st_mtime_ns
    for flags in (["--save", save_dir], ["--save", save_dir, "--load", save_dir]):
        args = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                                         "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "2",
                                         "--lr", "1e-3", "--vocab-size", "16", *flags],
                                        extra_args_provider=gpt.add_sampling_args), 1)

        def never(*args, **kwargs):
            raise AssertionError("pretrain built the model over untracked checkpoints")
        with pytest.raises(CheckpointError, match=r"but no latest_checkpointed_iteration.txt; refusing to start"):
            pretrain(args, never, never, never)
    assert os.stat(ckpt_file(save_dir, f"{RANK}/model.safetensors")).st_mtime_ns == before
    assert "parallel3d_save.lock" not in os.listdir(save_dir)  # released


# ---------------------------------------------------------------- 6: checksums cannot be switched off


def test_removing_the_checksums_of_a_version_2_checkpoint_is_refused(saved):
    save_dir = saved[0]
    edit_metadata(save_dir, lambda meta: meta.pop("files"))
    with pytest.raises(CheckpointError, match=r"format version 2 always records checksums, but its 'files' list is "
                                              r"missing \(removed after the save\?\): refusing to load it unverified"):
        load_fresh(save_dir)
    out = _verify("--load", save_dir)
    assert out.returncode == 2 and "always records checksums" in out.stderr


def test_metadata_json_is_checked_against_its_own_checksum(saved):
    save_dir = saved[0]
    edit_metadata(save_dir, lambda meta: meta["extra"].update(consumed_train_samples=0), rerecord=False)
    with pytest.raises(CheckpointError, match=r"metadata.json fails its checksum \(metadata.json.sha256\): it was "
                                              r"edited or damaged since it was saved"):
        load_fresh(save_dir)
    assert _verify("--load", save_dir).returncode == 2
    os.remove(ckpt_file(save_dir, "metadata.json.sha256"))
    with pytest.raises(CheckpointError, match=r"format version 2 always records checksums, but metadata.json.sha256 "
                                              r"is missing"):
        load_fresh(save_dir)


# ---------------------------------------------------------------- 7: the iteration is cross-checked


def test_a_renamed_iteration_directory_is_refused_naming_both_numbers(saved):
    save_dir = saved[0]
    os.rename(checkpointing.iteration_dir(save_dir, 2), checkpointing.iteration_dir(save_dir, 9))
    with open(os.path.join(save_dir, checkpointing.LATEST_FILE), "w") as f:
        f.write("9")
    with pytest.raises(CheckpointError, match=r"iter_0000009/metadata.json records iteration 2, but its directory "
                                              r"name and the tracker say iteration 9"):
        load_fresh(save_dir)
    assert _verify("--load", save_dir).returncode == 2


# ---------------------------------------------------------------- 13: malformed metadata, one line naming the field


@pytest.mark.parametrize("change,field", [
    (lambda m: m["layout"].update(tensor_model_parallel_size=100_000_000), "layout.tensor_model_parallel_size"),
    (lambda m: m["layout"].update(tensor_model_parallel_size=1e8), "layout.tensor_model_parallel_size"),
    (lambda m: m["layout"].update(pipeline_model_parallel_size="abc"), "layout.pipeline_model_parallel_size"),
    (lambda m: m["layout"].pop("tensor_model_parallel_size"), "layout.tensor_model_parallel_size"),
    (lambda m: m.pop("iteration"), "iteration"),
    (lambda m: m.update(world_size=-1), "world_size"),
    (lambda m: m.update(files=[1, 2]), "files"),
    (lambda m: m["files"][f"{RANK}/model.safetensors"].update(bytes="many"), f"files.{RANK}/model.safetensors"),
    (lambda m: m["files"]["rng/rank_00000.pt"].update(rank=True), "files.rng/rank_00000.pt.rank"),
    (lambda m: m.update(model_config=[]), "model_config"),
    (lambda m: m["extra"].update(consumed_train_samples="32"), "extra.consumed_train_samples"),
], ids=["huge_tp", "float_tp", "string_pp", "missing_tp", "missing_iteration", "negative_world", "files_list",
        "bytes_string", "rank_bool", "config_list", "consumed_string"])
def test_malformed_metadata_is_refused_naming_the_field(saved, change, field):
    save_dir = saved[0]
    edit_metadata(save_dir, change)
    with pytest.raises(CheckpointError, match=rf"metadata.json is corrupt: field '{field}'"):
        load_fresh(save_dir)
    out = _verify("--load", save_dir)
    assert out.returncode == 2 and f"field '{field}'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_non_utf8_metadata_is_one_line(saved):
    save_dir = saved[0]
    os.remove(ckpt_file(save_dir, "metadata.json.sha256"))
    with open(ckpt_file(save_dir, "metadata.json"), "wb") as f:
        f.write(b'{"format_version": 1, "iteration": \xff}')
    out = _verify("--load", save_dir)
    assert out.returncode == 2 and "metadata.json is corrupt" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------- 16: swapped files are named whatever their sizes


def test_swapped_files_of_different_sizes_are_named_as_swapped(saved):
    """Pipeline stages hold different layers, so their files differ in size: a swap is not a truncation."""
    save_dir = saved[0]
    a, b = ckpt_file(save_dir, f"{RANK}/optimizer.pt"), ckpt_file(save_dir, "rng/rank_00000.pt")
    assert os.path.getsize(a) != os.path.getsize(b)
    os.replace(a, a + ".x")
    os.replace(b, a)
    os.replace(a + ".x", b)
    with pytest.raises(CheckpointError, match=r"optimizer.pt fails its checksum: its content is that of "
                                              r"rng/rank_00000.pt \(files swapped"):
        load_fresh(save_dir)
    problems = checkpointing.verify_checkpoint(save_dir)[1]
    assert len(problems) == 2 and all("files swapped" in p for p in problems), problems


# ---------------------------------------------------------------- 8: an architecture change on resume is refused


def _config(*flags):
    from parallel3d.training import gpt

    from parallel3d.training.arguments import parse_args, validate_args
    args = parse_args(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
                       "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--vocab-size", "16", *flags],
                      extra_args_provider=gpt.add_sampling_args)
    return gpt.transformer_config_from_args(validate_args(args, 1)), args


@pytest.mark.parametrize("flags,field", [
    (["--no-bias-gelu-fusion"], "activation: checkpoint 'gelu_tanh' vs this run 'gelu'"),  # Megatron: erf
    (["--norm-epsilon", "0.3"], "layernorm_epsilon: checkpoint 1e-05 vs this run 0.3"),
    (["--rotary-base", "500", "--position-embedding-type", "rope"], "rotary_base"),
    (["--rotary-percent", "0.5", "--position-embedding-type", "rope"], "rotary_percent"),
    (["--add-qkv-bias"], "add_qkv_bias"),
    (["--make-vocab-size-divisible-by", "8"], "make_vocab_size_divisible_by"),
], ids=["bias_gelu_fusion", "norm_epsilon", "rotary_base", "rotary_percent", "qkv_bias", "vocab_divisor"])
def test_a_function_changing_model_flag_on_resume_is_refused_by_name(tmp_path, flags, field):
    saved_config, _ = _config(*(["--position-embedding-type", "rope"] if "rope" in flags else []))
    model, opt = tiny_model()
    save_dir = str(tmp_path / "ckpt")
    checkpointing.save_checkpoint(save_dir, 2, model, opt, model_config=saved_config)
    changed, _ = _config(*flags)
    with pytest.raises(CheckpointError, match=rf"holds another model: .*{re.escape(field)}.*--use-checkpoint-args"):
        load_fresh(save_dir, model_config=changed)
    assert load_fresh(save_dir, model_config=saved_config)[0] == 2


def test_use_checkpoint_args_takes_every_compared_field(tmp_path):
    from parallel3d.training.checkpoint_args import apply_checkpoint_args

    saved_config, _ = _config("--no-bias-gelu-fusion", "--norm-epsilon", "0.25", "--position-embedding-type", "rope",
                              "--rotary-base", "500", "--rotary-percent", "0.5", "--add-qkv-bias")
    model, opt = tiny_model()
    save_dir = str(tmp_path / "ckpt")
    checkpointing.save_checkpoint(save_dir, 2, model, opt, model_config=saved_config)
    _, args = _config("--load", save_dir, "--use-checkpoint-args")
    apply_checkpoint_args(args)
    from parallel3d.training.arguments import validate_args
    from parallel3d.training import gpt
    taken = gpt.transformer_config_from_args(validate_args(args, 1))
    assert taken.checkpoint_mismatches(json.loads(json.dumps(checkpointing._to_jsonable(saved_config)))) == []


def _rewrite_header(path, **entries):
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = dict(f.metadata())
    save_file(tensors, path, metadata={**header, **entries})


@pytest.mark.filterwarnings("ignore::parallel3d.training.checkpointing.CheckpointWarning")
def test_shard_headers_catch_a_swap_or_a_downgrade_where_metadata_lists_no_checksums(saved):
    """A version-2 save records its format version and (TP, PP) rank in each model.safetensors header too."""
    save_dir = saved[0]
    path = ckpt_file(save_dir, f"{RANK}/model.safetensors")
    with safe_open(path, framework="pt") as f:
        assert {k: f.metadata()[k] for k in ("format_version", "tp_rank", "pp_rank")} == \
            {"format_version": "2", "tp_rank": "0", "pp_rank": "0"}
    drop_checksums(save_dir, old_headers=False)  # the downgrade: metadata says version 1, lists no checksums
    with pytest.raises(CheckpointError, match=r"model.safetensors was written by format version 2, which always "
                                              r"records checksums, but metadata.json lists none"):
        load_fresh(save_dir)
    assert "written by format version 2" in _verify("--load", save_dir).stderr
    _rewrite_header(path, format_version="1", pp_rank="1")  # another pipeline stage's file, of an old save
    with pytest.raises(CheckpointError, match=r"model.safetensors was written by pp_rank=1, but this process "
                                              r"\(pp_rank=0\) is loading it \(files swapped"):
        load_fresh(save_dir)
