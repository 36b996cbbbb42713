#!/usr/bin/env python3
"""Convert checkpoints: Hugging Face GPT-2 / LLaMA and Megatron-LM <-> parallel3d, and parallel3d between layouts.

    python tools/convert_checkpoint.py --loader hf --saver parallel3d --load-dir llama-hf \\
        --save-dir ckpt --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/convert_checkpoint.py --loader parallel3d --saver parallel3d --load-dir ckpt \\
        --save-dir ckpt-tp4 --target-tensor-parallel-size 4 --target-pipeline-parallel-size 1
    python tools/convert_checkpoint.py --loader parallel3d --saver hf --load-dir ckpt --save-dir out-hf
    python tools/convert_checkpoint.py --model-type GPT --loader megatron --saver parallel3d \\
        --load-dir megatron-ckpt --save-dir ckpt --target-tensor-parallel-size 2
    python tools/convert_checkpoint.py --model-type GPT --loader parallel3d --saver megatron \\
        --load-dir ckpt --save-dir megatron-ckpt --target-pipeline-parallel-size 2

(Megatron's tools/checkpoint/convert.py arguments.) ``hf`` reads a local directory
(config.json + model.safetensors / pytorch_model.bin, sharded or not) of a GPT2LMHeadModel
or LlamaForCausalLM and writes one ``from_pretrained`` loads. ``parallel3d`` reads the latest
iteration of a checkpoint (keeping its iteration number; an HF import is iteration 0) and
writes one for the target TP / PP / virtual PP; optimizer and RNG state are not converted,
so train on from a converted checkpoint with ``--no-load-optim --no-load-rng``.
``megatron`` reads a Megatron-LM checkpoint (a --save directory, legacy ``torch`` or ``torch_dist``
format, any TP / PP / virtual PP; its saved args give the model) and writes Megatron's legacy
format for the target layout (Megatron-LM loads it with ``--ckpt-format torch --transformer-impl
local --no-load-optim --no-load-rng``), or ``torch_dist`` with ``--ckpt-format torch_dist``
(tools/checkpoint/megatron*.py).

Memory: the model streams through one unit at a time (the embedding, one transformer
layer, the head), read lazily from memory-mapped files and written straight to the target
files at their offsets. Peak memory is about three copies of the largest unit (the full
unit as read, its re-laid-out copy, one TP shard of a tensor), e.g. ~3 x vocab x hidden x 4
bytes for an fp32 embedding: never the whole model.

Safety: the output is written into a temporary directory beside --save-dir and renamed into
place only when complete; a --save-dir that exists and is not empty is refused unless
--overwrite is given (it is then replaced as a whole; tools/checkpoint/save_dir.py says what it never replaces).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Callable, Optional, Sequence

if __package__ in (None, ""):
    # run as a script: make the repo importable without installing it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from parallel3d.bootstrap import reexec_unless_ready  # noqa: E402
    reexec_unless_ready(__file__)  # this Python lacks torch & co: run inside .venv, as the demo does

import torch  # noqa: E402

from parallel3d.progress import make_bar  # noqa: E402

from parallel3d.models.config import TransformerConfig  # noqa: E402
from parallel3d.training.checkpointing import _fsync_dir  # noqa: E402
from parallel3d.tools.checkpoint.hf import HfLoader, HfSaver  # noqa: E402
from parallel3d.tools.checkpoint.megatron import SAVERS, MegatronLoader, MegatronSaver, known_args  # noqa: E402
from parallel3d.tools.checkpoint.parallel3d_format import Parallel3dLoader, Parallel3dSaver  # noqa: E402
from parallel3d.tools.checkpoint.save_dir import check_save_dir  # noqa: E402
from parallel3d.tools.checkpoint.schema import ConversionError, check_unit, embedding_specs, head_specs, layer_specs  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ["hf", "parallel3d", "megatron"]
# Megatron's convert.py names for Megatron-Core checkpoints, read and written by --loader/--saver megatron
MEGATRON_ALIASES = {"mcore": "megatron", "core": "megatron"}


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", choices=["GPT"], default="GPT",
                   help="Megatron's model type: GPT (LLaMA-style models included) is the one converted")
    p.add_argument("--loader", required=True, choices=FORMATS + sorted(MEGATRON_ALIASES),
                   help="format of --load-dir (mcore, core: megatron)")
    p.add_argument("--saver", required=True, choices=FORMATS + sorted(MEGATRON_ALIASES),
                   help="format to write to --save-dir (mcore, core: megatron)")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-virtual-pipeline-parallel-size", type=int, default=None)
    p.add_argument("--target-params-dtype", choices=sorted(DTYPES), default=None,
                   help="default: the source's dtype")
    p.add_argument("--ckpt-format", choices=sorted(SAVERS), default=None,
                   help="--saver megatron: Megatron-LM's checkpoint format to write (default torch, the legacy one)")
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="--loader megatron: the tokenizer's vocabulary, where the saved args record only the "
                        "padded one (the padding rows are dropped)")
    p.add_argument("--megatron-path", default=None,
                   help="accepted from Megatron's command lines; unused: no Megatron code is imported")
    p.add_argument("--loader-transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="--loader megatron reads either layer naming, whichever the checkpoint has")
    p.add_argument("--saver-transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="--saver megatron writes the local layers' names (transformer_engine: refused, untested)")
    p.add_argument("--overwrite", action="store_true", help="replace a --save-dir that already has content")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return p.parse_args(argv)


def target_config(source: TransformerConfig, tp: int, pp: int, vp: Optional[int],
                  dtype: torch.dtype) -> TransformerConfig:
    """The source model under the target layout and dtype; the config's checks name an impossible layout."""
    fields = {f: getattr(source, f) for f in source.__dataclass_fields__}
    fields.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  virtual_pipeline_model_parallel_size=vp, num_layers_in_first_pipeline_stage=None,
                  num_layers_in_last_pipeline_stage=None, sequence_parallel=False, params_dtype=dtype,
                  bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    try:
        config = TransformerConfig(**fields)
        config.layers_per_virtual_stage()  # the converter writes Megatron's even split: it must exist
        return config
    except ValueError as e:
        raise ConversionError(f"the target layout TP={tp}, PP={pp}, virtual PP={vp} is impossible for this model: "
                              f"{e}") from e


