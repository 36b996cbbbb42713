#!/usr/bin/env python3
"""torchtitan as a benchmark peer: its own Trainer trains its Llama-3 model on one GPU with the
shapes of our presets, and this script prints one ``RESULT_JSON: {...}`` line like plain_gpt_bench.py.

    torchrun --standalone --nproc-per-node=1 bench/torchtitan_bench.py --preset llama-1b --iters 6 --warmup 2
    torchrun --standalone --nproc-per-node=1 bench/torchtitan_bench.py --preset llama-3b --float8 tensorwise
    torchrun --standalone --nproc-per-node=1 bench/torchtitan_bench.py --cpu-smoke     (no GPU: tiny, 2 steps)

Why torchtitan 0.2.2 and not 0.3.0: 0.3.0 is built against torch nightly. On torch 2.11 (the GPU
machine's) ``import torchtitan.trainer`` fails with ``ImportError: cannot import name
'DataParallelMeshDims' from 'torch.distributed.fsdp'`` (torchtitan/distributed/full_dtensor.py and
fsdp.py; fsdp.py also imports ``ShardPlacementResult`` from torch.distributed.fsdp._fully_shard.
_fsdp_common, and deepep/hybridep.py ``CustomClassBase`` from torch._library.opaque_object: none are
in torch 2.11). Every ``from torch... import`` of 0.2.2 resolves on torch 2.11.0+cu130.

What runs is what a torchtitan user runs: ``torchtitan.train.main(Trainer)`` with a job TOML
(written at run time next to the run's outputs, and printed), i.e. torchtitan's Trainer,
ConfigManager, llama3 ``Transformer`` (SDPA attention, GQA, RoPE theta 5e5, RMSNorm, SwiGLU, untied
output, no biases), ``parallelize_llama`` (``torch.compile`` of each TransformerBlock, fullgraph),
its compiled cross-entropy loss, fused AdamW (lr 1e-4, betas 0.9/0.95, wd 0.1), grad-norm clipping 1.0,
activation checkpointing off. On one GPU torchtitan applies no FSDP (dp_shard = 1), so mixed precision
is ``torch.autocast(bfloat16)`` around forward and loss with fp32 parameters, gradients and optimizer
state (``dist_utils.maybe_enable_amp``; logged as "Mixed precision training is handled by AMP") --
the nanoGPT recipe plain_gpt_bench.py uses. Ours, through torchtitan's ``experimental.custom_import``
hook (bench/titan_spec.py): the preset flavors and random tokens instead of C4 and a tokenizer.
The Trainer subclass below only times ``train_step`` (cuda-synchronized before and after, so a step
includes its 4 micro-batches, clipping, the optimizer step and torchtitan's per-step metrics log)
and records loss and memory.

``--float8 tensorwise|rowwise`` turns on torchtitan's float8 training as its users do: the model converter
``quantize.linear.float8`` (torchtitan 0.2.2's name; newer ones call it ``float8``) with
``[quantize.linear.float8] recipe_name``, which swaps every ``nn.Linear`` for torchao's ``Float8Linear``
(torchao's recipe of that name: tensorwise scales e4m3 activations and weights and e5m2 gradients,
rowwise scales e4m3 per row) under the same ``torch.compile``. ``filter_fqns = ["output"]`` keeps the
output layer in bf16 as torchtitan's own Llama-3 float8 configs do, and as parallel3d does. torchao is
installed from ``.whl/torchao-*.whl`` with the other wheels. ``--cpu-smoke --float8 R`` uses torchao's
emulation (no float8 GEMM on a CPU).

Numbers: ``iteration_time_s`` is the MEAN of the timed steps (after ``--warmup`` untimed ones) and
``tokens_per_s_per_gpu`` = global batch x seq_len / mean / world, as plain_gpt_bench.py computes them;
the median is reported too. ``peak_memory_gb`` is the largest ``torch.cuda.max_memory_allocated()``
of the run in GiB (read before torchtitan's metrics log resets the peak each step);
``max_reserved_gib`` is torchtitan's own "memory" figure (peak reserved, GiB).

The wheels travel in ``.whl/titan/`` (git-ignored); on first use they are installed with
``pip install --no-index --no-deps --target /tmp/titan_site``, and that folder and
``bench/titan_stubs`` (a stand-in for ``datasets``, which torchtitan imports but this run never calls)
go on this process's ``sys.path`` only.
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WHEELS = os.path.join(ROOT, ".whl", "titan")
STUBS = os.path.join(HERE, "titan_stubs")
TORCHAO_WHEELS = os.path.join(ROOT, ".whl", "torchao-*.whl")  # torchtitan's float8 needs it on the GPU machine
RESULT: dict[str, Any] = {}  # filled by TimedTrainer, printed after torchtitan's main() returns


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b", help="tiny, llama-1b or llama3-8b (bench/titan_spec.py)")
    p.add_argument("--iters", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens in step 1)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (global batch 16 at mb 4)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile model blocks and loss (default: on; off for --cpu-smoke)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--site", default=os.environ.get("TITAN_SITE", "/tmp/titan_site"))
    p.add_argument("--dump-folder", default=None, help="torchtitan's job.dump_folder (default: a temp dir)")
    p.add_argument("--float8", choices=("tensorwise", "rowwise"), default=None,
                   help="torchtitan's float8 converter with this torchao recipe (default: bf16 autocast only)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny preset, CPU + gloo, eager, 2 steps")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.preset, a.iters, a.warmup = "tiny", 2, 0
    if a.compile is None:
        a.compile = not a.cpu_smoke
    return a


def ensure_torchtitan(site: str) -> None:
    """Put torchtitan, its pure-Python dependencies and torchao (float8) on this process's path, installing
    the carried wheels into ``site`` once (a file lock keeps concurrent ranks from installing twice). Front
    of sys.path, before torch is imported, so tyro gets the typing_extensions it needs."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl"))) + sorted(glob.glob(TORCHAO_WHEELS))
    marker = os.path.join(site, ".installed")
    want = "\n".join(os.path.basename(w) for w in wheels)
    if wheels:
        os.makedirs(site, exist_ok=True)
        with open(site + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(marker) or open(marker).read() != want:
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                "--no-compile", "--no-cache-dir", "--upgrade", "--target", site, *wheels],
                               check=True)
                with open(marker, "w") as f:
                    f.write(want)
    for path in (STUBS, site):  # site ends up first
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
    if ROOT not in sys.path:  # parallel3d (titan_spec takes its model formulas), after the carried wheels
        sys.path.append(ROOT)
    if importlib.util.find_spec("torchtitan") is None:  # found, not imported: --cpu-smoke's shim comes first
        sys.exit(f"torchtitan not found; put its wheels in {WHEELS} (see bench/fetch_titan_wheels.sh)")


