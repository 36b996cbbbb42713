"""tools/convert_checkpoint.py and tools/generate.py: HF GPT-2 / LLaMA <-> parallel3d, resharding, generation.

Tiny random models are made locally with transformers (GPT2Config / LlamaConfig; nothing is
downloaded): a tied GPT-2 (vocab 257, padded for TP) and an untied GQA LLaMA (vocab 300).
Each is converted HF -> TP2xPP2 -> (reshard) TP1xPP4xV2 -> (reshard) TP4xPP1 -> HF; the
round trip is bit-exact, and one launch of 4 gloo processes generates from every layout
(with and without sequence parallelism), comparing with transformers' own greedy
generate and log-probabilities.
"""
import gc
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from safetensors.torch import load_file, save_file
from parallel3d.models import GPTModel
from parallel3d.models.config import gpt2_config, llama_config
from parallel3d.models.gpt import InferenceParams
from parallel3d import parallel_state as ps
from parallel3d.training.checkpointing import LATEST_FILE, model_state_for_save
from parallel3d.models.generation import check_generation_args, generate, sample_token
from parallel3d.pipeline.partition import partition_layers
from parallel3d.testing import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # tools/ is not installed with the package
    sys.path.insert(0, ROOT)

from parallel3d.tools import generate as generate_tool  # noqa: E402
from parallel3d.tools.checkpoint.parallel3d_format import expected_rank_tensors  # noqa: E402
from parallel3d.tools.checkpoint.schema import ConversionError, embedding_specs, head_specs, layer_specs  # noqa: E402
from parallel3d.tools.convert_checkpoint import convert  # noqa: E402
from parallel3d.tools.convert_checkpoint import main as convert_main  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 250]
NEW_TOKENS = 10
# (name, TP, PP, virtual PP): the chain every family is converted through, in this order
LAYOUTS = [("tp2pp2", 2, 2, None), ("tp1pp4v2", 1, 4, 2), ("tp4pp1", 4, 1, None)]


def _hf_class(family: str):
    # transformers is imported where used, not at the top: the gloo workers import this module
    # and would each pay for it (seconds on 2 cores)
    import transformers

    return transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM


def _hf_model(family: str, num_layers: int = 8, hidden: int = None, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":  # tied; gelu_new; a large init so greedy tokens vary and win by clear margins
        return GPT2LMHeadModel(GPT2Config(**{**dict(
            n_layer=num_layers, n_embd=hidden or 32, n_head=4, n_positions=48, vocab_size=257, initializer_range=0.5,
            layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None), **overrides})).eval()
    return LlamaForCausalLM(LlamaConfig(**{**dict(
        num_hidden_layers=num_layers, hidden_size=hidden or 64, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=96, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False,
        rope_theta=5000.0, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=None, eos_token_id=None),
        **overrides})).eval()


def _hf_logprobs(model, tokens):
    """log p(tokens[i+1] | tokens[:i+1]) under a transformers model, fp32."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]
    return lp[torch.arange(len(tokens) - 1), ids[0, 1:]].tolist()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """family -> (HF dir, model, greedy tokens, their logprobs)."""
    out = {}
    for family in ("gpt2", "llama"):
        model = _hf_model(family)
        path = str(tmp_path_factory.mktemp(f"hf_{family}"))
        model.save_pretrained(path)
        with torch.no_grad():
            gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        # the reference must not hinge on near-ties
        assert min(float(s.topk(2).values[0, 0] - s.topk(2).values[0, 1]) for s in gen.scores) > 1e-2
        tokens = gen.sequences[0].tolist()
        out[family] = (path, model, tokens, _hf_logprobs(model, tokens))
    return out


@pytest.fixture(scope="module")
def checkpoints(hf, tmp_path_factory):
    """family -> {layout name: parallel3d dir, "hf": the round-tripped HF dir}."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for family, (hf_dir, *_rest) in hf.items():
        dirs, source, loader = {}, hf_dir, "hf"
        for name, tp, pp, vp in LAYOUTS:
            dirs[name] = str(root / f"{family}_{name}")
            convert(loader, "parallel3d", source, dirs[name], target_tensor_parallel_size=tp,
                    target_pipeline_parallel_size=pp, target_virtual_pipeline_parallel_size=vp)
            source, loader = dirs[name], "parallel3d"
        dirs["hf"] = str(root / f"{family}_hf")
        convert("parallel3d", "hf", source, dirs["hf"])
        out[family] = dirs
    return out


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
    partition = partition_layers(cfg.num_layers, pp, vp)
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
    argv = ["--loader", "parallel3d", "--saver", "parallel3d", "--load-dir", out, "--save-dir", out,
            "--target-tensor-parallel-size", "2", "--target-params-dtype", "fp32", "--quiet"]
    with redirect_stderr(err):
        assert convert_main(argv) == 2
    assert "already holds a checkpoint; pass --overwrite" in err.getvalue()
    assert convert_main(argv + ["--overwrite"]) == 0
    assert sorted(os.listdir(os.path.join(out, "iter_0000000"))) == ["metadata.json", "mp_rank_00_000",
                                                                      "mp_rank_01_000"]
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
    (ckpt / "metadata.json").write_text(json.dumps(meta))
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
    (out / "keep.txt").write_text("old")

    def broken(self, index, tensors):
        raise OSError("disk full")

    monkeypatch.setattr(parallel3d_format.Parallel3dSaver, "layer", broken)
    with pytest.raises(OSError, match="disk full"):
        convert("hf", "parallel3d", hf["gpt2"][0], str(out), target_pipeline_parallel_size=2, overwrite=True)
    assert os.listdir(out) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["out"]


# ------------------------------------------------------------------------------------ generation


def test_kv_cache_decoding_equals_the_full_forward():
    for make in (gpt2_config, llama_config):
        for backend in ("sdpa", "local"):
            cfg = make("tiny", hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend)
            model = GPTModel(cfg).eval()
            ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
            cache = InferenceParams(2, 12)
            with torch.no_grad():
                full = model(ids, None)
                steps = [model(ids[:, :5], None, inference_params=cache)]
                cache.sequence_len_offset = 5
                for t in range(5, 12):
                    steps.append(model(ids[:, t:t + 1], None, inference_params=cache))
                    cache.sequence_len_offset += 1
            assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5, (make.__name__, backend)


def test_sampling_options():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    g = torch.Generator().manual_seed(0)
    assert {sample_token(logits, top_k=2, generator=g) for _ in range(200)} == {1, 2}
    assert {sample_token(logits, top_p=0.3, generator=g) for _ in range(50)} == {1}
    assert len({sample_token(logits, temperature=5.0, generator=g) for _ in range(400)}) == 5
    cfg = gpt2_config("tiny", seq_length=16)
    for args, kwargs, message in (([[]], {}, "the prompt is empty"),
                                  ([[1, 1000]], {}, r"prompt ids \[1000\] are outside the model's vocabulary"),
                                  ([[1] * 10, 8], {}, "needs 17 positions, more than max_position_embeddings"),
                                  ([[1], 2], {"greedy": False, "temperature": 0.0}, "temperature must be > 0"),
                                  ([[1], 2], {"greedy": False, "top_p": 1.5}, r"top_p must be in \[0, 1\]")):
        args = args + [1] if len(args) == 1 else args
        with pytest.raises(ValueError, match=message):
            check_generation_args(args[0], args[1], cfg, **kwargs)


def _generate_everywhere(rank, world_size, cases):
    out = []
    for i, (family, path, tp, pp, vp, sp) in enumerate(cases):
        ps.initialize_model_parallel(tp, pp, vp)
        try:
            chunks, _ = generate_tool.load_model(path, sequence_parallel=sp)
            greedy = generate(chunks, PROMPT, NEW_TOKENS)
            sampled = generate(chunks, PROMPT, 6, greedy=False, temperature=0.9, top_k=50, top_p=0.95, seed=3)
            top1 = generate(chunks, PROMPT, 4, greedy=False, top_k=1, seed=5) if i % 3 == 0 else None
            scored = generate(chunks, greedy[0], 0)
        finally:
            ps.destroy_model_parallel()
        out.append({"greedy": greedy, "sampled": sampled, "top1": top1, "scored": scored})
    return out


def test_generation_matches_transformers_in_every_layout(hf, checkpoints):
    cases = [(family, checkpoints[family][name], tp, pp, vp, False)
             for family in ("gpt2", "llama") for name, tp, pp, vp in LAYOUTS]
    cases += [("gpt2", checkpoints["gpt2"]["tp2pp2"], 2, 2, None, True),  # sequence parallel: padded steps
              ("llama", checkpoints["llama"]["tp4pp1"], 4, 1, None, True)]
    results = run_distributed(_generate_everywhere, 4, args=(cases,), timeout=300)
    assert all(r == results[0] for r in results), "ranks disagree"
    sampled_by_family = {}
    for case, got in zip(cases, results[0]):
        family = case[0]
        _, model, tokens, logprobs = hf[family]
        where = f"{family} TP={case[2]} PP={case[3]} V={case[4]} SP={case[5]}"
        assert got["greedy"][0] == tokens, where
        assert len(got["greedy"][1]) == len(tokens) - 1
        assert max(abs(a - b) for a, b in zip(got["greedy"][1], logprobs)) < 1e-4, where
        assert got["scored"] == (tokens, got["scored"][1])
        assert max(abs(a - b) for a, b in zip(got["scored"][1], logprobs)) < 1e-4, where
        assert got["top1"] is None or got["top1"][0] == tokens[:len(PROMPT) + 4], where
        sampled, sampled_lp = got["sampled"]
        assert sampled[:len(PROMPT)] == PROMPT and len(sampled) == len(PROMPT) + 6
        assert max(abs(a - b) for a, b in zip(sampled_lp, _hf_logprobs(model, sampled))) < 1e-4, where
        sampled_by_family.setdefault(family, set()).add(tuple(sampled))
    # the same seed draws the same tokens in every layout, and not just the greedy ones
    for family, seqs in sampled_by_family.items():
        assert len(seqs) == 1, (family, seqs)
        assert list(next(iter(seqs))) != hf[family][2][:len(PROMPT) + 6], family


def test_generate_cli_under_torchrun(hf, tmp_path):
    """The one torchrun launch: a TP1xPP2 conversion, a text prompt with the byte tokenizer."""
    ckpt = str(tmp_path / "pp2")
    convert("hf", "parallel3d", hf["gpt2"][0], ckpt, target_pipeline_parallel_size=2)
    out = str(tmp_path / "out.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "tools", "generate.py"), "--load", ckpt, "--prompt", "hi!", "--tokenizer-type", "byte",
           "--max-new-tokens", "5", "--greedy", "--output-json", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(out))
    prompt = list(b"hi!")
    model = hf["gpt2"][1]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)[0].tolist()
    assert result["tokens"] == want
    assert max(abs(a - b) for a, b in zip(result["logprobs"], _hf_logprobs(model, want))) < 1e-4
    assert "wrote 8 tokens (5 generated) and 7 log-probabilities" in proc.stdout
    assert proc.stdout.startswith("hi!")


