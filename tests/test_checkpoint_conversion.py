"""tools/convert_checkpoint.py: HF GPT-2 / LLaMA <-> parallel3d and resharding: bit-exact, streaming, its refusals.

The round trip HF -> TP2xPP2 -> TP1xPP4xV2 -> TP4xPP1 -> HF (tests/hf_checkpoints.py) is bit-exact.
"""
import gc
import io
import json
import os
import shutil
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from safetensors.torch import load_file, save_file
from parallel3d.models import GPTModel
from parallel3d.models.config import gpt2_config, llama_config
from parallel3d.training.checkpointing import LATEST_FILE, model_state_for_save, write_metadata
from parallel3d.pipeline.partition import even_counts, partition_layers

from hf_checkpoints import PROMPT, _hf_class, _hf_model
from parallel3d.tools.checkpoint.parallel3d_format import expected_rank_tensors
from parallel3d.tools.checkpoint.schema import ConversionError, embedding_specs, head_specs, layer_specs
from parallel3d.tools.convert_checkpoint import convert
from parallel3d.tools.convert_checkpoint import main as convert_main


# ------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_round_trip_through_every_layout_is_bit_exact(family, hf, checkpoints):
    original = load_file(os.path.join(hf[family][0], "model.safetensors"))
    back = load_file(os.path.join(checkpoints[family]["hf"], "model.safetensors"))
    assert sorted(original) == sorted(back)
    for name, t in original.items():
        assert back[name].dtype == t.dtype == torch.float32 and torch.equal(back[name], t), name
    with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
        loaded = _hf_class(family).from_pretrained(checkpoints[family]["hf"]).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf[family][1](ids).logits)
    assert loaded.config.tie_word_embeddings == (family == "gpt2")
    if family == "llama":
        rope = getattr(loaded.config, "rope_parameters", None) or {"rope_theta": loaded.config.rope_theta}  # 5.x / 4.x
        assert loaded.config.num_key_value_heads == 4 and rope["rope_theta"] == 5000.0


