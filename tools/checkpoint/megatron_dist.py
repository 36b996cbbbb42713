"""Megatron-LM's ``torch_dist`` checkpoint format (Megatron-Core dist_checkpointing) as converter source and target.

An iteration directory holds ``.metadata`` (torch.distributed.checkpoint's pickled index of every
tensor's global shape and the chunks each rank wrote), the ``__{rank}_{n}.distcp`` data files,
``common.pt`` (args, iteration: megatron_files.safe_load) and ``metadata.json``. Tensors are
stored whole, whatever the layout that saved them: the vocabulary padded, QKV rows per query
group, SwiGLU's ``linear_fc1`` as [gate; up] of the whole model, and the layers of each
parameter stacked on a leading axis (``decoder.layers.mlp.linear_fc2.weight`` is
[num_layers, h, ffn]); the layer norms carry Transformer Engine's fused names.

The index is unpickled with an allow-list of torch.distributed.checkpoint's own metadata
classes, and each chunk with torch.load(weights_only=True), so no process group is needed and no
file can run code. A unit reads only the chunks that hold its layer. Optimizer state (the
``optimizer.*`` entries) and RNG state are not converted.

The saver writes the same files from one process, as units arrive: one data file to which every
layer's tensors are appended as a chunk of their stacked global tensor, the extra states
Megatron-Core lists (``[None]``, as its local layers save), then the index, ``common.pt`` and
``metadata.json``. The layout of the Megatron run that loads it is free (TP / PP / virtual PP),
as for any torch_dist checkpoint, except the vocabulary padding, which is the target TP's.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
from typing import Any, Optional

import torch

from parallel3d.models.config import TransformerConfig

from .megatron_files import (CHECKPOINT_VERSION, DIST_METADATA, FUSED_NORM_NAMES, LAYER_EXTRA_STATES,
                             args_from_config, config_from_args, fit_padded_vocab, iteration_dir_name, safe_load,
                             write_tracker)
from .schema import ConversionError, embedding_specs, head_specs, layer_specs

COMMON_FILE = "common.pt"
DATA_FILE = "__0_0.distcp"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
_META_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath"},  # StorageMeta's checkpoint_id
}
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's ``.metadata`` and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _META_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")


def read_dist_index(ckpt_dir: str) -> Any:
    path = os.path.join(ckpt_dir, DIST_METADATA)
    try:
        with open(path, "rb") as f:
            return _IndexUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ConversionError(f"{path}: refused to unpickle the distributed-checkpoint index: it holds an object "
                              f"outside torch.distributed.checkpoint's metadata classes ({e})") from None
    except (EOFError, OSError, AttributeError, TypeError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None


class MegatronDistLoader:
    """Units of the torch_dist checkpoint in ``ckpt_dir`` (one iteration directory)."""

    def __init__(self, ckpt_dir: str, iteration: Optional[int], vocab_size: Optional[int] = None):
        self.ckpt_dir = ckpt_dir
        backend = os.path.join(ckpt_dir, "metadata.json")
        if os.path.isfile(backend):
            with open(backend) as f:
                kind = json.load(f).get("sharded_backend")
            if kind not in (None, "torch_dist"):
                raise ConversionError(f"{backend}: sharded_backend {kind!r} is not supported (torch_dist only; "
                                      "zarr checkpoints: convert them to torch_dist with Megatron first)")
        self._index = read_dist_index(ckpt_dir)
        common_path = os.path.join(ckpt_dir, COMMON_FILE)
        common = safe_load(common_path)
        if not isinstance(common, dict):
            raise ConversionError(f"{common_path} holds a {type(common).__name__}, not Megatron's common state dict")
        self.args = common.get("args")
        self.config = config = config_from_args(self.args, common_path, vocab_size)
        self.iteration = iteration if iteration is not None else int(common.get("iteration") or 0)
        self.extra: dict[str, Any] = {}
        self._files: dict[str, Any] = {}
        # canonical layer name -> (fqn, stacked) or per-layer: (name, layer) -> fqn
        self._stacked: dict[str, str] = {}
        self._per_layer: dict[tuple[str, int], str] = {}
        self._plain: dict[str, str] = {}
        for fqn, md in self._index.state_dict_metadata.items():
            if not fqn.startswith(_MODEL_PREFIXES) or "._extra_state" in fqn or not hasattr(md, "chunks"):
                continue  # optimizer, RNG and rerun state, Transformer Engine's extra states
            m = _PER_LAYER.match(fqn)
            if m:
                self._per_layer[FUSED_NORM_NAMES.get(m.group(2), m.group(2)), int(m.group(1))] = fqn
            elif fqn.startswith("decoder.layers."):
                name = fqn[len("decoder.layers."):]
                self._stacked[FUSED_NORM_NAMES.get(name, name)] = fqn
            else:
                self._plain[fqn] = fqn
        if "embedding.word_embeddings.weight" in self._plain:
            rows = self._index.state_dict_metadata["embedding.word_embeddings.weight"].size[0]
            self.config = fit_padded_vocab(config, rows, os.path.join(ckpt_dir, DIST_METADATA))
        self._check()
        self.dtype = self._dtype("embedding.word_embeddings.weight")

    def _dtype(self, fqn: str) -> torch.dtype:
        return self._index.state_dict_metadata[fqn].properties.dtype

    def _check(self) -> None:
        cfg, where = self.config, os.path.join(self.ckpt_dir, DIST_METADATA)
        want = dict(layer_specs(cfg))
        have = set(self._stacked) | {n for n, _ in self._per_layer}
        extra = sorted(have - set(want))
        missing = sorted(n for n in want if n not in self._stacked and any(
            (n, i) not in self._per_layer for i in range(cfg.num_layers)))
        plain = {**embedding_specs(cfg), **head_specs(cfg)}
        tied_copy = {"output_layer.weight"} if not cfg.untie_embeddings_and_output_weights else set()
        extra += sorted(set(self._plain) - set(plain) - tied_copy)
        missing += [k for k in plain if k not in self._plain]
        if missing or extra:
            raise ConversionError(f"{where}: " + "; ".join(
                ([f"missing tensors {missing[:6]}"] if missing else [])
                + ([f"tensors this model does not have {extra[:6]}"] if extra else [])))
        for name, fqn in self._stacked.items():
            self._check_shape(fqn, (cfg.num_layers,) + want[name].shape)
        for (name, _), fqn in self._per_layer.items():
            self._check_shape(fqn, want[name].shape)
        for name, spec in plain.items():
            shape = (cfg.padded_vocab_size,) + spec.shape[1:] if spec.vocab else spec.shape
            self._check_shape(name, shape)

    def _check_shape(self, fqn: str, shape: tuple) -> None:
        size = tuple(self._index.state_dict_metadata[fqn].size)
        if size != tuple(shape):
            raise ConversionError(f"{os.path.join(self.ckpt_dir, DIST_METADATA)}: {fqn} has shape {size}, the model "
                                  f"of its args implies {tuple(shape)}")

    # ---------------------------------------------------------------- reading
    def _blob(self, fqn: str, offsets: Any) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._index.storage_data.get(MetadataIndex(fqn, torch.Size(offsets)))
        if info is None:
            raise ConversionError(f"{self.ckpt_dir}: the index lists a chunk of {fqn} at {tuple(offsets)} but no file "
                                  "holds it")
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{self.ckpt_dir}: {fqn} is stored with transforms {info.transform_descriptors} "
                                  "(compression): not supported")
        name = info.relative_path
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ConversionError(f"{self.ckpt_dir}: the index names data file {name!r} outside the checkpoint")
        if name not in self._files:
            self._files[name] = open(os.path.join(self.ckpt_dir, name), "rb")
        f = self._files[name]
        f.seek(info.offset)
        data = f.read(info.length)
        if len(data) != info.length:
            raise ConversionError(f"{os.path.join(self.ckpt_dir, name)} is truncated: {fqn} needs bytes "
                                  f"{info.offset}..{info.offset + info.length}")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged chunk: say which
            raise ConversionError(f"cannot read {fqn} from {os.path.join(self.ckpt_dir, name)}: {e}") from None

    def _read(self, fqn: str, layer: Optional[int] = None) -> torch.Tensor:
        """The whole tensor ``fqn`` (with ``layer``: that layer of a stacked one) from the chunks that hold it."""
        md = self._index.state_dict_metadata[fqn]
        shape = tuple(md.size) if layer is None else tuple(md.size)[1:]
        out = torch.empty(shape, dtype=md.properties.dtype)
        filled = 0
        for chunk in md.chunks:
            off, size = list(chunk.offsets), list(chunk.sizes)
            if layer is not None and not off[0] <= layer < off[0] + size[0]:
                continue
            part = self._blob(fqn, chunk.offsets)
            if not torch.is_tensor(part) or list(part.shape) != size:
                raise ConversionError(f"{self.ckpt_dir}: a chunk of {fqn} holds "
                                      f"{tuple(part.shape) if torch.is_tensor(part) else type(part).__name__}, "
                                      f"its index says {tuple(size)}")
            if layer is not None:
                part, off, size = part[layer - off[0]], off[1:], size[1:]
            out[tuple(slice(o, o + s) for o, s in zip(off, size))] = part
            filled += part.numel()
        if filled != out.numel():
            raise ConversionError(f"{self.ckpt_dir}: the chunks of {fqn}{'' if layer is None else f' (layer {layer})'} "
                                  f"cover {filled} of its {out.numel()} elements")
        return out

    def _plain_unit(self, specs: dict) -> dict[str, torch.Tensor]:
        out = {}
        for name, spec in specs.items():
            t = self._read(self._plain[name])
            out[name] = t.narrow(0, 0, self.config.vocab_size) if spec.vocab else t
        return out

    def embedding(self) -> dict[str, torch.Tensor]:
        return self._plain_unit(embedding_specs(self.config))

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return {name: self._read(self._stacked[name], index) if name in self._stacked
                else self._read(self._per_layer[name, index]) for name in layer_specs(self.config)}

    def head(self) -> dict[str, torch.Tensor]:
        return self._plain_unit(head_specs(self.config))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


class MegatronDistSaver:
    """Writes a torch_dist Megatron-LM checkpoint of ``config`` under ``out_dir`` as units arrive."""

    def __init__(self, out_dir: str, config: TransformerConfig, iteration: int, known_args: Optional[dict] = None):
        from torch.distributed.checkpoint.metadata import Metadata  # noqa: F401 - fail early where it is missing

        self.out_dir, self.config, self.iteration = out_dir, config, iteration
        self.args = args_from_config(config, iteration, known_args)
        self.args.ckpt_format, self.args.use_dist_ckpt = "torch_dist", True
        self.ckpt_dir = os.path.join(out_dir, iteration_dir_name(iteration))
        os.makedirs(self.ckpt_dir)
        self._data = open(os.path.join(self.ckpt_dir, DATA_FILE), "wb")
        self._tensors: dict[str, Any] = {}  # fqn -> TensorStorageMetadata
        self._storage: dict[Any, Any] = {}  # MetadataIndex -> _StorageInfo
        self._te_names = {canonical: fused for fused, canonical in FUSED_NORM_NAMES.items()}

    def _append(self, payload: bytes) -> tuple[int, int]:
        offset = self._data.tell()
        self._data.write(payload)
        return offset, len(payload)

    def _chunk(self, fqn: str, tensor: torch.Tensor, offsets: tuple, size: tuple) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                           TensorStorageMetadata)

        buf = io.BytesIO()
        torch.save(tensor.to(self.config.params_dtype).contiguous().clone(), buf)
        md = self._tensors.setdefault(fqn, TensorStorageMetadata(
            properties=TensorProperties(dtype=self.config.params_dtype), size=torch.Size(size), chunks=[]))
        md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(tensor.shape)))
        self._storage[MetadataIndex(fqn, torch.Size(offsets))] = _StorageInfo(DATA_FILE, *self._append(buf.getvalue()))

    def _object(self, fqn: str, obj: Any) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        buf = io.BytesIO()
        torch.save(obj, buf)
        self._tensors[fqn] = BytesStorageMetadata()
        self._storage[MetadataIndex(fqn)] = _StorageInfo(DATA_FILE, *self._append(buf.getvalue()))

    def _plain(self, tensors: dict[str, torch.Tensor], specs: dict) -> None:
        for name, spec in specs.items():
            t = tensors[name]
            if spec.vocab:  # Megatron's padded rows (zero)
                t = torch.cat([t, t.new_zeros(self.config.padded_vocab_size - t.shape[0], *t.shape[1:])])
            self._chunk(name, t, (0,) * t.dim(), tuple(t.shape))

    def embedding(self, tensors: dict[str, torch.Tensor]) -> None:
        self._plain(tensors, embedding_specs(self.config))

    def layer(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        layers = self.config.num_layers
        for name, spec in layer_specs(self.config).items():
            fqn = "decoder.layers." + self._te_names.get(name, name)
            self._chunk(fqn, tensors[name][None], (index,) + (0,) * len(spec.shape), (layers,) + spec.shape)
        for module in LAYER_EXTRA_STATES:
            self._object(f"decoder.layers.{module}._extra_state/shard_{index}_{layers}", [None])

    def head(self, tensors: dict[str, torch.Tensor]) -> None:
        self._plain(tensors, head_specs(self.config))

    def finish(self) -> None:
        from torch.distributed.checkpoint.metadata import Metadata

        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        files = {DIST_METADATA: lambda f: pickle.dump(Metadata(state_dict_metadata=self._tensors,
                                                               storage_data=self._storage), f),
                 COMMON_FILE: lambda f: torch.save({"args": self.args, "checkpoint_version": CHECKPOINT_VERSION,
                                                    "iteration": self.iteration}, f),
                 "metadata.json": lambda f: f.write(json.dumps(BACKEND).encode())}
        for name, write in files.items():
            with open(os.path.join(self.ckpt_dir, name), "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        write_tracker(self.out_dir, self.iteration)

    def abort(self) -> None:
        self._data.close()
