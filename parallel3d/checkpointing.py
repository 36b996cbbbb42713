"""Checkpoints: one safetensors file per (TP, PP) rank, saved atomically, resumed exactly.

Layout (Megatron's directory names, so its tools find their way around):

    SAVE/
      latest_checkpointed_iteration.txt       the last COMPLETE iteration, written last
      iter_0000100/
        metadata.json                         layout, model config, iteration, args
        mp_rank_{tp:02d}_{pp:03d}/
          model.safetensors                   this rank's shards of every model chunk,
                                              keys "model{chunk}.{parameter name}"; the
                                              file's metadata holds each tensor's TP split
          optimizer.pt                        optimizer + LR scheduler + grad scaler state
        rng/rank_{global:05d}.pt              RNG states of every rank

Atomicity: every rank writes into ``iter_XXXXXXX.tmp``; after a barrier rank 0
writes the metadata, fsyncs, renames the directory into place, and only then
rewrites ``latest_checkpointed_iteration.txt`` (through a temporary file and a
rename). A save killed at any point leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, is_dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from parallel3d import parallel_state
from parallel3d.tensor_parallel import get_cuda_rng_tracker

LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def rank_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _to_jsonable(x: Any) -> Any:
    if is_dataclass(x):
        x = asdict(x)
    if isinstance(x, dict):
        return {str(k): _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def model_state_for_save(chunks: Sequence[torch.nn.Module]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flat {"model{c}.{name}": tensor} of this rank's shards, and each tensor's TP split."""
    tensors, splits = {}, {}
    for c, chunk in enumerate(chunks):
        module = _unwrap(chunk)
        params = dict(module.named_parameters())
        for name, t in module.state_dict().items():
            if t is None:
                continue
            key = f"model{c}.{name}"
            tensors[key] = t.detach().to("cpu").contiguous().clone()
            p = params.get(name)
            if p is not None and getattr(p, "tensor_model_parallel", False):
                splits[key] = f"{p.partition_dim},{p.partition_stride}"
    return tensors, splits