@pytest.mark.parametrize("family,overrides", [
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 2}),
    ("gpt2", {"tie_word_embeddings": False, "n_inner": 48, "activation_function": "gelu"}),
])
def test_round_trip_of_other_variants(family, overrides, tmp_path):
    """Tied LLaMA with biases and MQA-ish groups, untied GPT-2 with erf GeLU and its own MLP width."""
    model = _hf_model(family, num_layers=4, **overrides)
    for name, t in model.named_parameters():  # HF zero-initialises biases: make them matter
        if name.endswith("bias"):
            torch.nn.init.normal_(t.data, std=0.1)
    model.save_pretrained(str(tmp_path / "hf"))
    convert("hf", "parallel3d", str(tmp_path / "hf"), str(tmp_path / "p3d"), target_tensor_parallel_size=2,
            target_pipeline_parallel_size=2)
    convert("parallel3d", "hf", str(tmp_path / "p3d"), str(tmp_path / "back"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(original) == sorted(back) and all(torch.equal(back[k], v) for k, v in original.items())
    with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
        loaded = _hf_class(family).from_pretrained(str(tmp_path / "back")).eval()
    for key, value in overrides.items():
        assert getattr(loaded.config, key) == value, key
    with torch.no_grad():
        assert torch.equal(loaded(torch.tensor([PROMPT])).logits, model(torch.tensor([PROMPT])).logits)


def test_converted_checkpoint_metadata(checkpoints):
    ckpt = os.path.join(checkpoints["llama"]["tp1pp4v2"], "iter_0000000")
    meta = json.load(open(os.path.join(ckpt, "metadata.json")))
    assert meta["layout"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4,
                              "virtual_pipeline_model_parallel_size": 2, "data_parallel_size": 1}
    assert meta["layer_numbers"] == [[[r], [4 + r]] for r in range(4)]
    assert meta["model_config"]["num_query_groups"] == 4 and meta["model_config"]["rotary_base"] == 5000.0
    assert open(os.path.join(checkpoints["llama"]["tp1pp4v2"], LATEST_FILE)).read() == "0"
    # tied GPT-2 with PP>1: the last stage holds the output layer, equal to the (padded) embedding shard
    gpt = os.path.join(checkpoints["gpt2"]["tp2pp2"], "iter_0000000")
    for tp_rank in range(2):
        first = load_file(os.path.join(gpt, f"mp_rank_{tp_rank:02d}_000", "model.safetensors"))
        last = load_file(os.path.join(gpt, f"mp_rank_{tp_rank:02d}_001", "model.safetensors"))
        emb = first["model0.embedding.word_embeddings.weight"]
        assert emb.shape == (256, 32)  # 257 padded to a multiple of 128 x TP = 512, halved
        assert torch.equal(last["model0.output_layer.weight"], emb)
    # TP=4, PP=1, tied: no output layer copy; rank 2 holds ids 256..383 (only 256 is real), rank 3 padding
    files = [load_file(os.path.join(checkpoints["gpt2"]["tp4pp1"], "iter_0000000", f"mp_rank_0{r}_000",
                                    "model.safetensors")) for r in (2, 3)]
    assert all("model0.output_layer.weight" not in f for f in files)
    rank2, rank3 = (f["model0.embedding.word_embeddings.weight"] for f in files)
    assert rank2[0].abs().sum() > 0 and rank2[1:].abs().sum() == 0 and rank3.abs().sum() == 0


def _chunks_per_rank(cfg, pp, vp):
    partition = partition_layers(cfg.num_layers, pp, vp, layers_per_stage=even_counts(cfg.num_layers, pp * vp))
    last = pp * vp - 1
    return [[GPTModel(cfg, pre_process=c * pp + r == 0, post_process=c * pp + r == last,
                      layer_numbers=partition[r][c]) for c in range(vp)] for r in range(pp)]


@pytest.mark.parametrize("make,overrides", [
    (gpt2_config, {}), (gpt2_config, {"untie_embeddings_and_output_weights": True}),
    (llama_config, {}), (llama_config, {"add_bias_linear": True, "untie_embeddings_and_output_weights": False}),
])
def test_written_names_shapes_and_splits_are_the_models(make, overrides):
    """The converter's table of a rank file = what save_checkpoint writes for real model chunks."""
    cfg = make("tiny", num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
               **overrides)
    counts = cfg.layers_per_virtual_stage()
    for r, chunks in enumerate(_chunks_per_rank(cfg, 2, 2)):
        tensors, splits = model_state_for_save(chunks)
        want = expected_rank_tensors(cfg, counts, r)
        assert list(want) == list(tensors)
        assert {k: spec.shard_shape(cfg) for k, (spec, _, _) in want.items()} == \
            {k: tuple(t.shape) for k, t in tensors.items()}
        assert {k: spec.split for k, (spec, _, _) in want.items() if spec.split} == splits


def test_hf_loader_reads_bin_sharded_and_unprefixed_files(hf, checkpoints, tmp_path):
    """pytorch_model.bin (old GPT-2 names + attention buffers), sharded safetensors: same checkpoint."""
    hf_dir = hf["gpt2"][0]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    variants = {}
    old = tmp_path / "old_bin"
    old.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), old)
    legacy = {k.replace("transformer.", "", 1): v for k, v in state.items()}
    legacy.update({f"h.{i}.attn.bias": torch.ones(1, 1, 48, 48) for i in range(8)})
    torch.save(legacy, old / "pytorch_model.bin")
    variants["bin"] = old
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), sharded)
    names = sorted(state)
    weight_map = {}
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{part + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in chunk}, str(sharded / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in chunk})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    variants["sharded"] = sharded
    want = load_file(os.path.join(checkpoints["gpt2"]["tp2pp2"], "iter_0000000", "mp_rank_01_001",
                                  "model.safetensors"))
    for name, path in variants.items():
        out = tmp_path / f"out_{name}"
        convert("hf", "parallel3d", str(path), str(out), target_tensor_parallel_size=2,
                target_pipeline_parallel_size=2)
        got = load_file(str(out / "iter_0000000" / "mp_rank_01_001" / "model.safetensors"))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
    os.remove(sharded / "model-00002-of-00002.safetensors")
    assert "weight shard model-00002-of-00002.safetensors listed in model.safetensors.index.json is missing" in \
        _convert_error("hf", "parallel3d", str(sharded), str(tmp_path / "never"))


