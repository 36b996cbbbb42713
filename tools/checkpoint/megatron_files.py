"""Megatron-LM checkpoint files: where they lie, how they are unpickled safely, and their ``args``.

Layout (Megatron-LM's ``megatron/training/checkpointing.py``)::

    <dir>/latest_checkpointed_iteration.txt          "1000", or "release"
    <dir>/iter_0001000/ (or <dir>/release/)
        mp_rank_00/model_optim_rng.pt                 legacy ("torch") format, PP = 1
        mp_rank_00_001/model_optim_rng.pt             legacy, TP rank 0, PP rank 1
        .metadata, __0_0.distcp, ..., common.pt       "torch_dist" format (megatron_dist.py)

A legacy ``.pt`` file is a pickle holding, besides tensors, an ``argparse.Namespace`` of the
run's arguments, Megatron-Core enums, numpy RNG states and ``io.BytesIO`` extra states. It is
loaded with ``torch.load(weights_only=True)`` and an explicit allow-list of exactly those
classes (``safe_load``); Megatron's own enums are stood in for by inert classes of ours, so
megatron-core need not be installed and nothing else in the file can run.

The saved ``args`` give the model's shape (as Megatron's ``--use-checkpoint-args``):
``config_from_args``; ``args_from_config`` writes the Namespace a Megatron run checks on load.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pathlib
import pickle
import re
import signal
import types
from typing import Any, Optional

import numpy
import torch

from parallel3d.models.config import TransformerConfig, megatron_activation, megatron_gelu_flags

from .schema import ConversionError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DIST_METADATA = ".metadata"
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


# ------------------------------------------------------------------------------ locations

def iteration_dir_name(iteration: int) -> str:
    """Megatron names iteration 0 (a converted model) ``release``: its loader refuses iteration 0."""
    return "release" if iteration == 0 else f"iter_{iteration:07d}"


def write_tracker(save_dir: str, iteration: int) -> None:
    """``latest_checkpointed_iteration.txt``, as Megatron writes it ("release" for iteration 0), on disk."""
    with open(os.path.join(save_dir, TRACKER_FILE), "w") as f:
        f.write("release" if iteration == 0 else str(iteration))
        f.flush()
        os.fsync(f.fileno())


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def find_checkpoint(load_dir: str) -> tuple[str, Optional[int]]:
    """(the iteration directory, its iteration or None for ``release``) of the checkpoint ``load_dir`` names.

    ``load_dir`` is a Megatron ``--save`` directory (read through its tracker file) or one iteration
    directory itself."""
    if not os.path.isdir(load_dir):
        raise ConversionError(f"--load-dir {load_dir!r} does not exist")
    names = os.listdir(load_dir)
    if DIST_METADATA in names or any(_RANK_DIR.match(n) for n in names):
        base = os.path.basename(os.path.normpath(load_dir))
        m = re.fullmatch(r"iter_(\d+)", base)
        return load_dir, int(m.group(1)) if m else None
    tracker = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise ConversionError(f"{load_dir} holds no Megatron-LM checkpoint: {TRACKER_FILE} is missing (or pass the "
                              "iter_NNNNNNN directory itself)")
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        sub, iteration = "release", None
    else:
        try:
            iteration = int(text)
        except ValueError:
            raise ConversionError(f"{tracker} holds {text!r}: expected an iteration number or 'release'") from None
        sub = f"iter_{iteration:07d}"
    path = os.path.join(load_dir, sub)
    if not os.path.isdir(path):
        raise ConversionError(f"{tracker} names iteration {text}, but {path} does not exist")
    return path, iteration


def legacy_rank_dirs(ckpt_dir: str) -> dict[tuple[int, int], str]:
    """(tp_rank, pp_rank) -> rank directory of a legacy checkpoint; expert-parallel ones are refused."""
    out = {}
    for name in sorted(os.listdir(ckpt_dir)):
        m = _RANK_DIR.match(name)
        if not m:
            continue
        if m.group(3) is not None:
            raise ConversionError(f"{os.path.join(ckpt_dir, name)}: an expert-parallel rank directory; mixture-of-"
                                  "experts checkpoints are not supported")
        out[int(m.group(1)), int(m.group(2) or 0)] = os.path.join(ckpt_dir, name)
    return out


# ------------------------------------------------------------------------------ safe unpickling

class MegatronEnum:
    """Stands in for one of Megatron's enums in a loaded file: its value, nothing runs."""

    def __init__(self, value: Any = None):
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class MegatronConfigObject:
    """Stands in for a Megatron dataclass (OptimizerConfig) in a loaded file: its fields as attributes."""


_ENUMS = ("megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
          "megatron.core.transformer.enums.AttnMaskType", "megatron.core.transformer.enums.CudaGraphScope",
          "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
          "megatron.core.rerun_state_machine.RerunState")
_CONFIGS = ("megatron.core.optimizer.optimizer_config.OptimizerConfig",
            "megatron.core.optimizer.OptimizerConfig")


