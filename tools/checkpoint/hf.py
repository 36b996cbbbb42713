"""Hugging Face GPT-2 (``GPT2LMHeadModel``) and LLaMA (``LlamaForCausalLM``) as converter source and target.

Reads a LOCAL model directory: ``config.json`` and the weights as ``model.safetensors``,
``pytorch_model.bin``, or either sharded with its ``*.index.json``. safetensors files are
opened lazily and ``.bin`` files memory-mapped, so a unit reads only its own tensors.
Writes ``config.json`` + ``model.safetensors`` that ``from_pretrained`` loads. transformers
itself is not needed for either. The weight files are read by ``hf_files``, which refuses any
path (an index.json's, a symlink's) that leaves the load directory.

Layouts (HF -> Megatron-Core):
- GPT-2's Conv1D weights are [in, out]: transposed. ``c_attn`` is [q | k | v] (heads in
  order inside each); Megatron's ``linear_qkv`` groups rows per query group: [q_g, k_g, v_g].
- LLaMA's q/k/v_proj are re-laid-out into per-group QKV the same way (GQA: a group = the
  query heads sharing a key/value head). gate/up_proj -> ``linear_fc1`` = [gate; up].
- RoPE: HF LLaMA's q/k weights are stored for the rotate-half convention (HF's converter
  permuted Meta's interleaved ones), which is Megatron-Core's default (rotary_interleaved
  False) and parallel3d's: no permutation.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Optional

import torch

from parallel3d.models.config import TransformerConfig
from parallel3d.training.safetensors_stream import StreamingSafetensorsWriter

from .hf_files import SAFETENSORS_FILE, TensorFiles, confined_path, read_json_object
from .hf_tokenizer import export_tokenizer
from .schema import ConversionError

CONFIG_FILE = "config.json"
SUPPORTED = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Buffers older checkpoints saved next to the weights: not parameters, nothing to convert.
_IGNORED = re.compile(r"(^|\.)(h\.\d+\.attn\.(masked_)?bias|layers\.\d+\.self_attn\.rotary_emb\.inv_freq)$")


# --------------------------------------------------------------------------- configs

def read_hf_config(load_dir: str) -> tuple[str, dict[str, Any]]:
    """(family "gpt2" | "llama", the config.json dict) of a local model directory."""
    if not os.path.isdir(load_dir):
        raise ConversionError(f"--load-dir {load_dir!r} does not exist")
    path = confined_path(load_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConversionError(f"{load_dir} is not a Hugging Face model directory: {CONFIG_FILE} is missing")
    cfg = read_json_object(path)
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConversionError(f"{path}: field 'architectures' must be a list of class names, found {archs!r:.60}")
    if archs:
        arch = archs[0]
        if arch not in SUPPORTED:
            raise ConversionError(f"unsupported architecture {arch!r} in {path}: supported are "
                                  f"{', '.join(SUPPORTED)}")
        return SUPPORTED[arch], cfg
    family = {"gpt2": "gpt2", "llama": "llama"}.get(cfg.get("model_type"))
    if family is None:
        raise ConversionError(f"unsupported model_type {cfg.get('model_type')!r} in {path} (no architectures "
                              f"listed): supported are {', '.join(SUPPORTED)}")
    return family, cfg


def _rope_theta(cfg: dict[str, Any], path: str) -> float:
    """rope_theta from transformers 5's ``rope_parameters`` or 4's ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConversionError(f"{path}: RoPE scaling {kind!r} is not supported (only unscaled RoPE)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def transformer_config_from_hf(family: str, cfg: dict[str, Any], dtype: torch.dtype,
                               where: str = CONFIG_FILE) -> TransformerConfig:
    """The TP=1 PP=1 TransformerConfig of a HF GPT-2 / LLaMA config (defaults as transformers')."""
    try:
        if family == "gpt2":
            act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(
                cfg.get("activation_function", "gelu_new"))
            if act is None:
                raise ConversionError(f"{where}: GPT-2 activation_function {cfg.get('activation_function')!r} is not "
                                      "supported (gelu_new, gelu_pytorch_tanh or gelu)")
            for key, bad in (("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True),
                             ("add_cross_attention", True)):
                if cfg.get(key, not bad) == bad:
                    raise ConversionError(f"{where}: GPT-2 with {key}={bad} is not supported")
            h = cfg.get("n_embd", 768)
            positions = cfg.get("n_positions", cfg.get("n_ctx", 1024))
            return TransformerConfig(
                num_layers=cfg.get("n_layer", 12), hidden_size=h, num_attention_heads=cfg.get("n_head", 12),
                vocab_size=cfg.get("vocab_size", 50257), seq_length=positions, max_position_embeddings=positions,
                ffn_hidden_size=cfg.get("n_inner") or 4 * h, position_embedding_type="learned_absolute",
                normalization="LayerNorm", layernorm_epsilon=cfg.get("layer_norm_epsilon", 1e-5), activation=act,
                gated_linear_unit=False, add_bias_linear=True,
                untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", True),
                hidden_dropout=cfg.get("resid_pdrop", 0.1), attention_dropout=cfg.get("attn_pdrop", 0.1),
                init_method_std=cfg.get("initializer_range", 0.02), params_dtype=dtype,
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"{where}: LLaMA hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
        attention_bias, mlp_bias = cfg.get("attention_bias", False), cfg.get("mlp_bias", False)
        if attention_bias != mlp_bias:
            raise ConversionError(f"{where}: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
                                  "supported (parallel3d's add_bias_linear puts biases on all linear layers or none)")
        h, heads = cfg.get("hidden_size", 4096), cfg.get("num_attention_heads", 32)
        positions = cfg.get("max_position_embeddings", 2048)
        return TransformerConfig(
            num_layers=cfg.get("num_hidden_layers", 32), hidden_size=h, num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            kv_channels=cfg.get("head_dim") or h // heads, ffn_hidden_size=cfg.get("intermediate_size", 11008),
            vocab_size=cfg.get("vocab_size", 32000), seq_length=positions, max_position_embeddings=positions,
            position_embedding_type="rope", rotary_base=_rope_theta(cfg, where), normalization="RMSNorm",
            layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6), gated_linear_unit=True, activation="silu",
            add_bias_linear=attention_bias, untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
            hidden_dropout=0.0, attention_dropout=cfg.get("attention_dropout", 0.0),
            init_method_std=cfg.get("initializer_range", 0.02), params_dtype=dtype,
        )
    except (ValueError, TypeError, AttributeError) as e:  # a field of the wrong type, or out of range
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"{where}: the model config is invalid: {type(e).__name__}: {e}") from None