def write_toml(a: argparse.Namespace, seq_len: int, micro_batch: int, path: str) -> None:
    """The job config torchtitan reads (``--job.config_file``); every value that matters is explicit."""
    text = f"""# written by bench/torchtitan_bench.py
[job]
dump_folder = "{os.path.dirname(path)}"
description = "parallel3d peer benchmark: {a.preset}{', float8 ' + a.float8 if a.float8 else ''}"

[experimental]
custom_import = "titan_spec"

[model]
name = "llama3_bench"
flavor = "{a.preset}"
hf_assets_path = "{os.path.dirname(path)}"
converters = {'["quantize.linear.float8"]' if a.float8 else "[]"}
{float8_toml(a)}
[optimizer]
name = "AdamW"
lr = {a.lr}
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
weight_decay = 0.1
implementation = "fused"

[lr_scheduler]
warmup_steps = 0

[training]
local_batch_size = {micro_batch}
global_batch_size = {micro_batch * a.grad_accum * int(os.environ.get("WORLD_SIZE", "1"))}
seq_len = {seq_len}
steps = {a.warmup + a.iters}
max_norm = 1.0
dtype = "float32"
mixed_precision_param = "bfloat16"

[activation_checkpoint]
mode = "none"

[compile]
enable = {str(a.compile).lower()}
components = ["model", "loss"]
backend = "inductor"

[metrics]
log_freq = 1
enable_tensorboard = false

[checkpoint]
enable = false

[validation]
enable = false

[debug]
seed = 1234
"""
    with open(path, "w") as f:
        f.write(text)