def _allowed_globals() -> list:
    """What a Megatron-LM checkpoint may hold besides tensors (megatron.core.safe_globals' list, Megatron's own
    classes replaced by inert stand-ins). Nothing that imports, executes or opens files."""
    allowed: list = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO, bytes,
                     signal.Signals, numpy.ndarray, numpy.dtype]
    try:  # numpy 2 (a file written under numpy 1.x names numpy.core's: the same function)
        from numpy._core.multiarray import _reconstruct
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    allowed += [(_reconstruct, "numpy.core.multiarray._reconstruct"),
                (_reconstruct, "numpy._core.multiarray._reconstruct")]
    dtypes = getattr(numpy, "dtypes", None)  # numpy >= 1.25: a dtype pickles by its class there
    allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")] if dtypes else []
    for path in _ENUMS:
        allowed.append((type(path.rsplit(".", 1)[1], (MegatronEnum,), {"__module__": __name__}), path))
    for path in _CONFIGS:
        allowed.append((type(path.rsplit(".", 1)[1], (MegatronConfigObject,), {"__module__": __name__}), path))
    return allowed


_ALLOWED = _allowed_globals()


def safe_load(path: str, what: str = "a Megatron-LM checkpoint file") -> Any:
    """torch.load(weights_only=True) with the allow-list above, memory-mapped where the file allows it."""
    if not os.path.isfile(path):
        raise ConversionError(f"{path} is missing")
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
        raise ConversionError(f"reading {path} safely needs torch >= 2.6 (weights_only loading with an allow-list of "
                              f"named globals); this is torch {torch.__version__}")
    with torch.serialization.safe_globals(_ALLOWED):
        try:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # an old (non-zip) torch.save file
        except pickle.UnpicklingError as e:
            why = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\. |$)", str(e), re.M)
            raise ConversionError(f"{path}: refused to unpickle {what}: it holds an object outside the allow-list "
                                  f"(tensors, argparse.Namespace, numpy arrays, Megatron's enums): "
                                  f"{why.group(1) if why else str(e).strip()[:200]}") from None
        except (RuntimeError, EOFError, OSError) as e:
            raise ConversionError(f"cannot read {path}: {e}") from None


# ------------------------------------------------------------------------------ args <-> config

# Megatron arguments that, when set (truthy), describe a model parallel3d's GPT does not build.
_REFUSED = ("num_experts", "multi_latent_attention", "qk_layernorm", "rotary_interleaved", "squared_relu",
            "apply_layernorm_1p", "use_rope_scaling", "rotary_seq_len_interpolation_factor", "mtp_num_layers",
            "quick_geglu", "window_size", "qk_l2_norm", "attention_output_gate", "hybrid_override_pattern",
            "heterogeneous_layers_config_path")
# ... and those with a value other than the one parallel3d builds.
_ONLY = {"softmax_type": "vanilla"}


def config_from_args(args: Any, where: str, vocab_size: Optional[int] = None,
                     tensor_model_parallel_size: Optional[int] = None) -> TransformerConfig:
    """The model of saved Megatron args, at TP ``tensor_model_parallel_size`` (default: the args') and PP 1 (a
    loader finds the pipeline split from the files). Unset sizes take Megatron-Core's defaults."""
    if not isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        raise ConversionError(f"{where} holds no Megatron args (an argparse.Namespace under 'args'): the model's "
                              "shape is unknown")
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    for name in _REFUSED + tuple(_ONLY):
        if get(name) and get(name) != _ONLY.get(name):
            raise ConversionError(f"{where}: the checkpoint was trained with --{name.replace('_', '-')}="
                                  f"{get(name)!r}, which parallel3d's GPT does not build")
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(get(name), int):
            raise ConversionError(f"{where}: its args have no {name}")
    heads = args.num_attention_heads
    dtype = get("params_dtype")
    if not isinstance(dtype, torch.dtype):
        dtype = torch.bfloat16 if get("bf16") else torch.float16 if get("fp16") else torch.float32
    pos = get("position_embedding_type", "learned_absolute")
    if get("use_rotary_position_embeddings"):
        pos = "rope"
    add_bias_linear = get("add_bias_linear", not get("disable_bias_linear", False))
    # Megatron's validate_args turned bias_gelu_fusion off without biases; its default is on
    activation = megatron_activation(bool(get("swiglu")), bool(get("openai_gelu")), get("bias_gelu_fusion", True),
                                     add_bias_linear)
    padded = get("padded_vocab_size")
    vocab = vocab_size or get("vocab_size") or padded
    if not vocab:
        raise ConversionError(f"{where}: its args record neither vocab_size nor padded_vocab_size; pass "
                              "--true-vocab-size")
    try:
        return TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
            num_query_groups=get("num_query_groups") if get("group_query_attention") else heads,
            kv_channels=get("kv_channels"), ffn_hidden_size=get("ffn_hidden_size") or 4 * args.hidden_size,
            vocab_size=vocab,
            seq_length=get("seq_length") or get("max_position_embeddings"),
            max_position_embeddings=get("max_position_embeddings"),
            make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128),
            position_embedding_type=pos, rotary_base=float(get("rotary_base", 10000)),
            rotary_percent=float(get("rotary_percent", 1.0)), normalization=get("normalization", "LayerNorm"),
            layernorm_epsilon=get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
            gated_linear_unit=bool(get("swiglu")), activation=activation,
            add_bias_linear=add_bias_linear,
            add_qkv_bias=bool(get("add_qkv_bias", False)),
            untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights")),
            apply_residual_connection_post_layernorm=bool(get("apply_residual_connection_post_layernorm")),
            hidden_dropout=get("hidden_dropout", 0.1), attention_dropout=get("attention_dropout", 0.1),
            init_method_std=get("init_method_std", 0.02), seed=get("seed", 1234),
            tensor_model_parallel_size=tensor_model_parallel_size or get("tensor_model_parallel_size") or 1,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: its args describe a model parallel3d cannot build: {e}") from None


