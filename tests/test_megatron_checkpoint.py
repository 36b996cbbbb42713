"""tools/convert_checkpoint.py --loader/--saver megatron on checkpoints this test writes in Megatron-LM's layout.

No megatron-core needed (tests/test_megatron_checkpoint_mcore.py checks against Megatron-Core itself):
``_write_megatron`` lays a model out as Megatron-LM saves it, written independently of the
converter's code: ``iter_NNNNNNN/mp_rank_XX_YYY/model_optim_rng.pt`` with args, model0/model1 for
virtual stages, local layer indices, QKV split per query group, SwiGLU [gate; up] per TP rank,
the vocabulary padded with non-zero rows, Transformer Engine's fused norm names and extra states;
``_write_dist`` the torch_dist format (stacked layers). Round trips are bit-identical in fp32.
"""
import argparse
import dataclasses
import enum
import io
import json
import os
import pickle
import signal
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from parallel3d.tools.checkpoint.megatron_files import args_from_config, config_from_args, safe_load  # noqa: E402
from parallel3d.tools.checkpoint.parallel3d_format import Parallel3dLoader  # noqa: E402
from parallel3d.tools.checkpoint.schema import ConversionError, embedding_specs, head_specs, layer_specs  # noqa: E402
from parallel3d.tools.convert_checkpoint import convert, main as convert_main  # noqa: E402

VOCAB, DIVISIBLE = 100, 8
SHAPES = {
    "llama": dict(num_layers=8, hidden_size=32, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
                  kv_channels=4, ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm",
                  swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True, rotary_base=5000),
    "gpt": dict(num_layers=8, hidden_size=32, num_attention_heads=8, group_query_attention=False, num_query_groups=1,
                kv_channels=4, ffn_hidden_size=64, position_embedding_type="learned_absolute",
                normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                untie_embeddings_and_output_weights=False, rotary_base=10000),
}