def float8_toml(a: argparse.Namespace) -> str:
    """torchtitan's float8 table for ``--float8``; nothing otherwise."""
    if not a.float8:
        return ""
    return f"""
[quantize.linear.float8]
recipe_name = "{a.float8}"
filter_fqns = ["output"]
emulate = {str(a.cpu_smoke).lower()}
"""


def cpu_device_shim() -> None:
    """--cpu-smoke only: torchtitan 0.2.2 falls back to device "cuda" when no accelerator exists. Its
    tools/utils.py picks the device through torch._utils when torchtitan is first imported, so answer
    "cpu" (and a stand-in device module) for that import only. Never used on the GPU."""
    import torch._utils as tu

    assert "torchtitan.tools.utils" not in sys.modules, "the shim must precede torchtitan's import"
    props = types.SimpleNamespace(total_memory=64 * 2**30)
    shim = types.SimpleNamespace(
        set_device=lambda d: None, current_device=lambda: 0, get_device_name=lambda d=None: "cpu",
        get_device_properties=lambda d=None: props, reset_peak_memory_stats=lambda d=None: None,
        empty_cache=lambda: None, memory_stats=lambda d=None: {}, synchronize=lambda d=None: None,
        is_available=lambda: True, device_count=lambda: 1)
    saved = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type, tu._get_device_module = (lambda: "cpu"), (lambda t="cpu": shim)
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        tu._get_available_device_type, tu._get_device_module = saved


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    ensure_torchtitan(a.site)
    if a.float8 and importlib.util.find_spec("torchao") is None:
        sys.exit(f"--float8 needs torchao: carry its wheel as {TORCHAO_WHEELS}")
    dump = a.dump_folder or tempfile.mkdtemp(prefix=f"titan_{a.preset}_")
    os.makedirs(dump, exist_ok=True)
    toml = os.path.join(dump, "job_config.toml")  # written below, once the preset is known
    # ConfigManager.parse_args binds sys.argv[1:] as a default argument when torchtitan.config is first
    # imported (titan_spec imports it), so argv must be torchtitan's before that import.
    sys.argv = [sys.argv[0], "--job.config_file", toml]
    if a.cpu_smoke:
        cpu_device_shim()
    import titan_spec  # registers the llama3_bench TrainSpec (torchtitan imports it again: a no-op)

    if a.preset not in titan_spec.PRESETS:
        sys.exit(f"unknown preset {a.preset}; torchtitan presets: {', '.join(titan_spec.PRESETS)}")
    _, seq_len, mb = titan_spec.PRESETS[a.preset]
    mb = a.micro_batch_size or mb
    write_toml(a, seq_len, mb, toml)

    import torch
    import torchtitan
    import torchtitan.train as tt

    from parallel3d.planning.model import model_flops

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"torchtitan {torchtitan.__version__} ({os.path.dirname(torchtitan.__file__)}), "
              f"torch {torch.__version__}; job config {toml}:\n{open(toml).read()}", flush=True)
    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        sys.exit("CUDA not available: use --cpu-smoke")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class TimedTrainer(tt.Trainer):
        """torchtitan's Trainer, with each train_step timed and losses/peak memory recorded."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self.step_times: list[float] = []
            self.losses: list[float] = []
            self.peak_alloc = 0
            self.peak_reserved_gib = 0.0
            log = self.metrics_processor.log

            def log_and_record(step: int, global_avg_loss: float, *rest: Any, **kw: Any) -> None:
                self.losses.append(float(global_avg_loss))
                if cuda:  # torchtitan's log resets the peak counters: read them first
                    self.peak_alloc = max(self.peak_alloc, torch.cuda.max_memory_allocated())
                    self.peak_reserved_gib = max(
                        self.peak_reserved_gib, self.metrics_processor.device_memory_monitor
                        .get_peak_stats().max_reserved_gib)
                log(step, global_avg_loss, *rest, **kw)

            self.metrics_processor.log = log_and_record

        def train_step(self, data_iterator: Any) -> None:
            sync()
            t0 = time.perf_counter()
            super().train_step(data_iterator)
            sync()
            self.step_times.append(time.perf_counter() - t0)
            self.timed_end_unix = time.time()  # the clock window's end (bench/launch.py): the report comes later

        def close(self) -> None:
            self._report()
            super().close()

        def _report(self) -> None:
            if not self.step_times or RESULT:
                return
            cfg, args = self.job_config, self.model_args
            times = self.step_times[a.warmup:] or self.step_times
            world = int(os.environ.get("WORLD_SIZE", "1"))
            mean_t, med_t = statistics.fmean(times), statistics.median(times)
            gbs = cfg.training.global_batch_size
            spec = titan_spec.model_spec(args, seq_len)
            ffn, kv = spec.ffn, spec.query_groups
            n_params = sum(p.numel() for m in self.model_parts for p in m.parameters())
            flops = model_flops(spec, gbs)
            name = torch.cuda.get_device_name() if cuda else "cpu"
            RESULT.update(
                framework="torchtitan", torchtitan_version=torchtitan.__version__, torch_version=torch.__version__,
                device=name, world_size=world, compile=cfg.compile.enable, float8_recipe=a.float8,
                model_converters=list(cfg.model.converters),
                compile_components=list(cfg.compile.components) if cfg.compile.enable else [],
                mixed_precision="torch.autocast bf16, fp32 params (no FSDP at dp_shard=1)"
                if not self.parallel_dims.fsdp_enabled else "FSDP2 MixedPrecisionPolicy bf16",
                attention=args.attn_type, num_layers=args.n_layers, hidden_size=args.dim,
                num_attention_heads=args.n_heads, num_query_groups=kv, ffn_hidden_size=ffn, seq_length=seq_len,
                vocab_size=args.vocab_size, params_total=n_params, params_expected=spec.total_params(),
                micro_batch_size=cfg.training.local_batch_size, grad_accum=self.gradient_accumulation_steps,
                global_batch_size=gbs, warmup=a.warmup, iters=len(times), step_times_s=self.step_times,
                timed_end_unix=self.timed_end_unix,
                iteration_time_s=mean_t, iter_time_mean_s=mean_t, iter_time_median_s=med_t,
                tokens_per_s_per_gpu=gbs * seq_len / mean_t / world,
                tflops_per_gpu_megatron=flops / mean_t / world / 1e12,
                first_loss=self.losses[0] if self.losses else None, last_loss=self.losses[-1] if self.losses else None,
                peak_memory_gb=self.peak_alloc / 2**30 if cuda else None,
                max_mem_allocated_gib=self.peak_alloc / 2**30 if cuda else None,
                max_reserved_gib=self.peak_reserved_gib if cuda else None,
                peak_memory_source="torch.cuda.max_memory_allocated (GiB)")

    tt.main(TimedTrainer)
    if rank == 0:
        if not RESULT:
            sys.exit("torchtitan finished without timed steps")
        if RESULT["params_total"] != RESULT["params_expected"]:
            print(f"WARNING: {RESULT['params_total']:,} parameters built, {RESULT['params_expected']:,} "
                  f"expected for {a.preset}", flush=True)
        print(f"torchtitan {a.preset}: {RESULT['params_total'] / 1e9:.3f} B params | step "
              f"{RESULT['iteration_time_s'] * 1000:.1f} ms (mean) | {RESULT['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
              f" | loss {RESULT['first_loss']:.3f} -> {RESULT['last_loss']:.3f}", flush=True)
        print("RESULT_JSON: " + json.dumps(RESULT), flush=True)


if __name__ == "__main__":
    main()