def test_target_dtype_and_overwrite(hf, checkpoints, tmp_path):
    out = str(tmp_path / "bf16")
    assert convert_main(["--loader", "parallel3d", "--saver", "parallel3d", "--load-dir",
                         checkpoints["llama"]["tp4pp1"], "--save-dir", out, "--target-params-dtype", "bf16",
                         "--quiet"]) == 0
    t = load_file(os.path.join(out, "iter_0000000", "mp_rank_00_000", "model.safetensors"))
    ref = load_file(os.path.join(hf["llama"][0], "model.safetensors"))
    assert t["model0.embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert torch.equal(t["model0.decoder.layers.3.mlp.linear_fc2.weight"],
                       ref["model.layers.3.mlp.down_proj.weight"].to(torch.bfloat16))
    meta = json.load(open(os.path.join(out, "iter_0000000", "metadata.json")))
    assert meta["model_config"]["params_dtype"] == "bfloat16" and meta["model_config"]["bf16"] is True
    # a second conversion into the same place: refused, then allowed with --overwrite (to fp32, TP=2)
    err = io.StringIO()
    argv = ["--loader", "parallel3d", "--saver", "parallel3d", "--load-dir", checkpoints["llama"]["tp4pp1"],
            "--save-dir", out, "--target-tensor-parallel-size", "2", "--target-params-dtype", "fp32", "--quiet"]
    with redirect_stderr(err):
        assert convert_main(argv) == 2
        assert convert_main([*argv[:4], "--load-dir", out, *argv[6:], "--overwrite"]) == 2  # in place: never
    assert "already holds a checkpoint; pass --overwrite" in err.getvalue()
    assert f"--save-dir {out} is --load-dir {out}: the source would be replaced" in err.getvalue()
    assert convert_main(argv + ["--overwrite"]) == 0
    assert sorted(os.listdir(os.path.join(out, "iter_0000000"))) == ["metadata.json", "metadata.json.sha256",
                                                                      "mp_rank_00_000", "mp_rank_01_000"]
    assert sorted(os.listdir(tmp_path)) == ["bf16"]  # no temporary or swapped-out directories left


# ------------------------------------------------------------------------------------ memory


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable in this process (views of one storage counted once)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def test_conversion_streams_one_unit_at_a_time(tmp_path):
    """Live tensors after each unit stay within a few units, far below the model (16 layers)."""
    hf_dir = str(tmp_path / "hf")
    model = _hf_model("gpt2", num_layers=16, hidden=64)
    model.save_pretrained(hf_dir)
    from parallel3d.tools.checkpoint.hf import transformer_config_from_hf
    cfg = transformer_config_from_hf("gpt2", model.config.to_dict(), torch.float32)
    del model
    gc.collect()

    def nbytes(specs):
        return sum(4 * torch.Size(s.shape).numel() for s in specs.values())

    unit = max(nbytes(embedding_specs(cfg)), nbytes(layer_specs(cfg)), nbytes(head_specs(cfg)))
    total = nbytes(embedding_specs(cfg)) + cfg.num_layers * nbytes(layer_specs(cfg)) + nbytes(head_specs(cfg))
    for loader, saver, src, dst, tp, pp in (("hf", "parallel3d", hf_dir, "p3d", 2, 2),
                                           ("parallel3d", "hf", str(tmp_path / "p3d"), "back", 1, 1)):
        gc.collect()
        baseline, peaks = _live_tensor_bytes(), []
        convert(loader, saver, src, str(tmp_path / dst), target_tensor_parallel_size=tp,
                target_pipeline_parallel_size=pp, progress=lambda _: peaks.append(_live_tensor_bytes() - baseline))
        assert len(peaks) == cfg.num_layers + 2
        assert max(peaks) <= 4 * unit < total / 3, (loader, saver, max(peaks), unit, total)


# ------------------------------------------------------------------------------------ errors


def _convert_error(*args, **kwargs) -> str:
    with pytest.raises(ConversionError) as info:
        convert(*args, **kwargs)
    return str(info.value)