def _args(family, tp, pp, vp, vocab_size=VOCAB, **extra):
    padded = -(-VOCAB // (DIVISIBLE * tp)) * DIVISIBLE * tp
    return argparse.Namespace(**{**SHAPES[family], **dict(
        seq_length=16, max_position_embeddings=16, rotary_percent=1.0, norm_epsilon=1e-5, openai_gelu=False,
        add_qkv_bias=False, make_vocab_size_divisible_by=DIVISIBLE, padded_vocab_size=padded, vocab_size=vocab_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        params_dtype=torch.float32, fp16=False, bf16=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, seed=1234, exit_signal=signal.SIGTERM, tokenizer_type="NullTokenizer"), **extra})


def _full_model(family, seed=0):
    """Canonical full tensors (TP=1, real vocabulary) of a random model: {unit: {name: tensor}}."""
    cfg = config_from_args(_args(family, 1, 1, None), "test")
    g = torch.Generator().manual_seed(seed)
    rand = lambda spec: torch.randn(spec.shape, generator=g)  # noqa: E731
    units = {"embedding": {n: rand(s) for n, s in embedding_specs(cfg).items()},
             "head": {n: rand(s) for n, s in head_specs(cfg).items()}}
    for i in range(cfg.num_layers):
        units[i] = {n: rand(s) for n, s in layer_specs(cfg).items()}
    return units


def _megatron_shards(name, full, tp, padded, gated):
    """Megatron-Core's TP shards of a canonical tensor, written out rule by rule."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        pad = torch.full((padded - full.shape[0], full.shape[1]), 7.0)  # padding rows are not zero in Megatron
        return list(torch.cat([full, pad]).chunk(tp, 0))
    if "layer_norm" in name:  # a norm fused into the next linear layer's name: replicated
        return [full] * tp
    if "linear_qkv" in name:
        return list(full.chunk(tp, 0))  # [q..., k, v] per query group, groups split over TP
    if "linear_fc1" in name and gated:  # SwiGLU: each rank holds [its gate rows; its up rows]
        gate, up = full.chunk(2, 0)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    if "linear_fc1" in name:
        return list(full.chunk(tp, 0))
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return list(full.chunk(tp, 1))
    return [full] * tp  # norms, row-parallel biases, position embeddings


_TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
             "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


def _write_megatron(root, family, units, tp, pp, vp=None, iteration=20, te_names=False, vocab_size=VOCAB):
    args = _args(family, tp, pp, vp, vocab_size=vocab_size,
                 transformer_impl="transformer_engine" if te_names else "local")
    chunks, per_stage = vp or 1, SHAPES[family]["num_layers"] // (pp * (vp or 1))
    tied = not SHAPES[family]["untie_embeddings_and_output_weights"]
    sub = "release" if iteration is None else f"iter_{iteration:07d}"
    for p in range(pp):
        models = [[{} for _ in range(chunks)] for _ in range(tp)]
        for c in range(chunks):
            v = c * pp + p  # Megatron's interleaving: virtual stage v holds the v-th block of layers
            entries = []
            if v == 0:
                entries += [(n, t) for n, t in units["embedding"].items()]
            for j in range(per_stage):
                for n, t in units[v * per_stage + j].items():
                    entries.append((f"decoder.layers.{j}.{_TE_NAMES.get(n, n) if te_names else n}", t))
                for module in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                               "mlp.linear_fc2"):
                    entries.append((f"decoder.layers.{j}.{module}._extra_state", io.BytesIO(b"") if te_names else None))
            if v == pp * chunks - 1:
                entries += [(n, t) for n, t in units["head"].items()]
                if tied and v != 0:
                    entries.append(("output_layer.weight", units["embedding"]["embedding.word_embeddings.weight"]))
                entries.append(("output_layer._extra_state", None))
            for name, t in entries:
                shards = (_megatron_shards(name, t, tp, args.padded_vocab_size, args.swiglu) if torch.is_tensor(t)
                          else [t] * tp)
                for r in range(tp):
                    models[r][c][name] = shards[r].clone() if torch.is_tensor(t) else shards[r]
        for r in range(tp):
            d = os.path.join(root, sub, f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{p:03d}")
            os.makedirs(d)
            state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration or 0,
                     "rng_state": [{"np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}],
                     "optimizer": {"param_groups": [{"lr": 1e-4}]}}
            if chunks == 1:
                state["model"] = models[r][0]
            else:
                state.update({f"model{c}": models[r][c] for c in range(chunks)})
            torch.save(state, os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    return root


def _units_of(loader, num_layers):
    try:
        out = {"embedding": loader.embedding(), "head": loader.head()}
        out.update({i: loader.layer(i) for i in range(num_layers)})
        return out
    finally:
        loader.close()


def _assert_same_model(got, want):
    assert sorted(map(str, got)) == sorted(map(str, want))
    for unit, tensors in want.items():
        assert sorted(got[unit]) == sorted(tensors), unit
        for name, t in tensors.items():
            assert got[unit][name].dtype == torch.float32 and torch.equal(got[unit][name], t), (unit, name)


# ------------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("family,tp,pp,vp,te_names", [("llama", 2, 2, 2, True), ("gpt", 2, 2, None, False),
                                                      ("gpt", 1, 1, None, True)])
def test_megatron_layouts_load_into_parallel3d_exactly(family, tp, pp, vp, te_names, tmp_path):
    units = _full_model(family)
    src = _write_megatron(str(tmp_path / "meg"), family, units, tp, pp, vp, te_names=te_names)
    convert("megatron", "parallel3d", src, str(tmp_path / "p3d"), target_tensor_parallel_size=4,
            target_pipeline_parallel_size=2)
    loader = Parallel3dLoader(str(tmp_path / "p3d"))
    assert loader.iteration == 20
    cfg = loader.config
    assert (cfg.num_query_groups, cfg.rotary_base, cfg.vocab_size) == (
        SHAPES[family]["num_query_groups"] if family == "llama" else 8, SHAPES[family]["rotary_base"], VOCAB)
    _assert_same_model(_units_of(loader, 8), units)


def test_padded_vocabulary_is_kept_without_a_true_vocab_size(tmp_path):
    """Megatron's args often record only padded_vocab_size: the rows stay, unless --true-vocab-size drops them."""
    units = _full_model("llama")
    src = _write_megatron(str(tmp_path / "meg"), "llama", units, 2, 1, vocab_size=None)
    convert("megatron", "parallel3d", src, str(tmp_path / "padded"))
    cfg = Parallel3dLoader(str(tmp_path / "padded")).config
    assert cfg.vocab_size == 112
    convert("megatron", "parallel3d", src, str(tmp_path / "true"), true_vocab_size=VOCAB)
    _assert_same_model(_units_of(Parallel3dLoader(str(tmp_path / "true")), 8), units)


def test_args_without_layout_or_padding_take_them_from_the_files(tmp_path):
    """Hand-made args (no TP / PP sizes, no padded vocabulary, another padding multiple): the files decide."""
    units = _full_model("llama")
    src = _write_megatron(str(tmp_path / "meg"), "llama", units, 2, 2)
    for rank in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        path = os.path.join(src, "iter_0000020", rank, "model_optim_rng.pt")
        state = torch.load(path, weights_only=False)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size",
                     "make_vocab_size_divisible_by"):
            delattr(state["args"], name)  # 112 rows at TP=2, where the default multiple 128 x 2 would give 256
        torch.save(state, path)
    convert("megatron", "parallel3d", src, str(tmp_path / "p3d"))
    _assert_same_model(_units_of(Parallel3dLoader(str(tmp_path / "p3d")), 8), units)


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_round_trip_parallel3d_megatron_parallel3d_is_bit_identical(family, tmp_path):
    units = _full_model(family, seed=1)
    src = _write_megatron(str(tmp_path / "meg"), family, units, 2, 2, 2 if family == "llama" else None)
    a, b, c, d, e = (str(tmp_path / n) for n in "abcde")
    convert("megatron", "parallel3d", src, a, target_pipeline_parallel_size=4)
    convert("parallel3d", "megatron", a, b, target_tensor_parallel_size=4)  # TP=4 x PP=1
    convert("megatron", "parallel3d", b, c, target_pipeline_parallel_size=4)
    for p in range(4):
        f = os.path.join("iter_0000020", f"mp_rank_00_{p:03d}", "model.safetensors")
        first, again = load_file(os.path.join(a, f)), load_file(os.path.join(c, f))
        assert sorted(first) == sorted(again) and all(torch.equal(first[k], again[k]) for k in first), f
    meta = []
    for x in (a, c):
        with open(os.path.join(x, "iter_0000020", "metadata.json")) as fh:
            meta.append(json.load(fh))
    assert meta[0]["model_config"] == meta[1]["model_config"]  # the model survives Megatron's args
    convert("megatron", "megatron", b, d, target_tensor_parallel_size=2, target_pipeline_parallel_size=2,
            target_virtual_pipeline_parallel_size=2)
    convert("megatron", "parallel3d", d, e)
    _assert_same_model(_units_of(Parallel3dLoader(e), 8), units)
    f, g = str(tmp_path / "f"), str(tmp_path / "g")  # through torch_dist
    convert("parallel3d", "megatron", e, f, target_tensor_parallel_size=2, ckpt_format="torch_dist")
    assert sorted(os.listdir(os.path.join(f, "iter_0000020"))) == [
        ".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    convert("megatron", "parallel3d", f, g, target_pipeline_parallel_size=2)
    _assert_same_model(_units_of(Parallel3dLoader(g), 8), units)


def test_megatron_export_layout(tmp_path):
    """What Megatron-LM's load_checkpoint reads: names, shards, extra states, args, release for iteration 0."""
    units = _full_model("gpt")
    src = _write_megatron(str(tmp_path / "meg"), "gpt", units, 1, 1, iteration=None)  # a "release" checkpoint
    out = str(tmp_path / "out")
    convert("megatron", "megatron", src, out, target_tensor_parallel_size=2, target_pipeline_parallel_size=2,
            target_virtual_pipeline_parallel_size=2)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "release"
    assert sorted(os.listdir(os.path.join(out, "release"))) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    last = safe_load(os.path.join(out, "release", "mp_rank_01_001", "model_optim_rng.pt"))
    assert last["checkpoint_version"] == 3.0 and last["iteration"] == 0 and "model" not in last
    args = last["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage) == (2, 2, 2, 2)
    assert (args.padded_vocab_size, args.vocab_size, args.tokenizer_type) == (112, VOCAB, "NullTokenizer")
    model1 = last["model1"]  # virtual stage 3: layers 6, 7 as decoder.layers.0, 1, the head and the tied copy
    assert {k for k in model1 if k.startswith("decoder.layers.")} >= {
        "decoder.layers.1.self_attention.linear_qkv._extra_state", "decoder.layers.1.mlp.linear_fc2.weight"}
    assert not any(k.startswith("decoder.layers.2.") for k in model1)
    assert model1["output_layer.weight"].shape == (56, 32) and "output_layer._extra_state" in model1
    torch.testing.assert_close(model1["decoder.layers.1.mlp.linear_fc2.weight"],
                               units[7]["mlp.linear_fc2.weight"].chunk(2, 1)[1], rtol=0, atol=0)
    assert torch.equal(model1["output_layer.weight"][:VOCAB - 56], units["embedding"][
        "embedding.word_embeddings.weight"][56:])


# ------------------------------------------------------------------------------------ torch_dist


def _write_dist(root, family, units, iteration=30):
    """The torch_dist format as Megatron-Core writes it (stacked layers, fused norm names), one process."""
    import torch.distributed.checkpoint as dcp

    args = _args(family, 2, 2, None)
    path = os.path.join(root, f"iter_{iteration:07d}")
    state = {}
    for name, t in {**units["embedding"], **units["head"]}.items():
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            t = torch.cat([t, torch.full((args.padded_vocab_size - VOCAB, t.shape[1]), 7.0)])
        state[name] = t
    for name in units[0]:
        state[f"decoder.layers.{_TE_NAMES.get(name, name)}"] = torch.stack([units[i][name] for i in range(8)])
    state["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"] = torch.zeros(3)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0}, os.path.join(path, "common.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_torch_dist_loads_exactly(family, tmp_path):
    units = _full_model(family, seed=2)
    src = _write_dist(str(tmp_path / "dist"), family, units)
    convert("megatron", "parallel3d", src, str(tmp_path / "p3d"), target_tensor_parallel_size=2)
    loader = Parallel3dLoader(str(tmp_path / "p3d"))
    assert loader.iteration == 30
    _assert_same_model(_units_of(loader, 8), units)


# ------------------------------------------------------------------------------------ safety and refusals

def _plant(path):  # what a malicious pickle would run: it must never be called
    open(path, "w").write("pwned")
    return {}


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_plant, (self.path,))


def test_a_planted_pickle_is_refused_without_running(tmp_path):
    marker = str(tmp_path / "ran")
    units = _full_model("gpt")
    legacy = _write_megatron(str(tmp_path / "meg"), "gpt", units, 1, 1)
    rank_file = os.path.join(legacy, "iter_0000020", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(rank_file, weights_only=False)
    torch.save({**state, "args": _Payload(marker)}, rank_file)
    with pytest.raises(ConversionError, match=r"model_optim_rng.pt: refused to unpickle .*_plant"):
        convert("megatron", "parallel3d", legacy, str(tmp_path / "out"))
    dist = _write_dist(str(tmp_path / "dist"), "gpt", units)
    common = os.path.join(dist, "iter_0000030", "common.pt")
    torch.save({"args": _Payload(marker)}, common)
    with pytest.raises(ConversionError, match=r"common.pt: refused to unpickle"):
        convert("megatron", "parallel3d", dist, str(tmp_path / "out"))
    with open(os.path.join(dist, "iter_0000030", ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(ConversionError, match=r"\.metadata: refused to unpickle .*_plant"):
        convert("megatron", "parallel3d", dist, str(tmp_path / "out"))
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out")


class ModelType(enum.Enum):  # pickled under megatron.core.enums' name, as Megatron's own
    encoder_or_decoder = 1


def test_megatron_objects_in_args_load_without_megatron(tmp_path, monkeypatch):
    """Megatron's enums in args (pickled by their megatron.core names) load as inert stand-ins."""
    import types

    fake = types.ModuleType("megatron.core.enums")
    monkeypatch.setattr(ModelType, "__module__", "megatron.core.enums")
    fake.ModelType = ModelType
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.core.enums", fake)
    units = _full_model("gpt")
    src = _write_megatron(str(tmp_path / "meg"), "gpt", units, 1, 1)
    rank_file = os.path.join(src, "iter_0000020", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(rank_file, weights_only=False)
    state["args"].model_type = ModelType.encoder_or_decoder
    torch.save(state, rank_file)
    monkeypatch.undo()
    convert("megatron", "parallel3d", src, str(tmp_path / "p3d"))
    _assert_same_model(_units_of(Parallel3dLoader(str(tmp_path / "p3d")), 8), units)


def _error(*args, **kwargs):
    with pytest.raises(ConversionError) as e:
        convert(*args, **kwargs)
    return str(e.value)


def test_refusals_name_the_problem(tmp_path):
    units = _full_model("llama")
    src = _write_megatron(str(tmp_path / "meg"), "llama", units, 2, 2)
    out = str(tmp_path / "out")
    os.makedirs(tmp_path / "empty")
    assert "holds no Megatron-LM checkpoint" in _error("megatron", "parallel3d", str(tmp_path / "empty"), out)
    assert "--model-type 'BERT' is not supported" in _error("megatron", "parallel3d", src, out, model_type="BERT")
    assert "--true-vocab-size" in _error("parallel3d", "megatron", src, out, true_vocab_size=100)
    assert "--ckpt-format torch_dist applies to --saver megatron" in _error("megatron", "parallel3d", src, out,
                                                                           ckpt_format="torch_dist")
    rank = os.path.join(src, "iter_0000020", "mp_rank_01_001", "model_optim_rng.pt")
    state = torch.load(rank, weights_only=False)
    state["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(32, 5)
    torch.save(state, rank)
    msg = _error("megatron", "parallel3d", src, out)
    assert "mp_rank_01_001/model_optim_rng.pt: decoder.layers.0.mlp.linear_fc2.weight has shape (32, 5)" in msg
    os.rename(os.path.join(src, "iter_0000020", "mp_rank_01_001"), os.path.join(tmp_path, "gone"))
    assert "do not match the saved layout TP=2 x PP=2" in _error("megatron", "parallel3d", src, out)
    moe = _write_megatron(str(tmp_path / "moe"), "gpt", _full_model("gpt"), 1, 1)
    rank = os.path.join(moe, "iter_0000020", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(rank, weights_only=False)
    state["args"].num_experts = 8
    torch.save(state, rank)
    assert "--num-experts=8" in _error("megatron", "parallel3d", moe, out)
    state["args"].num_experts, state["args"].softmax_type = None, "off-by-one"
    torch.save(state, rank)
    assert "--softmax-type='off-by-one'" in _error("megatron", "parallel3d", moe, out)
    state["args"].softmax_type = "vanilla"
    state["args"].num_experts, state["checkpoint_version"] = None, 2.0
    torch.save(state, rank)
    assert "checkpoint_version 2.0" in _error("megatron", "parallel3d", moe, out)
    state["checkpoint_version"] = 3.0
    state["model"] = {"language_model.embedding.word_embeddings.weight": torch.zeros(112, 32)}
    torch.save(state, rank)
    assert "pre-Megatron-Core model (language_model.* keys" in _error("megatron", "parallel3d", moe, out)
    assert not os.path.exists(out)


def test_an_mlp_megatron_has_no_flag_for_is_not_exported():
    llama = config_from_args(_args("llama", 1, 1, None), "test")
    for gated, activation in ((False, "silu"), (True, "gelu")):
        config = dataclasses.replace(llama, gated_linear_unit=gated, activation=activation)
        with pytest.raises(ConversionError, match=f"no flag for activation='{activation}' with gated_linear_unit="
                                                  f"{gated}"):
            args_from_config(config, 0)
    assert args_from_config(llama, 0).swiglu


def test_command_line(tmp_path, capsys):
    units = _full_model("llama")
    src = _write_megatron(str(tmp_path / "meg"), "llama", units, 1, 2)
    assert convert_main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", src,
                         "--save-dir", str(tmp_path / "hf"), "--quiet"]) == 0
    assert convert_main(["--model-type", "GPT", "--loader", "hf", "--saver", "mcore",
                         "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "back"), "--target-tensor-parallel-size", "2", "--quiet",
                         "--saver-transformer-impl", "local", "--megatron-path", "/opt/Megatron-LM"]) == 0
    convert("megatron", "parallel3d", str(tmp_path / "back"), str(tmp_path / "p3d"))
    _assert_same_model(_units_of(Parallel3dLoader(str(tmp_path / "p3d")), 8), units)
    with pytest.raises(SystemExit):
        convert_main(["--model-type", "BERT", "--loader", "megatron", "--saver", "hf", "--load-dir", src,
                      "--save-dir", str(tmp_path / "x")])
    assert "invalid choice: 'BERT'" in capsys.readouterr().err
    assert convert_main(["--model-type", "GPT", "--loader", "mcore", "--saver", "mcore", "--load-dir", src,
                         "--save-dir", str(tmp_path / "te"), "--saver-transformer-impl", "transformer_engine"]) == 2
    assert "--saver-transformer-impl transformer_engine is not supported" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "te")