def fit_padded_vocab(config: TransformerConfig, rows: int, where: str) -> TransformerConfig:
    """``config`` whose padded vocabulary is the ``rows`` the checkpoint's embedding has.

    Megatron pads to a multiple of make_vocab_size_divisible_by x TP; args that record another
    multiple (or none) than the one that produced ``rows`` get the multiple that does."""
    if rows == config.padded_vocab_size:
        return config
    tp = config.tensor_model_parallel_size
    if rows < config.vocab_size or rows % tp:
        raise ConversionError(f"{where}: the embedding has {rows} rows, which cannot hold the vocabulary of "
                              f"{config.vocab_size} split over TP={tp} (pass --true-vocab-size <= {rows})")
    return dataclasses.replace(config, make_vocab_size_divisible_by=rows // tp)


def args_from_config(config: TransformerConfig, iteration: int, known: Optional[dict] = None) -> argparse.Namespace:
    """The ``args`` a Megatron-LM run reads back (--use-checkpoint-args) or checks (check_checkpoint_args).

    ``known``: arguments the source recorded (its tokenizer), kept where they are not the model's."""
    c = config
    if c.gated_linear_unit != (c.activation == "silu"):
        raise ConversionError(f"Megatron-LM has no flag for activation={c.activation!r} with gated_linear_unit="
                              f"{c.gated_linear_unit} (its MLPs: --swiglu, GeLU, --openai-gelu): not exported")
    groups = c.num_query_groups or c.num_attention_heads
    vp = c.virtual_pipeline_model_parallel_size
    out = dict(known or {})
    out.update(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        ffn_hidden_size=c.ffn_hidden_size, kv_channels=c.kv_channels,
        group_query_attention=groups != c.num_attention_heads, num_query_groups=groups, seq_length=c.seq_length,
        max_position_embeddings=c.max_position_embeddings, position_embedding_type=c.position_embedding_type,
        add_position_embedding=c.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=c.position_embedding_type == "rope",
        rotary_base=int(c.rotary_base) if float(c.rotary_base).is_integer() else c.rotary_base,
        rotary_percent=c.rotary_percent, rotary_interleaved=False, normalization=c.normalization,
        norm_epsilon=c.layernorm_epsilon, swiglu=c.gated_linear_unit and c.activation == "silu",
        **megatron_gelu_flags(c.activation, c.add_bias_linear), squared_relu=False, add_bias_linear=c.add_bias_linear,
        disable_bias_linear=not c.add_bias_linear, add_qkv_bias=c.add_qkv_bias,
        untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
        apply_residual_connection_post_layernorm=c.apply_residual_connection_post_layernorm, qk_layernorm=False,
        vocab_size=c.vocab_size, make_vocab_size_divisible_by=c.make_vocab_size_divisible_by,
        padded_vocab_size=c.padded_vocab_size, hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout, init_method_std=c.init_method_std, seed=c.seed,
        params_dtype=c.params_dtype, fp16=c.params_dtype == torch.float16, bf16=c.params_dtype == torch.bfloat16,
        tensor_model_parallel_size=c.tensor_model_parallel_size,
        pipeline_model_parallel_size=c.pipeline_model_parallel_size, virtual_pipeline_model_parallel_size=vp,
        num_layers_per_virtual_pipeline_stage=c.num_layers // (c.pipeline_model_parallel_size * vp) if vp else None,
        transformer_impl="local", ckpt_format="torch", use_dist_ckpt=False, iteration=iteration,
        consumed_train_samples=0, consumed_valid_samples=0)
    out.setdefault("tokenizer_type", None)
    return argparse.Namespace(**out)


# ------------------------------------------------------------------------------ names

# Megatron-Core's Transformer Engine spec fuses each layer norm into the linear layer after it, and its
# torch_dist files use those names for the local spec's norms too: one canonical name each.
FUSED_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
# The modules whose `_extra_state` (None, or Transformer Engine's FP8 metadata) a Megatron state dict lists.
LAYER_EXTRA_STATES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