def test_conversion_errors_name_the_problem(hf, checkpoints, tmp_path):
    gpt_dir, llama_dir = hf["gpt2"][0], hf["llama"][0]
    out = str(tmp_path / "out")
    # unsupported architecture
    mistral = tmp_path / "mistral"
    shutil.copytree(llama_dir, mistral)
    cfg = json.load(open(mistral / "config.json"))
    cfg["architectures"] = ["MistralForCausalLM"]
    (mistral / "config.json").write_text(json.dumps(cfg))
    assert "unsupported architecture 'MistralForCausalLM'" in _convert_error("hf", "parallel3d", str(mistral), out)
    # layouts impossible for the model
    msg = _convert_error("hf", "parallel3d", gpt_dir, out, target_tensor_parallel_size=3)
    assert "TP=3" in msg and "num_attention_heads (4) is not divisible by tensor_model_parallel_size (3)" in msg
    msg = _convert_error("hf", "parallel3d", llama_dir, out, target_tensor_parallel_size=8)
    assert "num_query_groups (4) is not divisible by tensor_model_parallel_size (8)" in msg
    msg = _convert_error("hf", "parallel3d", gpt_dir, out, target_pipeline_parallel_size=3)
    assert "num_layers (8) is not divisible by pipeline_model_parallel_size (3)" in msg
    msg = _convert_error("hf", "parallel3d", gpt_dir, out, target_pipeline_parallel_size=2,
                         target_virtual_pipeline_parallel_size=3)
    assert "num_layers (8) is not divisible by pipeline_model_parallel_size (2) x virtual_pipeline" in msg
    assert "options apply to --saver parallel3d only" in _convert_error("hf", "hf", gpt_dir, out,
                                                                        target_tensor_parallel_size=2)
    # HF files that do not match their config
    missing = tmp_path / "missing"
    shutil.copytree(gpt_dir, missing)
    state = load_file(str(missing / "model.safetensors"))
    del state["transformer.h.3.mlp.c_fc.bias"]
    save_file(state, str(missing / "model.safetensors"), metadata={"format": "pt"})
    assert "missing tensors ['transformer.h.3.mlp.c_fc.bias']" in _convert_error("hf", "parallel3d", str(missing), out)
    state["transformer.h.3.mlp.c_fc.bias"] = torch.zeros(128)
    state["transformer.h.8.ln_1.weight"] = torch.ones(32)
    save_file(state, str(missing / "model.safetensors"), metadata={"format": "pt"})
    assert "unexpected tensors ['transformer.h.8.ln_1.weight']" in _convert_error("hf", "parallel3d", str(missing),
                                                                                   out)
    shape = tmp_path / "shape"
    shutil.copytree(gpt_dir, shape)
    cfg = json.load(open(shape / "config.json"))
    cfg["n_inner"] = 64
    (shape / "config.json").write_text(json.dumps(cfg))
    assert "transformer.h.0.mlp.c_fc.weight has shape (32, 128), config.json implies (32, 64)" in \
        _convert_error("hf", "parallel3d", str(shape), out)
    # parallel3d checkpoints: missing / extra shards, shape mismatch against the recorded config
    src = tmp_path / "p3d"
    shutil.copytree(checkpoints["gpt2"]["tp2pp2"], src)
    ckpt = src / "iter_0000000"
    os.rename(ckpt / "mp_rank_01_001", tmp_path / "moved")
    assert "missing shard file(s)" in _convert_error("parallel3d", "hf", str(src), out)
    assert "mp_rank_01_001/model.safetensors" in _convert_error("parallel3d", "hf", str(src), out)
    os.rename(tmp_path / "moved", ckpt / "mp_rank_01_001")
    shutil.copytree(ckpt / "mp_rank_01_001", ckpt / "mp_rank_02_001")
    assert "shard directories ['mp_rank_02_001'] do not belong to the saved layout TP=2 x PP=2" in \
        _convert_error("parallel3d", "hf", str(src), out)
    shutil.rmtree(ckpt / "mp_rank_02_001")
    meta = json.load(open(ckpt / "metadata.json"))
    meta["model_config"]["ffn_hidden_size"] = 64
    write_metadata(str(ckpt), meta)  # with its checksum file: the shapes are what is checked
    assert "layers.0.mlp.linear_fc1.weight has shape (64, 32), the model config implies (32, 32) at TP=2" in \
        _convert_error("parallel3d", "hf", str(src), out)
    # nothing was written by any failed conversion
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_hf_export_needs_a_gpt2_or_llama_shaped_model(tmp_path):
    """A LLaMA-style model with learned positions has no HF equivalent: refused, naming the difference."""
    from parallel3d.tools.checkpoint.hf import hf_family

    with pytest.raises(ConversionError, match=r"as LlamaForCausalLM in position_embedding_type='learned_absolute' "
                                              r"\(needs rope\)"):
        hf_family(llama_config("tiny", position_embedding_type="learned_absolute"))
    assert hf_family(gpt2_config("tiny")) == "gpt2" and hf_family(llama_config("tiny")) == "llama"


def test_a_failed_conversion_leaves_no_output(hf, tmp_path, monkeypatch):
    from parallel3d.tools.checkpoint import parallel3d_format

    out = tmp_path / "out"
    out.mkdir()
    (out / LATEST_FILE).write_text("0")  # an older conversion's, which --overwrite may replace

    def broken(self, index, tensors):
        raise OSError("disk full")

    monkeypatch.setattr(parallel3d_format.Parallel3dSaver, "layer", broken)
    with pytest.raises(OSError, match="disk full"):
        convert("hf", "parallel3d", hf["gpt2"][0], str(out), target_pipeline_parallel_size=2, overwrite=True)
    assert os.listdir(out) == [LATEST_FILE] and sorted(os.listdir(tmp_path)) == ["out"]
