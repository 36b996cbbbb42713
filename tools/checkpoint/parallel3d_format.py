"""parallel3d checkpoints (``parallel3d/training/checkpointing.py``'s format) as a converter source and target.

Loader: reads the layout and model config from ``metadata.json``, finds which layers each
(pipeline rank, chunk) holds from the shard files themselves (so uneven splits work), and
checks every file's tensor names, shapes and TP splits against the model before any tensor
is read. A unit is then read from the memory-mapped shard files of its pipeline rank and
merged over TP. A tied output layer's copy on the last stage is checked for its shape and
otherwise ignored: the embedding is the tied weight. FP8 delayed-scaling state (``*.fp8_scaling.*``)
is not a weight: it is skipped, and a conversion writes the weights only.

Saver: one streaming safetensors file per (TP, PP) rank, written as units arrive, with the
same names (``model{chunk}.{param}``), ``tensor_parallel_splits`` metadata and directory
layout as ``save_checkpoint``, plus ``metadata.json`` (layout, model_config, layer_numbers as
``[pp_rank][chunk] -> global layer indices``) and ``latest_checkpointed_iteration.txt``.
No optimizer or RNG state is written: resume from a converted checkpoint with
``--no-load-optim --no-load-rng``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import Any, Optional

import torch
from safetensors import safe_open

from parallel3d.models.config import TransformerConfig
from parallel3d.tensor_parallel.fp8 import is_fp8_state_key
from parallel3d.training.checkpoint_integrity import FILES_KEY, check_file, check_shard_header, confined_path
from parallel3d.training.checkpointing import (
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    _atomic_write_text,
    _fsync_dir,
    _to_jsonable,
    iteration_dir,
    open_checkpoint,
    rank_dir_name,
    write_metadata,
)
from parallel3d.pipeline.partition import partition_layers
from parallel3d.pipeline.schedules import stage_location, virtual_stage
from parallel3d.training.checkpoint_layers import saved_split, stage_order
from parallel3d.training.safetensors_stream import StreamingSafetensorsWriter

from .schema import ConversionError, ParamSpec, embedding_specs, head_specs, layer_specs, merge, shard

MODEL_FILE = "model.safetensors"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LAYER_KEY = re.compile(r"^model(\d+)\.decoder\.layers\.(\d+)\.")


def config_from_metadata(model_config: dict[str, Any], where: str) -> TransformerConfig:
    """Rebuild the TransformerConfig a checkpoint's metadata recorded."""
    if not model_config:
        raise ConversionError(f"{where} records no model_config in {METADATA_FILE}: save it with "
                              "save_checkpoint(..., model_config=config)")
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(model_config) - names)
    if unknown:
        raise ConversionError(f"{where}: model_config has fields this TransformerConfig does not know: {unknown}")
    try:
        return TransformerConfig(**model_config)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: its model_config is invalid: {e}") from e


def virtual_stage_owner(pp: int, vp: Optional[int], placement: str = "loop") -> list[tuple[int, int]]:
    """(pp_rank, chunk) of each virtual stage (v = chunk * PP + pp_rank in the loop; see stage_location)."""
    return [stage_location(v, pp, placement) for v in range(pp * (vp or 1))]


def expected_rank_tensors(config: TransformerConfig, counts: list[int], pp_rank: int, placement: str = "loop"
                          ) -> dict[str, tuple[ParamSpec, str, Optional[int]]]:
    """key -> (spec, unit, global layer index) of every tensor in a (tp, pp_rank) file, in file order.

    ``counts[v]`` = layers of virtual stage v. ``unit`` is "embedding", "layer", "head" or
    "tied_output" (the last stage's copy of a tied embedding). ``placement``: where the chunks sit
    ("v" for a checkpoint trained with zb-v / dualpipev).
    """
    pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    out: dict[str, tuple[ParamSpec, str, Optional[int]]] = {}
    last = pp * vp - 1
    for chunk in range(vp):
        v = virtual_stage(pp_rank, chunk, pp, placement)
        if v == 0:
            for name, spec in embedding_specs(config).items():
                out[f"model{chunk}.{name}"] = (spec, "embedding", None)
        start = sum(counts[:v])
        for j in range(counts[v]):
            for name, spec in layer_specs(config).items():
                out[f"model{chunk}.decoder.layers.{j}.{name}"] = (spec, "layer", start + j)
        if v == last:
            for name, spec in head_specs(config).items():
                out[f"model{chunk}.{name}"] = (spec, "head", None)
            if not config.untie_embeddings_and_output_weights and v != 0:
                spec = embedding_specs(config)["embedding.word_embeddings.weight"]
                out[f"model{chunk}.output_layer.weight"] = (spec, "tied_output", None)
    return out