def hf_family(config: TransformerConfig) -> str:
    """"gpt2" or "llama": the HF architecture that holds this model exactly, or an error naming the differences."""
    c = config
    # (setting, its value, whether the family can hold it, what the family needs)
    common = [("apply_residual_connection_post_layernorm", c.apply_residual_connection_post_layernorm,
               not c.apply_residual_connection_post_layernorm, False)]
    gpt2 = common + [
        ("normalization", c.normalization, c.normalization == "LayerNorm", "LayerNorm"),
        ("position_embedding_type", c.position_embedding_type, c.position_embedding_type == "learned_absolute",
         "learned_absolute"),
        ("gated_linear_unit", c.gated_linear_unit, not c.gated_linear_unit, False),
        ("activation", c.activation, c.activation in ("gelu", "gelu_tanh"), "gelu_tanh or gelu"),
        ("add_bias_linear", c.add_bias_linear, c.add_bias_linear, True),
        ("num_query_groups", c.num_query_groups, c.num_query_groups == c.num_attention_heads, c.num_attention_heads),
        ("kv_channels", c.kv_channels, c.kv_channels * c.num_attention_heads == c.hidden_size,
         c.hidden_size // c.num_attention_heads),
    ]
    llama = common + [
        ("normalization", c.normalization, c.normalization == "RMSNorm", "RMSNorm"),
        ("position_embedding_type", c.position_embedding_type, c.position_embedding_type == "rope", "rope"),
        ("gated_linear_unit", c.gated_linear_unit, c.gated_linear_unit, True),
        ("activation", c.activation, c.activation == "silu", "silu"),
        ("rotary_percent", c.rotary_percent, c.rotary_percent == 1.0, 1.0),
        ("add_qkv_bias", c.add_qkv_bias, not c.add_qkv_bias or c.add_bias_linear, "False without add_bias_linear"),
    ]
    diffs = {}
    for family, checks in (("gpt2", gpt2), ("llama", llama)):
        diffs[family] = [f"{name}={have!r} (needs {want})" for name, have, ok, want in checks if not ok]
        if not diffs[family]:
            return family
    raise ConversionError("this model has no Hugging Face equivalent here: as GPT2LMHeadModel it differs in "
                          f"{', '.join(diffs['gpt2'])}; as LlamaForCausalLM in {', '.join(diffs['llama'])}")


def hf_config_from_transformer(config: TransformerConfig, dtype: torch.dtype,
                               base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """config.json for ``config``; ``base`` (the config a model was imported from) keeps its other fields."""
    family = hf_family(config)
    c = config
    out = dict(base or {}) if (base or {}).get("model_type") == family else {}
    out.pop("dtype", None)
    out.update({"architectures": ["GPT2LMHeadModel" if family == "gpt2" else "LlamaForCausalLM"],
                "model_type": family, "vocab_size": c.vocab_size, "initializer_range": c.init_method_std,
                "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
                "torch_dtype": _DTYPE_NAMES[dtype]})
    if family == "gpt2":
        out.update({"n_layer": c.num_layers, "n_embd": c.hidden_size, "n_head": c.num_attention_heads,
                    "n_positions": c.max_position_embeddings, "n_inner": c.ffn_hidden_size,
                    "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
                    "layer_norm_epsilon": c.layernorm_epsilon, "resid_pdrop": c.hidden_dropout,
                    "embd_pdrop": c.hidden_dropout, "attn_pdrop": c.attention_dropout,
                    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                    "reorder_and_upcast_attn": False})
    else:
        out.update({"num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
                    "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_query_groups,
                    "head_dim": c.kv_channels, "intermediate_size": c.ffn_hidden_size, "hidden_act": "silu",
                    "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.layernorm_epsilon,
                    # both spellings: transformers 5 reads rope_parameters, 4 reads rope_theta
                    "rope_theta": c.rotary_base, "rope_scaling": None,
                    "rope_parameters": {"rope_type": "default", "rope_theta": c.rotary_base},
                    "attention_bias": c.add_bias_linear, "mlp_bias": c.add_bias_linear,
                    "attention_dropout": c.attention_dropout, "pretraining_tp": 1})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids only a source config can know
        out.setdefault(key, None)
    return out


# --------------------------------------------------------------------------- names and layouts

def _prefixes(family: str) -> tuple[str, str]:
    """(prefix of the embedding, layers and final norm; name of the untied output layer)."""
    return ("transformer." if family == "gpt2" else "model."), "lm_head.weight"


def hf_shapes(family: str, config: TransformerConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """unit -> {HF name: shape} of a whole model, in file order ("embedding", ("layer", i), "head")."""
    c = config
    h, d, f, V = c.hidden_size, c.kv_channels, c.ffn_hidden_size, c.vocab_size
    nq, ng = c.num_attention_heads * d, c.num_query_groups * d
    pre, lm_head = _prefixes(family)
    units: dict[Any, dict[str, tuple[int, ...]]] = {}
    if family == "gpt2":
        units["embedding"] = {pre + "wte.weight": (V, h), pre + "wpe.weight": (c.max_position_embeddings, h)}
        layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, nq + 2 * ng),
                 "attn.c_attn.bias": (nq + 2 * ng,), "attn.c_proj.weight": (nq, h), "attn.c_proj.bias": (h,),
                 "ln_2.weight": (h,), "ln_2.bias": (h,), "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,),
                 "mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,)}
        layer_prefix, head = pre + "h.{i}.", {pre + "ln_f.weight": (h,), pre + "ln_f.bias": (h,)}
    else:
        units["embedding"] = {pre + "embed_tokens.weight": (V, h)}
        layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (nq, h),
                 "self_attn.k_proj.weight": (ng, h), "self_attn.v_proj.weight": (ng, h)}
        if c.add_bias_linear:
            layer.update({"self_attn.q_proj.bias": (nq,), "self_attn.k_proj.bias": (ng,),
                          "self_attn.v_proj.bias": (ng,)})
        layer["self_attn.o_proj.weight"] = (h, nq)
        if c.add_bias_linear:
            layer["self_attn.o_proj.bias"] = (h,)
        layer.update({"post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h),
                      "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
        if c.add_bias_linear:
            layer.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (h,)})
        layer_prefix, head = pre + "layers.{i}.", {pre + "norm.weight": (h,)}
    for i in range(c.num_layers):
        units[("layer", i)] = {layer_prefix.format(i=i) + k: s for k, s in layer.items()}
    if c.untie_embeddings_and_output_weights:
        head[lm_head] = (V, h)
    units["head"] = head
    return units


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: TransformerConfig) -> torch.Tensor:
    """[q heads], [k heads], [v heads] (rows) -> Megatron's per-group [q_g, k_g, v_g] rows."""
    ng, d = c.num_query_groups, c.kv_channels
    rest = q.shape[1:]
    q = q.reshape(ng, (c.num_attention_heads // ng) * d, *rest)
    return torch.cat([q, k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1).reshape(-1, *rest)


def _qkv_from_megatron(qkv: torch.Tensor, c: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, d = c.num_query_groups, c.kv_channels
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(ng, -1, *rest).split([(c.num_attention_heads // ng) * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def layer_from_hf(family: str, t: dict[str, torch.Tensor], c: TransformerConfig) -> dict[str, torch.Tensor]:
    """One layer's HF tensors (names relative to the layer) -> canonical Megatron tensors."""
    if family == "gpt2":
        q, k, v = _t(t["attn.c_attn.weight"]).split(
            [c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels,
             c.num_query_groups * c.kv_channels])
        qb, kb, vb = t["attn.c_attn.bias"].split(
            [c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels,
             c.num_query_groups * c.kv_channels])
        return {
            "input_layernorm.weight": t["ln_1.weight"], "input_layernorm.bias": t["ln_1.bias"],
            "self_attention.linear_qkv.weight": _qkv_to_megatron(q, k, v, c),
            "self_attention.linear_qkv.bias": _qkv_to_megatron(qb, kb, vb, c),
            "self_attention.linear_proj.weight": _t(t["attn.c_proj.weight"]),
            "self_attention.linear_proj.bias": t["attn.c_proj.bias"],
            "pre_mlp_layernorm.weight": t["ln_2.weight"], "pre_mlp_layernorm.bias": t["ln_2.bias"],
            "mlp.linear_fc1.weight": _t(t["mlp.c_fc.weight"]), "mlp.linear_fc1.bias": t["mlp.c_fc.bias"],
            "mlp.linear_fc2.weight": _t(t["mlp.c_proj.weight"]), "mlp.linear_fc2.bias": t["mlp.c_proj.bias"],
        }
    out = {
        "input_layernorm.weight": t["input_layernorm.weight"],
        "self_attention.linear_qkv.weight": _qkv_to_megatron(
            t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"], t["self_attn.v_proj.weight"], c),
        "self_attention.linear_proj.weight": t["self_attn.o_proj.weight"],
        "pre_mlp_layernorm.weight": t["post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]]),
        "mlp.linear_fc2.weight": t["mlp.down_proj.weight"],
    }
    if c.add_bias_linear:
        out["self_attention.linear_qkv.bias"] = _qkv_to_megatron(
            t["self_attn.q_proj.bias"], t["self_attn.k_proj.bias"], t["self_attn.v_proj.bias"], c)
        out["self_attention.linear_proj.bias"] = t["self_attn.o_proj.bias"]
        out["mlp.linear_fc1.bias"] = torch.cat([t["mlp.gate_proj.bias"], t["mlp.up_proj.bias"]])
        out["mlp.linear_fc2.bias"] = t["mlp.down_proj.bias"]
    return out


def layer_to_hf(family: str, m: dict[str, torch.Tensor], c: TransformerConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`layer_from_hf`."""
    q, k, v = _qkv_from_megatron(m["self_attention.linear_qkv.weight"], c)
    if family == "gpt2":
        qb, kb, vb = _qkv_from_megatron(m["self_attention.linear_qkv.bias"], c)
        return {
            "ln_1.weight": m["input_layernorm.weight"], "ln_1.bias": m["input_layernorm.bias"],
            "attn.c_attn.weight": _t(torch.cat([q, k, v])), "attn.c_attn.bias": torch.cat([qb, kb, vb]),
            "attn.c_proj.weight": _t(m["self_attention.linear_proj.weight"]),
            "attn.c_proj.bias": m["self_attention.linear_proj.bias"],
            "ln_2.weight": m["pre_mlp_layernorm.weight"], "ln_2.bias": m["pre_mlp_layernorm.bias"],
            "mlp.c_fc.weight": _t(m["mlp.linear_fc1.weight"]), "mlp.c_fc.bias": m["mlp.linear_fc1.bias"],
            "mlp.c_proj.weight": _t(m["mlp.linear_fc2.weight"]), "mlp.c_proj.bias": m["mlp.linear_fc2.bias"],
        }
    gate, up = m["mlp.linear_fc1.weight"].chunk(2)
    out = {
        "input_layernorm.weight": m["input_layernorm.weight"],
        "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": m["self_attention.linear_proj.weight"],
        "post_attention_layernorm.weight": m["pre_mlp_layernorm.weight"],
        "mlp.gate_proj.weight": gate.contiguous(), "mlp.up_proj.weight": up.contiguous(),
        "mlp.down_proj.weight": m["mlp.linear_fc2.weight"],
    }
    if c.add_bias_linear:
        qb, kb, vb = _qkv_from_megatron(m["self_attention.linear_qkv.bias"], c)
        gate_b, up_b = m["mlp.linear_fc1.bias"].chunk(2)
        out.update({"self_attn.q_proj.bias": qb, "self_attn.k_proj.bias": kb, "self_attn.v_proj.bias": vb,
                    "self_attn.o_proj.bias": m["self_attention.linear_proj.bias"],
                    "mlp.gate_proj.bias": gate_b.contiguous(), "mlp.up_proj.bias": up_b.contiguous(),
                    "mlp.down_proj.bias": m["mlp.linear_fc2.bias"]})
    return out


def _embedding_names(family: str) -> dict[str, str]:
    """HF name (without prefix) -> canonical name."""
    if family == "gpt2":
        return {"wte.weight": "embedding.word_embeddings.weight", "wpe.weight": "embedding.position_embeddings.weight"}
    return {"embed_tokens.weight": "embedding.word_embeddings.weight"}


def _head_names(family: str) -> dict[str, str]:
    if family == "gpt2":
        return {"ln_f.weight": "decoder.final_layernorm.weight", "ln_f.bias": "decoder.final_layernorm.bias"}
    return {"norm.weight": "decoder.final_layernorm.weight"}


class HfLoader:
    """Units of a local Hugging Face GPT-2 / LLaMA model directory."""

    def __init__(self, load_dir: str):
        self.family, self.hf_config = read_hf_config(load_dir)
        self.files = TensorFiles(load_dir)
        try:
            self._setup(load_dir)
        except BaseException:
            self.files.close()
            raise

    def _setup(self, load_dir: str) -> None:
        files = self.files
        # Original GPT-2 checkpoints name the body without "transformer.".
        self.prefix, self.lm_head = _prefixes(self.family)
        if self.family == "gpt2" and "wte.weight" in files.shapes and "transformer.wte.weight" not in files.shapes:
            self.prefix = ""
        emb = self.prefix + next(iter(_embedding_names(self.family)))
        if emb not in files.shapes:
            raise ConversionError(f"{load_dir}: missing tensor {emb} (the word embedding)")
        dtype = files.dtypes[emb]
        if dtype not in _DTYPE_NAMES:
            raise ConversionError(f"{load_dir}: {emb} is {dtype}; only float32, bfloat16 and float16 are supported")
        self.dtype = dtype
        self.config = transformer_config_from_hf(self.family, self.hf_config, dtype,
                                                 os.path.join(load_dir, CONFIG_FILE))
        self.iteration, self.extra = 0, {"hf_config": self.hf_config}
        units = hf_shapes(self.family, self.config)
        if self.prefix != _prefixes(self.family)[0]:
            units = {u: {n.replace(_prefixes(self.family)[0], self.prefix, 1): s for n, s in names.items()}
                     for u, names in units.items()}
        self.units = units
        want = {n: s for names in units.values() for n, s in names.items()}
        tied_copy = not self.config.untie_embeddings_and_output_weights and self.lm_head in files.shapes
        present = {n for n in files.shapes if not _IGNORED.search(n)} - ({self.lm_head} if tied_copy else set())
        missing = [n for n in want if n not in present]
        extra = sorted(present - set(want))
        if missing or extra:
            raise ConversionError(f"{load_dir} does not match its {CONFIG_FILE} ({self.family}, "
                                  f"{self.config.num_layers} layers): " + "; ".join(
                                      ([f"missing tensors {missing[:6]}"] if missing else [])
                                      + ([f"unexpected tensors {extra[:6]}"] if extra else [])))
        for n, s in want.items():
            if files.shapes[n] != s:
                raise ConversionError(f"{load_dir}: {n} has shape {files.shapes[n]}, {CONFIG_FILE} implies {s}")
            if files.dtypes[n] != dtype:
                raise ConversionError(f"{load_dir}: {n} is {files.dtypes[n]} but {emb} is {dtype}; "
                                      "a model must hold one dtype")
        self._tied_copy = tied_copy

    def embedding(self) -> dict[str, torch.Tensor]:
        out = {canon: self.files[self.prefix + hf] for hf, canon in _embedding_names(self.family).items()}
        if self._tied_copy and not torch.equal(self.files[self.lm_head], out["embedding.word_embeddings.weight"]):
            raise ConversionError(f"{self.lm_head} differs from the word embedding although tie_word_embeddings "
                                  "is set")
        return out

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        prefix = f"{self.prefix}{'h' if self.family == 'gpt2' else 'layers'}.{index}."
        tensors = {n[len(prefix):]: self.files[n] for n in self.units[("layer", index)]}
        return layer_from_hf(self.family, tensors, self.config)

    def head(self) -> dict[str, torch.Tensor]:
        out = {canon: self.files[self.prefix + hf] for hf, canon in _head_names(self.family).items()}
        if self.config.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = self.files[self.lm_head]
        return out

    def close(self) -> None:
        self.files.close()


class HfSaver:
    """Writes ``config.json`` + ``model.safetensors`` (streamed) for GPT2LMHeadModel / LlamaForCausalLM."""

    def __init__(self, out_dir: str, config: TransformerConfig, base_hf_config: Optional[dict[str, Any]] = None,
                 training_args: Optional[dict[str, Any]] = None):
        """``training_args``: the source checkpoint's recorded arguments, whose tokenizer is exported too."""
        self.training_args = training_args
        self.family = hf_family(config)
        self.out_dir, self.config, self.dtype = out_dir, config, config.params_dtype
        self.hf_config = hf_config_from_transformer(config, self.dtype, base_hf_config)
        self.units = hf_shapes(self.family, config)
        entries = {n: (self.dtype, s) for names in self.units.values() for n, s in names.items()}
        self.writer = StreamingSafetensorsWriter(os.path.join(out_dir, SAFETENSORS_FILE), entries,
                                                 metadata={"format": "pt"})
        self.prefix, self.lm_head = _prefixes(self.family)

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.writer.write(name, t.to(self.dtype))

    def embedding(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write({self.prefix + hf: tensors[canon] for hf, canon in _embedding_names(self.family).items()})

    def layer(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        prefix = f"{self.prefix}{'h' if self.family == 'gpt2' else 'layers'}.{index}."
        self._write({prefix + k: v for k, v in layer_to_hf(self.family, tensors, self.config).items()})

    def head(self, tensors: dict[str, torch.Tensor]) -> None:
        out = {self.prefix + hf: tensors[canon] for hf, canon in _head_names(self.family).items()}
        if self.config.untie_embeddings_and_output_weights:
            out[self.lm_head] = tensors["output_layer.weight"]
        self._write(out)

    def finish(self) -> None:
        self.writer.close()
        eod, why = export_tokenizer(self.training_args, self.out_dir)
        for key in ("bos_token_id", "eos_token_id"):
            if self.hf_config.get(key) is None:
                self.hf_config[key] = eod
        if why and self.training_args is not None:
            print(f"note: no tokenizer files in the export: {why}", file=sys.stderr, flush=True)
        path = os.path.join(self.out_dir, CONFIG_FILE)
        with open(path, "w") as f:
            json.dump(self.hf_config, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        self.writer.abort()