def test_generate_cli_in_one_process_scores_and_samples(hf, tmp_path, monkeypatch):
    """Without torchrun (TP = PP = 1): --score-only, and seeded sampling that repeats itself."""
    ckpt = str(tmp_path / "one")
    convert("hf", "parallel3d", hf["llama"][0], ckpt)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tokens, logprobs = hf["llama"][2], hf["llama"][3]
    out = str(tmp_path / "score.json")
    with redirect_stdout(io.StringIO()):
        generate_tool.main(["--load", ckpt, "--prompt-ids", ",".join(map(str, tokens)), "--score-only",
                            "--output-json", out])
    scored = json.load(open(out))
    assert scored["tokens"] == tokens and max(abs(a - b) for a, b in zip(scored["logprobs"], logprobs)) < 1e-4
    runs = []
    for _ in range(2):
        with redirect_stdout(io.StringIO()):
            runs.append(generate_tool.main(["--load", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
                                            "--temperature", "1.5", "--top-p", "0.9", "--seed", "11",
                                            "--output-json", out]))
    assert runs[0] == runs[1] == json.load(open(out)) and len(runs[0]["tokens"]) == 9


def _generate_cli_error(argv, world_size, monkeypatch) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as info:
        generate_tool.main(argv)
    assert info.value.code == 2
    return err.getvalue()


