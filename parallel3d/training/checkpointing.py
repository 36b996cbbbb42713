"""Checkpoints: one safetensors file per (TP, PP) rank, saved atomically, resumed exactly.

Layout (Megatron's directory names, so its tools find their way around):

    SAVE/
      latest_checkpointed_iteration.txt       the last COMPLETE iteration, written last
      iter_0000100/
        metadata.json                         layout, model config, iteration, args, file checksums
        metadata.json.sha256                  metadata.json's own checksum (checkpoint_metadata)
        mp_rank_{tp:02d}_{pp:03d}/
          model.safetensors                   this rank's shards of every model chunk,
                                              keys "model{chunk}.{parameter name}"; the
                                              file's metadata holds each tensor's TP split
          optimizer.pt                        optimizer + LR scheduler + grad scaler state
        rng/rank_{global:05d}.pt              RNG states of every rank

Atomicity: every rank writes into ``iter_XXXXXXX.tmp``; once every rank reports success
rank 0 writes the metadata, fsyncs, renames the directory into place, and only then
rewrites ``latest_checkpointed_iteration.txt`` (through a temporary file and a
rename). A save killed at any point leaves a loadable checkpoint: a re-save of an existing
iteration swaps the old copy to ``iter_XXXXXXX.old`` first, which a load uses (with a warning)
if killed between the two renames; the next save clears such debris. A save that cannot
write (ENOSPC, ...) removes its partial directory and raises CheckpointError on every rank.

Integrity (``checkpoint_integrity``): metadata.json records each file's SHA-256, size and
writer's (TP, PP, DP) rank; loads verify them and read ``.pt`` files with weights_only=True. Every file
is read only inside its iteration directory: a name with ``..`` or an absolute path, or a symlink
leaving the directory, is refused. ``SAVE/parallel3d_save.lock`` keeps a second job out while a run
saves (checkpoint_lock).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import asdict, is_dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open

from parallel3d import parallel_state
from parallel3d.collectives import all_ranks_ok
from parallel3d.training.checkpoint_layers import check_layer_split
from parallel3d.training.checkpoint_integrity import (
    FILES_KEY,
    CheckpointError,
    CheckpointWarning,
    check_file,
    check_save_dir_writable,
    check_shard_header,
    confined_path,  # noqa: F401 - part of this module's API (pretrain calls it)
    load_torch_file,
    safetensors_save_hashed,
    torch_save_hashed,
    verify_files,
    write_error,
    write_json,
)
from parallel3d.training.checkpoint_metadata import (  # noqa: F401 - this module's API too
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    find_checkpoint_dir,
    iteration_dir,
    open_checkpoint,
    read_latest_iteration,
    read_metadata,
    write_metadata,
)
from parallel3d.device import default_device
from parallel3d.model_chunk import unwrap
from parallel3d.tensor_parallel import get_cuda_rng_tracker
from parallel3d.tensor_parallel.fp8 import is_fp8_state_key

_DEBRIS = re.compile(r"^iter_\d+\.(tmp|old)$")


def rank_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


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
        module = unwrap(chunk)
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
        "cuda": torch.cuda.get_rng_state() if default_device().type == "cuda" else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> dict[str, Any]:
    st = parallel_state.resolve_parallel_state()
    return {"tensor_model_parallel_size": st.tensor_model_parallel_size,
            "pipeline_model_parallel_size": st.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": st.virtual_pipeline_model_parallel_size,
            "data_parallel_size": st.data_parallel_size}


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _all_ranks_ok(ok: bool) -> bool:
    return all_ranks_ok(ok, "the checkpoint save (every rank's files written?)")


def _clean_debris(save_dir: str) -> None:
    """Remove what killed saves left: ``iter_*.tmp`` and the tracker's temporary; a stranded ``iter_N.old`` (a
    re-save killed between its two renames) goes back to ``iter_N`` if that is missing, else is removed."""
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name == LATEST_FILE + ".tmp":
            os.remove(path)
        elif _DEBRIS.match(name) and (name.endswith(".tmp") or os.path.exists(path[:-len(".old")])):
            shutil.rmtree(path)
        elif _DEBRIS.match(name):
            os.replace(path, path[:-len(".old")])
    _fsync_dir(save_dir)


def _write_rank_files(tmp: str, model: Sequence[torch.nn.Module], opt_state: Any, opt_param_scheduler: Any,
                      ranks: dict[str, int]) -> None:
    """This rank's files, then their records (checksum, size, ranks) in ``checksums/rank_XXXXX.json``.

    A file that cannot be written (ENOSPC, EIO, EACCES; torch.save's "iostream error") raises a
    CheckpointError naming it."""
    records: dict[str, dict[str, Any]] = {}
    path = tmp
    try:
        if ranks["dp_rank"] == 0:
            rdir = rank_dir_name(ranks["tp_rank"], ranks["pp_rank"])
            os.makedirs(os.path.join(tmp, rdir), exist_ok=True)
            tensors, splits = model_state_for_save(model)
            rel = f"{rdir}/model.safetensors"
            path = os.path.join(tmp, rel)
            records[rel] = safetensors_save_hashed(path, tensors, {
                "tensor_parallel_splits": json.dumps(splits), "format_version": str(FORMAT_VERSION),
                "tp_rank": str(ranks["tp_rank"]), "pp_rank": str(ranks["pp_rank"])})
            del tensors
            state = {"optimizer": opt_state,
                     "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler else None}
            rel = f"{rdir}/optimizer.pt"
            path = os.path.join(tmp, rel)
            records[rel] = torch_save_hashed(state, path)
        rel = f"rng/rank_{ranks['rank']:05d}.pt"
        path = os.path.join(tmp, rel)
        records[rel] = torch_save_hashed(get_rng_state(), path)
        for record in records.values():
            record.update(ranks)
        path = os.path.join(tmp, "checksums", f"rank_{ranks['rank']:05d}.json")
        write_json(path, records)
    except (OSError, RuntimeError, ValueError) as e:
        raise write_error(path, e) from e


def _commit(save_dir: str, tmp: str, final: str, iteration: int, meta: dict[str, Any]) -> None:
    """Rank 0: gather the file records into the metadata, then move the directory and the tracker into place.

    An OSError raises a CheckpointError naming the step's file; the caller removes what is left of ``tmp``."""
    checksums = os.path.join(tmp, "checksums")
    path = os.path.join(tmp, METADATA_FILE)
    try:
        files: dict[str, Any] = {}
        for name in sorted(os.listdir(checksums)):
            with open(os.path.join(checksums, name)) as f:
                files.update(json.load(f))
        meta[FILES_KEY] = files
        write_metadata(tmp, meta)
        shutil.rmtree(checksums)
        for sub in os.listdir(tmp):
            if os.path.isdir(os.path.join(tmp, sub)):
                _fsync_dir(os.path.join(tmp, sub))
        _fsync_dir(tmp)
        old = None
        path = final
        if os.path.exists(final):  # a re-save: a load finds iter_N or, between these renames, iter_N.old
            old = final + ".old"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(save_dir)
        path = os.path.join(save_dir, LATEST_FILE)
        _atomic_write_text(path, str(iteration))
        if old is not None:
            shutil.rmtree(old)
    except OSError as e:
        raise write_error(path, e) from e


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
    A file that cannot be written raises CheckpointError on every rank and leaves no partial directory.
    """
    rank = _global_rank()
    st = parallel_state.resolve_parallel_state()
    ranks = {"tp_rank": st.tensor_model_parallel_rank, "pp_rank": st.pipeline_model_parallel_rank,
             "dp_rank": st.data_parallel_rank, "rank": rank}
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    error: Optional[CheckpointError] = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _clean_debris(save_dir)
            os.makedirs(os.path.join(tmp, "rng"))
            os.makedirs(os.path.join(tmp, "checksums"))
        except OSError as e:
            error = write_error(tmp, e)
    if not _all_ranks_ok(error is None):
        raise error or CheckpointError(f"cannot save {final}: rank 0 could not create {tmp} (see its error)")

    # Optimizer state may need every DP rank (ZeRO-1 gathers its shards): call it everywhere.
    opt_state = optimizer.state_dict() if optimizer is not None else None
    try:
        _write_rank_files(tmp, model, opt_state, opt_param_scheduler, ranks)
    except CheckpointError as e:
        error = e
    if not _all_ranks_ok(error is None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()  # nobody returns before the partial directory is gone
        raise error or CheckpointError(f"saving {final} failed on another rank (see its error); "
                                       f"the partial {tmp} was removed")

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
        try:
            _commit(save_dir, tmp, final, iteration, meta)
        except CheckpointError as e:
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
    if not _all_ranks_ok(error is None):
        raise error or CheckpointError(f"rank 0 could not complete {final} (see its error)")
    return final


def check_compatible(meta: dict[str, Any], model_config: Any, ckpt_dir: str) -> None:
    """Refuse a checkpoint of another layout or another model, naming the difference."""
    have, want = meta["layout"], _layout()
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
        if have.get(key) != want.get(key):
            raise CheckpointError(f"{ckpt_dir} was saved with {key}={have.get(key)} but this run has "
                                  f"{want.get(key)}; {_conversion_command(ckpt_dir, want)}")
    check = getattr(model_config, "checkpoint_mismatches", None)  # the model's own rule (model_chunk.py)
    diffs = check(meta["model_config"]) if check is not None and meta.get("model_config") else []
    if diffs:
        raise CheckpointError(f"{ckpt_dir} holds another model: " + "; ".join(diffs) + ". Give this run the "
                              "checkpoint's settings, or --use-checkpoint-args to take them from it")


def _conversion_command(ckpt_dir: str, want: dict[str, Any]) -> str:
    """The two steps that resume ``ckpt_dir`` in the layout ``want``, with this checkpoint's paths and sizes."""
    load = os.path.dirname(os.path.normpath(ckpt_dir))
    tp, pp, vp = (want.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                         "virtual_pipeline_model_parallel_size"))
    out = f"{load}_tp{tp}_pp{pp}" + (f"_vp{vp}" if vp else "")
    return (f"convert it: python3 tools/convert_checkpoint.py --loader parallel3d --saver parallel3d --load-dir {load} "
            f"--save-dir {out} --target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}"
            + (f" --target-virtual-pipeline-parallel-size {vp}" if vp else "")
            + f", then resume with --load {out} --no-load-optim --no-load-rng (the conversion keeps the weights and "
            "the iteration, not the optimizer or RNG state)")