def _install(tmp: str, save_dir: str) -> None:
    """Move the finished output into place; an older --save-dir is swapped out first, then removed."""
    parent = os.path.dirname(os.path.abspath(save_dir))
    old = None
    if os.path.exists(save_dir):
        old = tempfile.mkdtemp(prefix=".old-" + os.path.basename(save_dir) + "-", dir=parent)
        os.rmdir(old)
        os.replace(save_dir, old)
    os.replace(tmp, save_dir)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old)


def convert(loader: str, saver: str, load_dir: str, save_dir: str, *, target_tensor_parallel_size: int = 1,
            target_pipeline_parallel_size: int = 1, target_virtual_pipeline_parallel_size: Optional[int] = None,
            target_params_dtype: Optional[str] = None, overwrite: bool = False,
            progress: Optional[Callable[[str], None]] = None, model_type: str = "GPT",
            true_vocab_size: Optional[int] = None, ckpt_format: Optional[str] = None) -> str:
    """Convert ``load_dir`` into ``save_dir``; returns ``save_dir``. Raises ConversionError on bad input."""
    tp, pp, vp = target_tensor_parallel_size, target_pipeline_parallel_size, target_virtual_pipeline_parallel_size
    if loader not in FORMATS or saver not in FORMATS:
        raise ConversionError(f"--loader/--saver must be one of {FORMATS}, got {loader!r} / {saver!r}")
    if model_type != "GPT":
        raise ConversionError(f"--model-type {model_type!r} is not supported: GPT is the model converted")
    if true_vocab_size is not None and (loader != "megatron" or true_vocab_size < 1):
        raise ConversionError(f"--true-vocab-size {true_vocab_size} applies to --loader megatron, as a size >= 1")
    if ckpt_format is not None and (saver != "megatron" or ckpt_format not in SAVERS):
        raise ConversionError(f"--ckpt-format {ckpt_format} applies to --saver megatron, as one of {sorted(SAVERS)}")
    if tp < 1 or pp < 1 or (vp is not None and vp < 1):
        raise ConversionError(f"target sizes must be >= 1, got TP={tp}, PP={pp}, virtual PP={vp}")
    if saver == "hf" and (tp, pp, vp) != (1, 1, None):
        raise ConversionError(f"--saver hf writes one unsharded model: the target TP={tp}, PP={pp}, virtual PP={vp} "
                              "options apply to --saver parallel3d only")
    if vp == 1:
        vp = None  # one chunk per stage: Megatron's "no virtual pipeline"
    if target_params_dtype is not None and target_params_dtype not in DTYPES:
        raise ConversionError(f"--target-params-dtype must be one of {sorted(DTYPES)}, got {target_params_dtype!r}")
    check_save_dir(load_dir, save_dir, overwrite)

    if loader == "megatron":
        source = MegatronLoader(load_dir, true_vocab_size)
    else:
        source = HfLoader(load_dir) if loader == "hf" else Parallel3dLoader(load_dir)
    tmp = None
    try:
        dtype = DTYPES[target_params_dtype] if target_params_dtype else source.dtype
        config = target_config(source.config, tp, pp, vp, dtype)
        parent = os.path.dirname(os.path.abspath(save_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(os.path.abspath(save_dir)) + "-", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become --save-dir's mode
        if saver == "hf":
            target = HfSaver(tmp, config, source.extra.get("hf_config"), getattr(source, "args", None))
        elif saver == "megatron":
            target = MegatronSaver(ckpt_format or "torch", tmp, config, source.iteration, known_args(source))
        else:
            target = Parallel3dSaver(tmp, config, source.iteration, source.extra)
        try:
            say = progress or (lambda _msg: None)
            tensors = source.embedding()
            check_unit("embedding", tensors, embedding_specs(source.config))
            target.embedding(tensors)
            del tensors
            say("embedding")
            for i in range(config.num_layers):
                tensors = source.layer(i)
                check_unit(f"layer {i}", tensors, layer_specs(source.config))
                target.layer(i, tensors)
                del tensors
                say(f"layer {i + 1}/{config.num_layers}")
            tensors = source.head()
            check_unit("head", tensors, head_specs(source.config))
            target.head(tensors)
            del tensors
            say("head")
            target.finish()
        except BaseException:
            target.abort()
            raise
        source.close()
        _install(tmp, save_dir)
        tmp = None
    finally:
        source.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return save_dir


class UnitProgress:
    """convert()'s progress callback: a bar over the units on a terminal, "converted ..." lines elsewhere.

    The unit count (layers + embedding + head) is learned from the first "layer i/N" message."""

    def __init__(self) -> None:
        self.bar = make_bar(None, "converting", unit="unit")

    def __call__(self, msg: str) -> None:
        if self.bar is None:
            print(f"converted {msg}", flush=True)
            return
        if self.bar.total is None and msg.startswith("layer ") and "/" in msg:
            self.bar.total = int(msg.rsplit("/", 1)[1]) + 2
        self.bar.set_postfix_str(msg, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    args.loader, args.saver = (MEGATRON_ALIASES.get(x, x) for x in (args.loader, args.saver))
    if args.saver == "megatron" and args.saver_transformer_impl != "local":
        print("error: --saver-transformer-impl transformer_engine is not supported (Transformer Engine's layer names "
              "are untested here): write --saver-transformer-impl local and run Megatron-LM with --transformer-impl "
              "local", file=sys.stderr, flush=True)
        return 2
    say = (lambda _msg: None) if args.quiet else UnitProgress()
    try:
        convert(args.loader, args.saver, args.load_dir, args.save_dir,
                target_tensor_parallel_size=args.target_tensor_parallel_size,
                target_pipeline_parallel_size=args.target_pipeline_parallel_size,
                target_virtual_pipeline_parallel_size=args.target_virtual_pipeline_parallel_size,
                target_params_dtype=args.target_params_dtype, overwrite=args.overwrite, progress=say,
                model_type=args.model_type, true_vocab_size=args.true_vocab_size, ckpt_format=args.ckpt_format)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        getattr(say, "close", lambda: None)()
    if not args.quiet:
        print(f"wrote {args.saver} checkpoint to {args.save_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