def _read_splits(f: Any, path: str) -> dict[str, str]:
    """A shard file's ``tensor_parallel_splits`` header entry: {tensor name: "partition_dim,stride"}."""
    raw = (f.metadata() or {}).get("tensor_parallel_splits", "{}")
    try:
        splits = json.loads(raw)
    except (ValueError, RecursionError):
        splits = None
    if not isinstance(splits, dict) or not all(isinstance(v, str) for v in splits.values()):
        raise ConversionError(f"{path}: its tensor_parallel_splits metadata is not a JSON object of "
                              f"'partition_dim,stride' strings: {raw[:60]!r}")
    return splits


class Parallel3dLoader:
    """Units of a parallel3d checkpoint (the latest iteration under ``load_dir``)."""

    def __init__(self, load_dir: str):
        try:
            iteration, self.ckpt_dir, meta = open_checkpoint(load_dir)
            ckpt = self.ckpt_dir
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
        self.iteration, self.extra = iteration, dict(meta.get("extra") or {})
        self.args = meta.get("args")  # the training run's arguments (its tokenizer); None for a conversion
        layout = meta["layout"]
        tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
        vp = layout.get("virtual_pipeline_model_parallel_size")
        self.config = config = config_from_metadata(meta.get("model_config"), ckpt)
        have = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                config.virtual_pipeline_model_parallel_size)
        if have != (tp, pp, vp):
            raise ConversionError(f"{ckpt}: the layout (TP={tp}, PP={pp}, V={vp}) disagrees with its model_config "
                                  f"(TP={have[0]}, PP={have[1]}, V={have[2]})")
        self.dtype = config.params_dtype

        expected = {rank_dir_name(t, p) for t in range(tp) for p in range(pp)}
        present = {d for d in os.listdir(ckpt) if d.startswith("mp_rank_")}
        try:  # a symlink leaving the checkpoint is refused before anything about its target is looked at
            shard_paths = {d: confined_path(ckpt, f"{d}/{MODEL_FILE}") for d in expected}
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
        missing = sorted(d for d in expected if not os.path.isfile(shard_paths[d]))
        if missing:
            raise ConversionError(f"{ckpt}: missing shard file(s) {[os.path.join(d, MODEL_FILE) for d in missing]} "
                                  f"of the saved layout TP={tp} x PP={pp}")
        extra = sorted(present - expected)
        if extra:
            raise ConversionError(f"{ckpt}: shard directories {extra} do not belong to the saved layout "
                                  f"TP={tp} x PP={pp}")

        self._stack = contextlib.ExitStack()
        self._files: dict[tuple[int, int], Any] = {}
        self._splits: dict[tuple[int, int], dict[str, str]] = {}
        try:
            for t in range(tp):
                for p in range(pp):
                    try:  # its checksum first: a converter must not spread flipped bits into a new checkpoint
                        path = check_file(ckpt, meta, f"{rank_dir_name(t, p)}/{MODEL_FILE}", tp_rank=t, pp_rank=p)
                    except CheckpointError as e:
                        raise ConversionError(str(e)) from e
                    try:
                        f = self._stack.enter_context(safe_open(path, framework="pt"))
                    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
                        raise ConversionError(f"cannot read {path}: {e}") from e
                    self._files[t, p] = f
                    try:
                        check_shard_header(path, f.metadata(), meta, t, p)
                    except CheckpointError as e:
                        raise ConversionError(str(e)) from e
                    self._splits[t, p] = _read_splits(f, path)
            self.placement = self._placement(saved_split(meta, pp))
            self._counts = self._layer_counts()
            self._check_files()
            self._check_layer_numbers(meta.get("layer_numbers"))
        except BaseException:
            self._stack.close()
            raise
        # global layer -> (pp_rank, chunk, local index)
        self._where: dict[int, tuple[int, int, int]] = {}
        for v, (p, c) in enumerate(virtual_stage_owner(pp, vp, self.placement)):
            start = sum(self._counts[:v])
            for j in range(self._counts[v]):
                self._where[start + j] = (p, c, j)

    @staticmethod
    def _placement(split: Optional[list]) -> str:
        """Where the chunks sit: the loop, or the V of zb-v / dualpipev (from metadata's layer_numbers)."""
        try:
            return stage_order(split)[0] if split is not None else "loop"
        except ValueError:
            return "loop"  # layer_numbers in no order: _check_layer_numbers names the disagreement

    # ---------------------------------------------------------------- checks
    def _layer_counts(self) -> list[int]:
        cfg = self.config
        pp, vp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
        counts = []
        for p, c in virtual_stage_owner(pp, vp, self.placement):
            local = set()
            for key in self._files[0, p].keys():
                m = _LAYER_KEY.match(key)
                if m and int(m.group(1)) == c:
                    local.add(int(m.group(2)))
            counts.append(len(local))
        if sum(counts) != cfg.num_layers:
            raise ConversionError(f"{self.ckpt_dir}: the shard files hold {sum(counts)} layers (per virtual stage: "
                                  f"{counts}) but the model config says num_layers={cfg.num_layers}")
        return counts

    def _check_files(self) -> None:
        cfg = self.config
        for (t, p), f in self._files.items():
            where = os.path.join(self.ckpt_dir, rank_dir_name(t, p), MODEL_FILE)
            want = expected_rank_tensors(cfg, self._counts, p, self.placement)
            keys = set(f.keys())
            missing = [k for k in want if k not in keys]
            extra = sorted(k for k in keys - set(want) if not is_fp8_state_key(k))  # FP8 scales: not weights
            if missing or extra:
                raise ConversionError(f"{where}: " + "; ".join(
                    ([f"missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}"] if missing else [])
                    + ([f"unexpected tensors {extra[:6]}{' ...' if len(extra) > 6 else ''}"] if extra else [])))
            splits = self._splits[t, p]
            for key, (spec, _, _) in want.items():
                sl = f.get_slice(key)
                shape = tuple(sl.get_shape())
                if shape != spec.shard_shape(cfg):
                    raise ConversionError(f"{where}: {key} has shape {shape}, the model config implies "
                                          f"{spec.shard_shape(cfg)} at TP={cfg.tensor_model_parallel_size}")
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype != cfg.params_dtype:
                    raise ConversionError(f"{where}: {key} is {sl.get_dtype()}, the model config says "
                                          f"params_dtype={cfg.params_dtype}")
                if cfg.tensor_model_parallel_size > 1 and splits.get(key) != spec.split:
                    raise ConversionError(f"{where}: {key} is recorded as split {splits.get(key)!r} "
                                          f"(partition_dim,stride), expected {spec.split!r}")

    def _check_layer_numbers(self, recorded: Any) -> None:
        """Where metadata lists the layers ([pp][chunk], or chunk-wise for pipeline rank 0), they must agree."""
        cfg = self.config
        pp, vp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
        found = [[[] for _ in range(vp)] for _ in range(pp)]
        start = 0
        for v, (p, c) in enumerate(virtual_stage_owner(pp, vp, self.placement)):
            found[p][c] = list(range(start, start + self._counts[v]))
            start += self._counts[v]
        if not isinstance(recorded, list) or not recorded:
            return
        if all(isinstance(r, list) and r and all(isinstance(c, list) for c in r) for r in recorded):
            ok = recorded == found
        else:
            ok = recorded == found[0]
        if not ok:
            raise ConversionError(f"{self.ckpt_dir}: {METADATA_FILE} records layer_numbers {recorded}, but the shard "
                                  f"files hold {found}")

    # ---------------------------------------------------------------- units
    def _read(self, p: int, key: str, spec: ParamSpec) -> torch.Tensor:
        tp = self.config.tensor_model_parallel_size
        if spec.partition_dim is None:
            return self._files[0, p].get_tensor(key)
        return merge([self._files[t, p].get_tensor(key) for t in range(tp)], spec, self.config)

    def embedding(self) -> dict[str, torch.Tensor]:
        return {name: self._read(0, f"model0.{name}", spec) for name, spec in embedding_specs(self.config).items()}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        p, c, j = self._where[index]
        return {name: self._read(p, f"model{c}.decoder.layers.{j}.{name}", spec)
                for name, spec in layer_specs(self.config).items()}

    def head(self) -> dict[str, torch.Tensor]:
        cfg = self.config
        pp, vp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
        p, c = stage_location(pp * vp - 1, pp, self.placement)
        return {name: self._read(p, f"model{c}.{name}", spec) for name, spec in head_specs(cfg).items()}

    def close(self) -> None:
        self._stack.close()


