"""Megatron-LM's legacy checkpoint format (``--ckpt-format torch``) as a converter source and target.

One ``model_optim_rng.pt`` per (TP, PP) rank (megatron_files.py has the directory layout), a
pickled dict: ``args``, ``checkpoint_version`` (3.0: Megatron-Core names), ``iteration``, the
model as ``model`` (``model0``, ``model1``, ... with virtual pipeline stages), ``optimizer``,
``opt_param_scheduler`` and ``rng_state``. Model keys are Megatron-Core's: the layers of a
(virtual) stage are ``decoder.layers.{local index}``; virtual stage ``chunk * PP + pp_rank``
holds the next contiguous layers (counted from the files, so uneven splits load too). Tensors
are TP shards laid out as the canonical form's (schema.py): QKV rows per query group, SwiGLU's
``linear_fc1`` = [gate; up] of each rank, the vocabulary padded.

Loader: every rank file is unpickled safely (megatron_files.safe_load) and memory-mapped, every
key and shape is checked against the model the saved args describe before a unit is read.
Optimizer and RNG state are not converted (a parallel3d run continues with ``--no-load-optim
--no-load-rng``).

Saver: writes what Megatron-LM's ``load_checkpoint`` reads for a Megatron-Core GPT built with
``--transformer-impl local`` (``_extra_state`` entries included, so a strict load succeeds):
args, checkpoint_version, iteration and the model; no optimizer or RNG state, so Megatron
continues with ``--no-load-optim --no-load-rng``. A pipeline rank's files are written once its
last unit arrives: memory holds at most one pipeline stage (all of it with virtual stages).
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any, Optional

import torch

from parallel3d.models.config import TransformerConfig
from parallel3d.pipeline.partition import partition_layers
from parallel3d.tools.checkpoint.parallel3d_format import virtual_stage_owner

from .megatron_files import (CHECKPOINT_VERSION, FUSED_NORM_NAMES, LAYER_EXTRA_STATES, MODEL_FILE,
                             args_from_config, config_from_args, fit_padded_vocab, iteration_dir_name,
                             legacy_rank_dirs, rank_dir_name, safe_load, write_tracker)
from .schema import ConversionError, ParamSpec, embedding_specs, head_specs, layer_specs, merge, shard

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_CHUNK = re.compile(r"^model(\d+)$")


def canonical_model_keys(state: dict[str, Any]) -> dict[str, Any]:
    """A Megatron-Core model state dict under the canonical names (extra states dropped, fused norms renamed)."""
    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state") or key == "_extra_state":
            continue
        m = _LAYER.match(key)
        if m and m.group(2) in FUSED_NORM_NAMES:
            key = f"decoder.layers.{m.group(1)}.{FUSED_NORM_NAMES[m.group(2)]}"
        out[key] = value
    return out


def expected_chunk_tensors(config: TransformerConfig, counts: list[int], v: int) -> dict[str, tuple]:
    """key -> (spec, unit, global layer) of the model dict of virtual stage ``v`` (``counts[v]`` layers each).

    unit: "embedding", "layer", "head", or "tied_output" (the last stage's copy of a tied embedding)."""
    out: dict[str, tuple] = {}
    last = len(counts) - 1
    if v == 0:
        out.update({name: (spec, "embedding", None) for name, spec in embedding_specs(config).items()})
    start = sum(counts[:v])
    for j in range(counts[v]):
        for name, spec in layer_specs(config).items():
            out[f"decoder.layers.{j}.{name}"] = (spec, "layer", start + j)
    if v == last:
        out.update({name: (spec, "head", None) for name, spec in head_specs(config).items()})
        if not config.untie_embeddings_and_output_weights and v != 0:
            out["output_layer.weight"] = (embedding_specs(config)["embedding.word_embeddings.weight"], "tied_output",
                                          None)
    return out


class MegatronLegacyLoader:
    """Units of the legacy checkpoint in ``ckpt_dir`` (one iteration directory)."""

    def __init__(self, ckpt_dir: str, iteration: Optional[int], vocab_size: Optional[int] = None):
        self.ckpt_dir = ckpt_dir
        dirs = legacy_rank_dirs(ckpt_dir)
        if (0, 0) not in dirs:
            raise ConversionError(f"{ckpt_dir} holds no mp_rank_00[_000] directory: not a Megatron-LM checkpoint")
        first_path = os.path.join(dirs[0, 0], MODEL_FILE)
        first = safe_load(first_path)
        if not isinstance(first, dict):
            raise ConversionError(f"{first_path} holds a {type(first).__name__}, not Megatron's checkpoint dict")
        version = first.get("checkpoint_version")
        if version is not None and version < CHECKPOINT_VERSION:
            raise ConversionError(f"{first_path}: checkpoint_version {version} is Megatron-LM's pre-Megatron-Core "
                                  "layout (language_model.*); convert it with Megatron's tools/checkpoint first")
        self.args = args = first.get("args")
        # the layout its args record, else the one its rank directories show
        tp = getattr(args, "tensor_model_parallel_size", None) or 1 + max(t for t, _ in dirs)
        self._pp = pp = getattr(args, "pipeline_model_parallel_size", None) or 1 + max(p for _, p in dirs)
        expected = {(t, p) for t in range(tp) for p in range(pp)}
        if set(dirs) != expected:
            raise ConversionError(f"{ckpt_dir}: rank directories {sorted(os.path.basename(d) for d in dirs.values())} "
                                  f"do not match the saved layout TP={tp} x PP={pp} of its args")
        config = config_from_args(args, first_path, vocab_size, tp)
        self.iteration = iteration if iteration is not None else 0
        self._chunks: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for (t, p), d in sorted(dirs.items()):
            path = os.path.join(d, MODEL_FILE)
            state = first if (t, p) == (0, 0) else safe_load(path)
            self._chunks[t, p] = self._model_chunks(state, path)
        shards = [self._chunks[t, 0][0].get("embedding.word_embeddings.weight") for t in range(tp)]
        if all(torch.is_tensor(s) and s.dim() == 2 for s in shards):  # else _check names what is missing
            config = fit_padded_vocab(config, sum(s.shape[0] for s in shards), first_path)
        self.config = config
        vp = len(self._chunks[0, 0])
        if any(len(c) != vp for c in self._chunks.values()):
            raise ConversionError(f"{ckpt_dir}: the rank files hold different numbers of model chunks")
        self._owner = virtual_stage_owner(pp, vp if vp > 1 else None)
        self._counts = [self._layer_count(p, c) for p, c in self._owner]
        if sum(self._counts) != config.num_layers:
            raise ConversionError(f"{ckpt_dir}: the rank files hold {sum(self._counts)} layers (per virtual stage: "
                                  f"{self._counts}), its args say num_layers={config.num_layers}")
        self._check()
        self._where = {}  # global layer -> (pp_rank, chunk, local index)
        for v, (p, c) in enumerate(self._owner):
            for j in range(self._counts[v]):
                self._where[sum(self._counts[:v]) + j] = (p, c, j)
        self.dtype = self._chunks[0, 0][0]["embedding.word_embeddings.weight"].dtype
        self.extra: dict[str, Any] = {}

    @staticmethod
    def _model_chunks(state: Any, path: str) -> list[dict[str, Any]]:
        if not isinstance(state, dict):
            raise ConversionError(f"{path} holds a {type(state).__name__}, not Megatron's checkpoint dict")
        chunks = sorted(int(m.group(1)) for m in map(_CHUNK.match, state) if m)
        names = ["model"] if "model" in state else [f"model{c}" for c in chunks]
        if not names or (names != ["model"] and chunks != list(range(len(chunks)))):
            raise ConversionError(f"{path} holds no 'model' (or model0, model1, ...) entry: {sorted(state)[:8]}")
        out = []
        for name in names:
            model = state[name]
            if not isinstance(model, dict):
                raise ConversionError(f"{path}: '{name}' holds a {type(model).__name__}, not a state dict")
            if any(k.startswith("language_model.") for k in model):
                raise ConversionError(f"{path}: a pre-Megatron-Core model (language_model.* keys, "
                                      "--use-legacy-models); convert it with Megatron's tools/checkpoint first")
            out.append(canonical_model_keys(model))
        return out

    def _layer_count(self, p: int, c: int) -> int:
        return len({int(m.group(1)) for m in map(_LAYER.match, self._chunks[0, p][c]) if m})

    def _check(self) -> None:
        """Every rank's keys, shard shapes and dtypes are those of the model its args describe."""
        cfg = self.config
        for (t, p), chunks in sorted(self._chunks.items()):
            for v, (vp_p, c) in enumerate(self._owner):
                if vp_p != p:
                    continue
                where = os.path.join(self.ckpt_dir, rank_dir_name(t, p, self._pp), MODEL_FILE)
                where += f" (model{c})" if len(chunks) > 1 else ""
                want, have = expected_chunk_tensors(cfg, self._counts, v), chunks[c]
                missing = [k for k in want if k not in have]
                extra = sorted(set(have) - set(want))
                if missing or extra:
                    raise ConversionError(f"{where}: " + "; ".join(
                        ([f"missing tensors {missing[:6]}"] if missing else [])
                        + ([f"tensors this model does not have {extra[:6]}"] if extra else [])))
                for key, (spec, _, _) in want.items():
                    tensor = have[key]
                    if not torch.is_tensor(tensor) or tuple(tensor.shape) != spec.shard_shape(cfg):
                        shape = tuple(tensor.shape) if torch.is_tensor(tensor) else type(tensor).__name__
                        raise ConversionError(f"{where}: {key} has shape {shape}, the model of its args implies "
                                              f"{spec.shard_shape(cfg)} at TP={cfg.tensor_model_parallel_size}")

    def _read(self, p: int, c: int, key: str, spec: ParamSpec) -> torch.Tensor:
        tp = self.config.tensor_model_parallel_size
        return merge([self._chunks[t, p][c][key] for t in range(tp)], spec, self.config)

    def embedding(self) -> dict[str, torch.Tensor]:
        return {name: self._read(*self._owner[0], name, spec) for name, spec in embedding_specs(self.config).items()}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        p, c, j = self._where[index]
        return {name: self._read(p, c, f"decoder.layers.{j}.{name}", spec)
                for name, spec in layer_specs(self.config).items()}

    def head(self) -> dict[str, torch.Tensor]:
        return {name: self._read(*self._owner[-1], name, spec) for name, spec in head_specs(self.config).items()}

    def close(self) -> None:
        self._chunks = {}


class MegatronLegacySaver:
    """Writes a legacy Megatron-LM checkpoint of ``config``'s layout under ``out_dir`` as units arrive."""

    def __init__(self, out_dir: str, config: TransformerConfig, iteration: int, known_args: Optional[dict] = None):
        self.out_dir, self.config, self.iteration = out_dir, config, iteration
        pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
        counts = config.layers_per_virtual_stage()
        partition_layers(config.num_layers, pp, vp or 1, layers_per_stage=counts)  # refuses an impossible split
        self.args = args_from_config(config, iteration, known_args)
        self.ckpt_dir = os.path.join(out_dir, iteration_dir_name(iteration))
        self._owner = virtual_stage_owner(pp, vp)
        self._where = {}
        for v, (p, c) in enumerate(self._owner):
            for j in range(counts[v]):
                self._where[sum(counts[:v]) + j] = (p, c, j)
        nchunks = vp or 1
        # (tp, pp) -> chunk -> model dict; a pipeline rank's files go to disk once all its keys are filled
        self._models = {(t, p): [OrderedDict() for _ in range(nchunks)]
                        for t in range(config.tensor_model_parallel_size) for p in range(pp)}
        self._todo = {p: 0 for p in range(pp)}
        for v, (p, c) in enumerate(self._owner):
            self._todo[p] += len(expected_chunk_tensors(config, counts, v))
        self._counts = counts

    def _put(self, p: int, c: int, key: str, full: torch.Tensor, spec: ParamSpec) -> None:
        full = full.to(self.config.params_dtype)
        for t in range(self.config.tensor_model_parallel_size):
            self._models[t, p][c][key] = shard(full, spec, self.config, t).clone()
        self._todo[p] -= 1
        if self._todo[p] == 0:
            self._write_stage(p)

    def embedding(self, tensors: dict[str, torch.Tensor]) -> None:
        p, c = self._owner[0]
        for name, spec in embedding_specs(self.config).items():
            self._put(p, c, name, tensors[name], spec)
        if not self.config.untie_embeddings_and_output_weights and len(self._owner) > 1:
            p, c = self._owner[-1]  # the last stage's copy of the tied embedding, as Megatron-Core keeps one
            spec = embedding_specs(self.config)["embedding.word_embeddings.weight"]
            self._put(p, c, "output_layer.weight", tensors["embedding.word_embeddings.weight"], spec)

    def layer(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        p, c, j = self._where[index]
        for name, spec in layer_specs(self.config).items():
            self._put(p, c, f"decoder.layers.{j}.{name}", tensors[name], spec)

    def head(self, tensors: dict[str, torch.Tensor]) -> None:
        p, c = self._owner[-1]
        for name, spec in head_specs(self.config).items():
            self._put(p, c, name, tensors[name], spec)

    def _write_stage(self, p: int) -> None:
        pp = self.config.pipeline_model_parallel_size
        for t in range(self.config.tensor_model_parallel_size):
            chunks = self._models.pop((t, p))
            for v, (vp_p, c) in enumerate(self._owner):
                if vp_p == p:  # the modules' extra states, so that Megatron's strict load finds every key
                    for j in range(self._counts[v]):
                        for module in LAYER_EXTRA_STATES:
                            chunks[c][f"decoder.layers.{j}.{module}._extra_state"] = None
                    if v == len(self._owner) - 1:
                        chunks[c]["output_layer._extra_state"] = None
            state: dict[str, Any] = {"args": self.args, "checkpoint_version": CHECKPOINT_VERSION,
                                     "iteration": self.iteration, "num_floating_point_operations_so_far": 0}
            if len(chunks) == 1:
                state["model"] = chunks[0]
            else:
                state.update({f"model{c}": chunk for c, chunk in enumerate(chunks)})
            rdir = os.path.join(self.ckpt_dir, rank_dir_name(t, p, pp))
            os.makedirs(rdir)
            with open(os.path.join(rdir, MODEL_FILE), "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    def finish(self) -> None:
        left = {p: n for p, n in self._todo.items() if n}
        if left:
            raise ConversionError(f"internal: pipeline ranks {sorted(left)} never received all their tensors")
        write_tracker(self.out_dir, self.iteration)

    def abort(self) -> None:
        self._models = {}