def load_model_shards(ckpt_dir: str, tp_rank: int, pp_rank: int,
                      meta: Optional[dict[str, Any]] = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This (TP, PP) rank's tensors and their TP splits, after checking the file's checksum and ranks."""
    rel = f"{rank_dir_name(tp_rank, pp_rank)}/model.safetensors"
    path = confined_path(ckpt_dir, rel)
    if not os.path.exists(path):
        raise CheckpointError(f"missing shard {path} (tp_rank={tp_rank}, pp_rank={pp_rank})")
    meta = read_metadata(ckpt_dir) if meta is None else meta
    check_file(ckpt_dir, meta, rel, tp_rank=tp_rank, pp_rank=pp_rank)
    try:
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            splits = json.loads(header.get("tensor_parallel_splits", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise CheckpointError(f"cannot read {path}: {e}") from e
    check_shard_header(path, header, meta, tp_rank, pp_rank)
    return tensors, splits


def load_model_state(chunks: Sequence[torch.nn.Module], tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy shards into the model chunks; every key and shape must match. FP8 delayed-scaling state is
    the exception, with a warning: a run that turned FP8 delayed scaling on (or a converted checkpoint,
    which holds weights only) starts a fresh amax history, one that turned it off leaves it."""
    expected, fresh = set(), []
    for c, chunk in enumerate(chunks):
        module = unwrap(chunk)
        own = module.state_dict()
        expected |= {f"model{c}.{k}" for k in own}
        sub = {}
        for name, t in own.items():
            key = f"model{c}.{name}"
            if key not in tensors and is_fp8_state_key(name):
                fresh.append(key)
                sub[name] = t
                continue
            if key not in tensors:
                raise CheckpointError(f"{where}: missing tensor {key}")
            if tuple(tensors[key].shape) != tuple(t.shape):
                raise CheckpointError(f"{where}: {key} has shape {tuple(tensors[key].shape)}, "
                                      f"the model expects {tuple(t.shape)}")
            sub[name] = tensors[key]
        module.load_state_dict(sub, strict=True)
    unused = sorted(k for k in set(tensors) - expected if is_fp8_state_key(k))
    if fresh or unused:
        warnings.warn(f"{where}: " + (f"holds no FP8 delayed-scaling state for {len(fresh)} tensors ({fresh[0]} ...): "
                                      "their amax history starts afresh" if fresh else
                                      f"holds FP8 delayed-scaling state ({len(unused)} tensors) that this run, "
                                      "without --fp8-recipe delayed, does not use"), CheckpointWarning, stacklevel=2)
    extra = sorted(set(tensors) - expected - set(unused))
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
    """Load the latest (or given) iteration; returns (iteration, metadata). (0, {}) if none exists.

    Every file is verified against its recorded checksum first; every error is a CheckpointError naming the file.
    """
    if iteration is None and read_latest_iteration(load_dir) is None:
        return 0, {}
    iteration, ckpt_dir, meta = open_checkpoint(load_dir, iteration)
    check_compatible(meta, model_config, ckpt_dir)
    st = parallel_state.resolve_parallel_state()
    tp_rank, pp_rank = st.tensor_model_parallel_rank, st.pipeline_model_parallel_rank
    error = check_layer_split(ckpt_dir, meta, [unwrap(c) for c in model], pp_rank, st.pipeline_model_parallel_size)
    if error:
        raise CheckpointError(error)
    tensors, _ = load_model_shards(ckpt_dir, tp_rank, pp_rank, meta)
    load_model_state(model, tensors, ckpt_dir)
    if optimizer is not None and load_optimizer:
        rel = f"{rank_dir_name(tp_rank, pp_rank)}/optimizer.pt"
        path = confined_path(ckpt_dir, rel)
        if not os.path.exists(path):
            raise CheckpointError(f"missing optimizer state {path}")
        state = load_torch_file(check_file(ckpt_dir, meta, rel, tp_rank=tp_rank, pp_rank=pp_rank))
        try:
            optimizer.load_state_dict(state["optimizer"])
            if opt_param_scheduler is not None and state.get("opt_param_scheduler") is not None:
                opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
        except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as e:
            raise CheckpointError(f"{path} does not fit this optimizer or LR scheduler: "
                                  f"{type(e).__name__}: {e}") from e
    if load_rng:
        rel = f"rng/rank_{_global_rank():05d}.pt"
        path = confined_path(ckpt_dir, rel)
        recorded = meta.get(FILES_KEY)  # None: saved before file records were kept
        if not os.path.exists(path) and recorded is not None and not any(k.startswith("rng/") for k in recorded):
            raise CheckpointError(f"{ckpt_dir} holds no RNG state (written by tools/convert_checkpoint.py, or saved "
                                  "with --no-save-rng): resume with --no-load-rng (fresh dropout RNG streams)")
        if not os.path.exists(path):
            raise CheckpointError(f"missing RNG state {path} (saved with fewer ranks, e.g. a smaller data-parallel "
                                  "size?). Model and optimizer state do not depend on the data-parallel "
                                  "size: resume with --no-load-rng (fresh dropout RNG streams)")
        state = load_torch_file(check_file(ckpt_dir, meta, rel, rank=_global_rank()))
        try:
            set_rng_state(state)
        except (KeyError, TypeError, AttributeError, RuntimeError) as e:  # "Invalid mt19937 state"
            raise CheckpointError(f"{path} holds no valid RNG state: {type(e).__name__}: {e}") from e
    if dist.is_initialized():  # every rank has loaded before any goes on
        dist.barrier()
    return iteration, meta


def verify_checkpoint(load_dir: str, iteration: Optional[int] = None) -> tuple[str, list[str]]:
    """Check every file of one checkpoint (the latest, or ``iteration``): (its directory, one line per bad file).

    See ``checkpoint_integrity.verify_files``. Raises CheckpointError when not even the tracker or
    metadata.json can be read.
    """
    _, ckpt_dir, meta = open_checkpoint(load_dir, iteration)
    layout = meta["layout"]
    shards = [f"{rank_dir_name(t, p)}/model.safetensors" for t in range(layout["tensor_model_parallel_size"])
              for p in range(layout["pipeline_model_parallel_size"])]
    return ckpt_dir, verify_files(ckpt_dir, meta, shards)