def get_rng_state() -> dict[str, Any]:
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> dict[str, Any]:
    if not parallel_state.model_parallel_is_initialized():
        return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 1}
    st = parallel_state.get_parallel_state()
    return {"tensor_model_parallel_size": st.tensor_model_parallel_size,
            "pipeline_model_parallel_size": st.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": st.virtual_pipeline_model_parallel_size,
            "data_parallel_size": st.data_parallel_size}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: Sequence[torch.nn.Module],
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    *,
    model_config: Any = None,
    args: Any = None,
    extra: Optional[dict[str, Any]] = None,
    layer_numbers: Optional[Sequence[Sequence[Sequence[int]]]] = None,
) -> str:
    """Save everything needed to resume exactly; returns the checkpoint directory.

    Collective over all ranks. ``extra`` (e.g. consumed samples) goes into the
    metadata. ``layer_numbers[pp_rank][chunk]`` = the global layer indices of every model chunk
    (rank 0 writes the metadata, so pass the whole table; tools check it against the shard files).
    """
    rank = _global_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # debris of an earlier interrupted save of this iteration
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()

    # Optimizer state may need every DP rank (ZeRO-1 gathers its shards): call it everywhere.
    opt_state = optimizer.state_dict() if optimizer is not None else None
    if dp_rank == 0:
        rdir = os.path.join(tmp, rank_dir_name(tp_rank, pp_rank))
        os.makedirs(rdir, exist_ok=True)
        tensors, splits = model_state_for_save(model)
        path = os.path.join(rdir, "model.safetensors")
        save_file(tensors, path, metadata={"tensor_parallel_splits": json.dumps(splits),
                                           "format_version": str(FORMAT_VERSION)})
        _fsync_file(path)
        state = {"optimizer": opt_state,
                 "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler else None}
        path = os.path.join(rdir, "optimizer.pt")
        torch.save(state, path)
        _fsync_file(path)
    path = os.path.join(tmp, "rng", f"rank_{rank:05d}.pt")
    torch.save(get_rng_state(), path)
    _fsync_file(path)
    _barrier()

    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "layout": _layout(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "model_config": _to_jsonable(model_config),
            "layer_numbers": _to_jsonable(layer_numbers),
            "args": _to_jsonable(vars(args) if hasattr(args, "__dict__") else args),
            "extra": _to_jsonable(extra or {}),
        }
        meta_path = os.path.join(tmp, METADATA_FILE)
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for sub in os.listdir(tmp):
            if os.path.isdir(os.path.join(tmp, sub)):
                _fsync_dir(os.path.join(tmp, sub))
        _fsync_dir(tmp)
        old = None
        if os.path.exists(final):  # saving the same iteration again: swap, never a moment without it
            old = final + ".old"
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(save_dir)
        _atomic_write_text(os.path.join(save_dir, LATEST_FILE), str(iteration))
        if old is not None:
            shutil.rmtree(old)
    _barrier()
    return final


def read_latest_iteration(load_dir: str) -> Optional[int]:
    """The last complete iteration under ``load_dir``, or None when there is no checkpoint."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load directory {load_dir!r} does not exist")
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} is corrupt: expected an iteration number, found {text[:40]!r}")
    return int(text)


def read_metadata(ckpt_dir: str) -> dict[str, Any]:
    path = os.path.join(ckpt_dir, METADATA_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{ckpt_dir} is not a complete checkpoint: {METADATA_FILE} is missing")
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')} is not {FORMAT_VERSION}")
    return meta


def check_compatible(meta: dict[str, Any], model_config: Any, ckpt_dir: str) -> None:
    """Refuse a checkpoint of another layout or another model, naming the difference."""
    have, want = meta["layout"], _layout()
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
        if have.get(key) != want.get(key):
            raise CheckpointError(
                f"{ckpt_dir} was saved with {key}={have.get(key)} but this run has {want.get(key)}; "
                "convert it first: python tools/convert_checkpoint.py --loader parallel3d --saver parallel3d "
                "--target-tensor-parallel-size ... --target-pipeline-parallel-size ..."
            )
    if model_config is None or not meta.get("model_config"):
        return
    saved, current = meta["model_config"], _to_jsonable(model_config)
    arch = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
            "vocab_size", "normalization", "position_embedding_type", "gated_linear_unit", "add_bias_linear",
            "untie_embeddings_and_output_weights", "kv_channels")
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
             for k in arch if k in saved and k in current and saved[k] != current[k]]
    if diffs:
        raise CheckpointError(f"{ckpt_dir} holds another model: " + "; ".join(diffs))


def load_model_shards(ckpt_dir: str, tp_rank: int, pp_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = os.path.join(ckpt_dir, rank_dir_name(tp_rank, pp_rank), "model.safetensors")
    if not os.path.exists(path):
        raise CheckpointError(f"missing shard {path} (tp_rank={tp_rank}, pp_rank={pp_rank})")
    try:
        with safe_open(path, framework="pt") as f:
            splits = json.loads((f.metadata() or {}).get("tensor_parallel_splits", "{}"))
            return {k: f.get_tensor(k) for k in f.keys()}, splits
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise CheckpointError(f"cannot read {path}: {e}") from e


def load_model_state(chunks: Sequence[torch.nn.Module], tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy shards into the model chunks; every key and shape must match."""
    expected = set()
    for c, chunk in enumerate(chunks):
        module = _unwrap(chunk)
        own = module.state_dict()
        expected |= {f"model{c}.{k}" for k in own}
        sub = {}
        for name, t in own.items():
            key = f"model{c}.{name}"
            if key not in tensors:
                raise CheckpointError(f"{where}: missing tensor {key}")
            if tuple(tensors[key].shape) != tuple(t.shape):
                raise CheckpointError(f"{where}: {key} has shape {tuple(tensors[key].shape)}, "
                                      f"the model expects {tuple(t.shape)}")
            sub[name] = tensors[key]
        module.load_state_dict(sub, strict=True)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise CheckpointError(f"{where}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}")


def load_checkpoint(
    load_dir: str,
    model: Sequence[torch.nn.Module],
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    *,
    model_config: Any = None,
    iteration: Optional[int] = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Load the latest (or given) iteration; returns (iteration, metadata). (0, {}) if none exists."""
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            return 0, {}
    ckpt_dir = iteration_dir(load_dir, iteration)
    meta = read_metadata(ckpt_dir)
    check_compatible(meta, model_config, ckpt_dir)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tensors, _ = load_model_shards(ckpt_dir, tp_rank, pp_rank)
    load_model_state(model, tensors, ckpt_dir)
    if optimizer is not None and load_optimizer:
        path = os.path.join(ckpt_dir, rank_dir_name(tp_rank, pp_rank), "optimizer.pt")
        if not os.path.exists(path):
            raise CheckpointError(f"missing optimizer state {path}")
        state = torch.load(path, map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        if opt_param_scheduler is not None and state.get("opt_param_scheduler") is not None:
            opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        path = os.path.join(ckpt_dir, "rng", f"rank_{_global_rank():05d}.pt")
        if not os.path.exists(path):
            raise CheckpointError(f"missing RNG state {path} (saved with fewer ranks, e.g. a smaller data-parallel "
                                  "size?). Model and optimizer state do not depend on the data-parallel "
                                  "size: resume with --no-load-rng (fresh dropout RNG streams)")
        set_rng_state(torch.load(path, map_location="cpu", weights_only=False))
    _barrier()
    return iteration, meta
