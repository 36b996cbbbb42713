"""Converter inputs that must be refused: paths leaving the load directory, pickles that would run code,
and parallel3d checkpoints whose files fail their checksums. Converted checkpoints carry checksums too.
"""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from parallel3d.training import checkpointing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # tools/ is not installed with the package
    sys.path.insert(0, ROOT)

from parallel3d.tools.checkpoint.hf import HfLoader  # noqa: E402
from parallel3d.tools.checkpoint.hf_files import confined_path  # noqa: E402
from parallel3d.tools.checkpoint.schema import ConversionError  # noqa: E402
from parallel3d.tools.convert_checkpoint import convert  # noqa: E402

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2,
        "n_positions": 8, "vocab_size": 16}


@pytest.fixture
def dirs(tmp_path):
    """(model dir with config.json, a directory beside it holding a real safetensors file)."""
    model = tmp_path / "model"
    outside = tmp_path / "outside"
    model.mkdir()
    outside.mkdir()
    (model / "config.json").write_text(json.dumps(GPT2))
    save_file({"transformer.wte.weight": torch.zeros(16, 8)}, str(outside / "model.safetensors"))
    return model, outside


def _index(model, target):
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"transformer.wte.weight": target}}))


@pytest.mark.parametrize("target,message", [
    ("../outside/model.safetensors",
     r"lists weight file '\.\./outside/model.safetensors': a path leaving .* \('\.\.'\)"),
    ("sub/../../outside/model.safetensors", r"a path leaving .*\('\.\.'\)"),
    ("ABSOLUTE", r"lists weight file '/.*outside/model.safetensors': an absolute path"),
    ("~/model.safetensors", r"an absolute path"),
], ids=["dotdot", "nested_dotdot", "absolute", "home"])
def test_index_paths_leaving_the_load_dir_are_refused(dirs, target, message):
    model, outside = dirs
    _index(model, str(outside / "model.safetensors") if target == "ABSOLUTE" else target)
    with pytest.raises(ConversionError, match=message):
        HfLoader(str(model))


def test_symlinks_leaving_the_load_dir_are_refused(dirs):
    model, outside = dirs
    os.symlink(outside / "model.safetensors", model / "shard.safetensors")
    _index(model, "shard.safetensors")
    with pytest.raises(ConversionError, match=r"shard.safetensors resolves to .*outside/model.safetensors, outside "
                                              r".*model \(a symlink leaving the model directory\)"):
        HfLoader(str(model))
    os.remove(model / "model.safetensors.index.json")
    os.symlink(outside / "model.safetensors", model / "model.safetensors")  # the unsharded file itself
    with pytest.raises(ConversionError, match=r"a symlink leaving the model directory"):
        HfLoader(str(model))
    os.replace(model / "config.json", outside / "config.json")
    os.symlink(outside / "config.json", model / "config.json")
    with pytest.raises(ConversionError, match=r"config.json resolves to .*outside/config.json"):
        HfLoader(str(model))


def test_links_inside_the_dir_and_a_hub_cache_snapshot_are_allowed(tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text("{}")
    os.symlink("../../blobs/f00d", snapshot / "config.json")  # how the hub cache lays a snapshot out
    assert confined_path(str(snapshot), "config.json") == str(snapshot / "config.json")
    (snapshot / "real.safetensors").write_text("")
    os.symlink("real.safetensors", snapshot / "alias.safetensors")
    assert confined_path(str(snapshot), "alias.safetensors").endswith("alias.safetensors")
    (repo / "secret").write_text("")
    os.symlink("../../secret", snapshot / "escape.safetensors")  # the repo folder is not the blobs folder
    with pytest.raises(ConversionError, match="a symlink leaving"):
        confined_path(str(snapshot), "escape.safetensors")


def test_a_pickle_payload_in_pytorch_model_bin_is_refused_not_run(dirs, tmp_path):
    model, _ = dirs
    marker = tmp_path / "payload_ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))
    torch.save({"transformer.wte.weight": Payload()}, str(model / "pytorch_model.bin"))
    with pytest.raises(ConversionError, match=r"refused to load .*pytorch_model.bin: it holds objects other than "
                                              r"tensors.*could run code"):
        HfLoader(str(model))
    assert not marker.exists()
    (model / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ConversionError, match=r"cannot read .*pytorch_model.bin"):
        HfLoader(str(model))


def test_converted_checkpoints_carry_checksums_and_a_damaged_one_is_not_converted(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=64)).save_pretrained(
        str(tmp_path / "hf"))
    ckpt = str(tmp_path / "tp2")
    convert("hf", "parallel3d", str(tmp_path / "hf"), ckpt, target_tensor_parallel_size=2)
    ckpt_dir, problems = checkpointing.verify_checkpoint(ckpt)
    assert problems == []
    meta = checkpointing.read_metadata(ckpt_dir)
    assert sorted(meta["files"]) == ["mp_rank_00_000/model.safetensors", "mp_rank_01_000/model.safetensors"]
    assert meta["files"]["mp_rank_01_000/model.safetensors"]["tp_rank"] == 1
    convert("parallel3d", "parallel3d", ckpt, str(tmp_path / "tp1"))  # a verified source converts
    assert checkpointing.verify_checkpoint(str(tmp_path / "tp1"))[1] == []

    path = os.path.join(ckpt_dir, "mp_rank_01_000", "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\x7f")
    with pytest.raises(ConversionError, match=r"mp_rank_01_000/model.safetensors fails its checksum"):
        convert("parallel3d", "hf", ckpt, str(tmp_path / "back"))
    assert not os.path.exists(tmp_path / "back")
    problems = checkpointing.verify_checkpoint(ckpt)[1]
    assert len(problems) == 1 and "mp_rank_01_000/model.safetensors fails its checksum" in problems[0]