def test_generate_cli_errors(checkpoints, tmp_path, monkeypatch):
    load = ["--load", checkpoints["gpt2"]["tp2pp2"], "--output-json", str(tmp_path / "o.json")]
    for argv, world, message in (
        (["--prompt-ids", "1,2", "--max-new-tokens", "2"], 1,
         r"world size \(1\) must equal the checkpoint's TP \(2\) x PP \(2\) = 4"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "2", "--greedy", "--temperature", "0.7"], 4,
         "--greedy excludes --temperature"),
        (["--prompt", "hello", "--max-new-tokens", "2"], 4, "--prompt needs --tokenizer-type"),
        (["--prompt-ids", "1,2"], 4, "--max-new-tokens is required"),
        (["--prompt-ids", "1,900", "--score-only"], 4, r"prompt ids \[900\] are outside the model's vocabulary"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "60"], 4, "more than max_position_embeddings"),
    ):
        text = _generate_cli_error(load + argv, world, monkeypatch)
        assert text.startswith("error: ") and re.search(message, text), (argv, text)
    assert "holds no checkpoint" in _generate_cli_error(
        ["--load", str(tmp_path), "--prompt-ids", "1", "--score-only", "--output-json", "x"], 1, monkeypatch)


# ------------------------------------------------------------------------------------ training -> HF


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_trained_checkpoint_exports_to_transformers_with_the_same_loss(family, tmp_path):
    import gpt_harness as training

    args = training.layout_args(family, iters=2)
    args.save = str(tmp_path / "ckpt")
    result = training.train(args)
    model = result["model"][0].module.eval()
    batch = [training.TokenDataset(8, seed=11)[i] for i in range(4)]
    tokens = torch.stack([b["tokens"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    with torch.no_grad():
        ours = model(tokens, None, labels=labels).mean().item()
    convert("parallel3d", "hf", args.save, str(tmp_path / "hf"))
    with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
        hf_model = _hf_class(family).from_pretrained(str(tmp_path / "hf")).eval()
    assert hf_model.config.vocab_size == training.VOCAB  # the TP padding (to 304) is gone
    with torch.no_grad():
        logits = hf_model(tokens).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1)).item()
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    assert open(os.path.join(args.save, LATEST_FILE)).read() == "2"


def _pretrain_with_sample(rank, world_size, argv):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    pretrain_gpt = importlib.import_module("pretrain_gpt")
    out = io.StringIO()
    with redirect_stdout(out):
        pretrain_gpt.main(argv)
    return out.getvalue()


def test_pretrain_gpt_sample_prompt_uses_the_generation_library(tmp_path):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
            "--pipeline-model-parallel-size", "2", "--log-interval", "1000", "--eval-interval", "1000",
            "--no-progress-bar", "--sample-prompt", "def f", "--sample-tokens", "20"]
    outs = run_distributed(_pretrain_with_sample, 2, args=(argv,), timeout=240,
                           env={"WORLD_SIZE": "2", "PARALLEL3D_CACHE": str(tmp_path)})
    assert "sample (greedy, 20 tokens):\ndef f" in outs[1], outs[1][-2000:]