class Parallel3dSaver:
    """Writes a parallel3d checkpoint of ``config``'s layout under ``out_dir`` as units arrive."""

    def __init__(self, out_dir: str, config: TransformerConfig, iteration: int, extra: dict[str, Any]):
        self.out_dir, self.config, self.iteration, self.extra = out_dir, config, iteration, extra
        pp, vp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
        self.partition = partition_layers(config.num_layers, pp, vp or 1,
                                          layers_per_stage=config.layers_per_virtual_stage())
        counts = config.layers_per_virtual_stage()
        self.ckpt_dir = iteration_dir(out_dir, iteration)
        dtype = config.params_dtype
        # unit -> canonical name -> [(tp_rank, pp_rank, key, spec)]: every place a canonical tensor goes
        self._places: dict[Any, dict[str, list[tuple[int, int, str, ParamSpec]]]] = {}
        self._writers: dict[tuple[int, int], StreamingSafetensorsWriter] = {}
        try:
            for p in range(pp):
                want = expected_rank_tensors(config, counts, p)
                for t in range(config.tensor_model_parallel_size):
                    rdir = os.path.join(self.ckpt_dir, rank_dir_name(t, p))
                    os.makedirs(rdir)
                    entries = {k: (dtype, spec.shard_shape(config)) for k, (spec, _, _) in want.items()}
                    splits = {k: spec.split for k, (spec, _, _) in want.items() if spec.split is not None}
                    self._writers[t, p] = StreamingSafetensorsWriter(
                        os.path.join(rdir, MODEL_FILE), entries,
                        metadata={"tensor_parallel_splits": json.dumps(splits), "format_version": str(FORMAT_VERSION),
                                  "tp_rank": str(t), "pp_rank": str(p)})
                    for key, (spec, unit, index) in want.items():
                        name = key.split(".", 1)[1]  # drop "model{chunk}."
                        if unit == "layer":
                            unit, name = ("layer", index), name.split(".", 3)[3]  # drop "decoder.layers.{j}."
                        elif unit == "tied_output":
                            unit, name = "embedding", "embedding.word_embeddings.weight"
                        self._places.setdefault(unit, {}).setdefault(name, []).append((t, p, key, spec))
        except BaseException:
            self.abort()
            raise

    def _write(self, unit: Any, tensors: dict[str, torch.Tensor]) -> None:
        for name, places in self._places.get(unit, {}).items():
            full = tensors[name].to(self.config.params_dtype)
            current = None  # one TP shard at a time
            for t, p, key, spec in sorted(places, key=lambda x: x[0]):
                if current is None or current[0] != t:
                    current = (t, shard(full, spec, self.config, t))
                self._writers[t, p].write(key, current[1])

    def embedding(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("embedding", tensors)

    def layer(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        self._write(("layer", index), tensors)

    def head(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("head", tensors)

    def finish(self) -> None:
        files = {}  # the file records save_checkpoint keeps, so loads and tools verify converted checkpoints too
        for (t, p), w in self._writers.items():
            digest = w.close()
            files[f"{rank_dir_name(t, p)}/{MODEL_FILE}"] = {"sha256": digest, "bytes": os.path.getsize(w.path),
                                                            "tp_rank": t, "pp_rank": p, "dp_rank": 0}
        cfg = self.config
        meta = {
            "format_version": FORMAT_VERSION,
            "iteration": self.iteration,
            "layout": {"tensor_model_parallel_size": cfg.tensor_model_parallel_size,
                       "pipeline_model_parallel_size": cfg.pipeline_model_parallel_size,
                       "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_model_parallel_size,
                       "data_parallel_size": 1},
            "world_size": cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size,
            "model_config": _to_jsonable(cfg),
            "layer_numbers": [[list(r) for r in chunks] for chunks in self.partition],
            "args": None,
            "extra": _to_jsonable(self.extra),
            FILES_KEY: files,
        }
        write_metadata(self.ckpt_dir, meta)
        for sub in os.listdir(self.ckpt_dir):
            _fsync_dir(os.path.join(self.ckpt_dir, sub))
        _fsync_dir(self.ckpt_dir)
        _atomic_write_text(os.path.join(self.out_dir, LATEST_FILE), str(self.iteration))

    def abort(self) -> None:
        for w in self._writers.values():
            w.abort()