def test_overwrite_never_replaces_the_source_or_what_no_conversion_wrote(tmp_path):
    """Issue 29, item 12: --save-dir a parent of --load-dir with --overwrite deleted the source and a stranger."""
    parent = tmp_path / "parent"
    src = parent / "src"
    src.mkdir(parents=True)
    (src / checkpointing.LATEST_FILE).write_text("0")
    (parent / "notes.txt").write_text("unrelated")
    for load, save, where in ((src, parent, "contains"), (src, src, "is"), (parent, src, "is inside")):
        with pytest.raises(ConversionError, match=rf"--save-dir {save} {where} --load-dir {load}: the source would "
                                                  "be replaced or deleted"):
            convert("parallel3d", "parallel3d", str(load), str(save), overwrite=True)
    assert (parent / "notes.txt").read_text() == "unrelated" and (src / checkpointing.LATEST_FILE).exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / checkpointing.LATEST_FILE).write_text("0")
    (other / "iter_0000000").mkdir()
    (other / "train.log").write_text("mine")
    with pytest.raises(ConversionError, match=r"--save-dir .*other holds 'train.log', which no conversion writes: "
                                              r"--overwrite replaces only a converted checkpoint"):
        convert("parallel3d", "parallel3d", str(src), str(other), overwrite=True)
    assert (other / "train.log").read_text() == "mine"


@pytest.mark.parametrize("name,content,message", [
    ("config.json", b"\xff\xfe{not utf-8", r"config.json is not valid UTF-8 JSON"),
    ("config.json", b'{"architectures": ["GPT2LMHeadModel"], "n_layer": ', r"config.json is not valid UTF-8 JSON"),
    ("config.json", b"[1, 2]", r"config.json must hold a JSON object, found a list"),
    ("config.json", b'{"architectures": 7}', r"config.json: field 'architectures' must be a list of class names"),
    ("config.json", json.dumps({**GPT2, "n_embd": "abc"}).encode(), r"config.json: the model config is invalid"),
    ("config.json", json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": "x"}).encode(),
     r"config.json: the model config is invalid: TypeError"),
    ("config.json", json.dumps({"architectures": ["LlamaForCausalLM"], "rope_parameters": [1]}).encode(),
     r"config.json: the model config is invalid: AttributeError"),
    ("model.safetensors.index.json", b"[]", r"model.safetensors.index.json must hold a JSON object, found a list"),
    ("model.safetensors.index.json", json.dumps({"weight_map": {"x": "a\x00b"}}).encode(),
     r"lists weight file 'a\\x00b': not a file name"),
], ids=["config_not_utf8", "config_truncated", "config_list", "architectures_int", "n_embd_string",
        "llama_heads_string", "rope_parameters_list", "index_list", "index_nul_byte"])
def test_a_malformed_hf_config_or_index_is_one_line_naming_the_file(dirs, tmp_path, name, content, message):
    """Issue 29, item 14: these were tracebacks."""
    model, _ = dirs
    if name == "config.json":  # weights, so that the config is what fails
        save_file({"transformer.wte.weight": torch.zeros(16, 8), "model.embed_tokens.weight": torch.zeros(16, 8)},
                  str(model / "model.safetensors"))
    (model / name).write_bytes(content)
    with pytest.raises(ConversionError, match=message):
        convert("hf", "parallel3d", str(model), str(tmp_path / "out"))


def test_bad_tensor_parallel_splits_in_a_shard_are_one_line(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from parallel3d.training.checkpointing import iteration_dir
    from safetensors import safe_open

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=64)).save_pretrained(
        str(tmp_path / "hf"))
    ckpt = str(tmp_path / "tp2")
    convert("hf", "parallel3d", str(tmp_path / "hf"), ckpt, target_tensor_parallel_size=2)
    path = os.path.join(iteration_dir(ckpt, 0), "mp_rank_00_000", "model.safetensors")
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = dict(f.metadata())
    save_file(tensors, path, metadata={**header, "tensor_parallel_splits": "[1, 2]"})
    checkpoint_integrity_rerecord(ckpt, "mp_rank_00_000/model.safetensors")
    with pytest.raises(ConversionError, match=r"mp_rank_00_000/model.safetensors: its tensor_parallel_splits metadata "
                                              r"is not a JSON object"):
        convert("parallel3d", "hf", ckpt, str(tmp_path / "back"))


def checkpoint_integrity_rerecord(save_dir, rel):
    """Rewrite the file's record (and metadata.json's checksum): the shard itself is what is checked."""
    from parallel3d.training import checkpoint_integrity

    ckpt_dir = checkpointing.iteration_dir(save_dir, 0)
    meta = checkpointing.read_metadata(ckpt_dir)
    path = os.path.join(ckpt_dir, rel)
    meta["files"][rel].update(sha256=checkpoint_integrity.sha256_file(path), bytes=os.path.getsize(path))
    checkpointing.write_metadata(ckpt_dir, meta)


def test_a_shard_linked_outside_a_parallel3d_checkpoint_is_not_converted(tmp_path):
    """Issue 29, item 2: the link's target held the very bytes saved, and was converted silently."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=64)).save_pretrained(
        str(tmp_path / "hf"))
    ckpt = str(tmp_path / "p3d")
    convert("hf", "parallel3d", str(tmp_path / "hf"), ckpt)
    shard = os.path.join(checkpointing.iteration_dir(ckpt, 0), "mp_rank_00_000", "model.safetensors")
    os.replace(shard, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", shard)
    with pytest.raises(ConversionError, match=r"mp_rank_00_000/model.safetensors is a symlink leaving the checkpoint "
                                              r"directory"):
        convert("parallel3d", "hf", ckpt, str(tmp_path / "back"))
    assert not os.path.exists(tmp_path / "back")
