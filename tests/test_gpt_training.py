"""GPT training end to end: every layout trains exactly like one process; resume is exact.

The reference is the same ``pretrain`` (parallel3d.training.gpt's model, forward
step and loss) run in this pytest process with world size 1; one launch of 8
gloo processes then trains the same model, seed and data under TP/SP/PP/VPP/DP
mixes (both families, ZeRO-1 in some) and compares the per-iteration losses,
the gradient norms and every weight after 3 Adam steps.
"""
import functools
import importlib
import io
import os
import subprocess
import sys
from contextlib import redirect_stderr

import pytest
import torch

from gpt_harness import FAMILIES, ROOT, assert_trains_like, full_weights, layout_args, train
from parallel3d.training import checkpointing, gpt
from parallel3d.training.arguments import parse_args
from parallel3d.training.checkpoint_args import apply_checkpoint_args
from parallel3d.tools import generate as generate_tool
from parallel3d.tools.convert_checkpoint import convert
from safetensors.torch import load_file
from parallel3d import parallel_state as ps
from parallel3d.testing import run_distributed

# (family, TP, PP, V, SP, extra flags); world size 8, DP = 8 / (TP * PP)
LAYOUTS = [
    ("gpt2", 2, 2, 2, False, []),
    ("gpt2", 2, 2, 1, True, ["--use-distributed-optimizer"]),
    ("gpt2", 1, 4, 2, False, []),
    ("gpt2", 4, 1, 1, True, []),
    ("gpt2", 1, 1, 1, False, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    ("llama", 2, 2, 2, True, ["--overlap-grad-reduce"]),
    # every loss_mask is 1 and microbatches are equal: the per-token average is the per-microbatch one
    ("llama", 1, 2, 2, False, ["--use-distributed-optimizer", "--calculate-per-token-loss"]),
    ("llama", 2, 4, 1, False, []),
]


# Zero-bubble schedules (tests/test_pipeline.py sweeps them against more layouts without DDP):
# TP+SP, DP overlap, ZeRO-1, tied embeddings (gpt2; on one rank in the V), recompute.
ZB_LAYOUTS = [
    ("gpt2", 2, 2, 1, True, ["--pipeline-schedule", "zb-h1", "--overlap-grad-reduce", "--use-distributed-optimizer"]),
    ("gpt2", 1, 2, 2, False, ["--pipeline-schedule", "zb-v", "--overlap-grad-reduce", "--recompute-granularity", "full",
                              "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ("llama", 2, 2, 2, True, ["--pipeline-schedule", "dualpipev", "--use-distributed-optimizer"]),
    ("gpt2", 1, 2, 2, False, ["--pipeline-schedule", "auto"]),  # over two chunks: a V-shaped pick
    ("llama", 1, 4, 1, False, ["--pipeline-schedule", "zb-h2", "--recompute-granularity", "full",
                               "--recompute-method", "uniform", "--recompute-num-layers", "1", "--overlap-grad-reduce",
                               "--pipeline-model-parallel-layout", "Ettt|tt|tt|tL"]),
]

# --compile (each layer through torch.compile, the TP linears eager) with TP+SP, PP, V, a zero-bubble
# schedule, recompute, DP overlap and ZeRO-1, on 4 ranks (DP=2): compiling is the costly part, every rank
# compiles, and --compile changes the layers only (how layouts combine is the eager sweeps' business).
# aot_eager traces the same graphs Inductor would get (its graph breaks, the linears' autograd, the hooks)
# in seconds; test_compiled_layers_with_inductor runs Inductor's generated code on one process.
_AOT = ["--compile", "--compile-backend", "aot_eager"]
COMPILE_LAYOUTS = [
    ("llama", 2, 1, 1, True, _AOT + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1", "--overlap-grad-reduce",
                                     "--use-distributed-optimizer"]),
    ("gpt2", 1, 2, 2, False, _AOT + ["--pipeline-schedule", "zb-v", "--overlap-grad-reduce",
                                     "--use-distributed-optimizer"]),
]


@functools.lru_cache(maxsize=None)  # the sweeps below share them: one run per family per pytest process
def _reference(family):
    result = train(layout_args(family))
    return result["losses"], result["grad_norms"], full_weights(result)


def _sweep(rank, world_size, refs, layouts=LAYOUTS, adjust=None):
    """Every layout against the single-process ``refs``; ``adjust(args)``, where given, sets fields after the
    arguments' validation (what this machine cannot validate, e.g. CUDA graphs on CPU ranks)."""
    done = []
    for family, tp, pp, vp, sp, extra in layouts:
        args = layout_args(family, tp, pp, vp, sp, extra, world=world_size)
        if adjust is not None:
            adjust(args)
        ps.initialize_model_parallel(tp, pp, args.virtual_pipeline_model_parallel_size)
        where = f"[{family} TP={tp} PP={pp} V={vp} SP={sp} {' '.join(extra)}]"
        try:
            assert_trains_like(train(args), refs[family], where)
        finally:
            ps.destroy_model_parallel()
        done.append(where)
    return done


def test_gpt_layouts_train_like_a_single_process():
    refs = {family: _reference(family) for family in FAMILIES}
    results = run_distributed(_sweep, 8, args=(refs,), timeout=600)
    assert all(len(r) == len(LAYOUTS) for r in results)


def test_zero_bubble_schedules_train_like_a_single_process():
    refs = {family: _reference(family) for family in FAMILIES}
    results = run_distributed(_sweep, 8, args=(refs, ZB_LAYOUTS), timeout=600)
    assert all(len(r) == len(ZB_LAYOUTS) for r in results)


GROUPED = ("llama", 1, 2, 2, False, ["--microbatch-group-size-per-virtual-pipeline-stage", "3"])  # 8 microbatches


def _grouped_sweep(rank, world_size, refs):
    """GROUPED against one process, recording the group size each schedule was built with."""
    import importlib

    fb = importlib.import_module("parallel3d.pipeline.forward_backward")

    built, build = [], fb.build_schedule

    def recording(*args, **kwargs):
        built.append(kwargs.get("microbatch_group_size_per_vp_stage"))
        return build(*args, **kwargs)

    fb.build_schedule = recording  # this worker process only
    fb._checked_schedule.cache_clear()
    return _sweep(rank, world_size, refs, [GROUPED]), built


def test_the_interleaved_schedule_groups_microbatches_as_the_flag_says():
    """Megatron's --microbatch-group-size-per-virtual-pipeline-stage reaches the interleaved schedule (3
    microbatches per chunk in a row, not PP = 2) and training still equals one process."""
    results = run_distributed(_grouped_sweep, 2, args=({"llama": _reference("llama")},), timeout=300)
    for done, built in results:
        assert len(done) == 1 and built and set(built) == {3}, built


def test_compiled_layers_train_like_a_single_process():
    refs = {family: _reference(family) for family in FAMILIES}
    results = run_distributed(_sweep, 4, args=(refs, COMPILE_LAYOUTS), timeout=600)
    assert all(len(r) == len(COMPILE_LAYOUTS) for r in results)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_layers_with_inductor(family):
    """Inductor's code for every layer, dropout on: the same losses, norms and weights as eager.

    Dropout draws eager's random numbers under --compile (models/block.py), so the masks agree too."""
    runs = [train(layout_args(family, extra=extra, dropout=0.1)) for extra in ([], ["--compile"])]
    (eager, compiled) = runs
    assert [d["lm loss"] for d in compiled["losses"]] == pytest.approx([d["lm loss"] for d in eager["losses"]],
                                                                       rel=1e-5, abs=1e-5)
    assert compiled["grad_norms"] == pytest.approx(eager["grad_norms"], rel=1e-5, abs=1e-5)
    want = full_weights(eager)
    for name, got in full_weights(compiled).items():
        err = (got - want[name]).abs().max().item()
        assert err <= 2e-5, f"{family} {name} differs from eager by {err:.3g}"
    layer = compiled["model"][0].module.decoder.layers[0]
    assert layer._compiled_call_impl is not None, "--compile did not compile the layers"


def test_the_parallel_linears_stay_eager_in_a_compiled_model_without_dynamo_at_import():
    """Each parallel linear is a graph break with its forward run eagerly (tensor_parallel.utils.eager),
    whether the model ran eagerly before or is compiled first; importing the training application loads
    no Dynamo (seconds of every rank's start)."""
    probe = "import sys, parallel3d.training, parallel3d.models; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "False", (out.stdout, out.stderr[-2000:])
    import torch._dynamo
    from parallel3d.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ColumnParallelLinear(16, 32, gather_output=False)
            self.b = RowParallelLinear(32, 16, input_is_parallel=True)

        def forward(self, x):
            return self.b(self.a(x.relu())[0].sin())[0].cos()

    x = torch.randn(4, 16)
    for eager_first in (True, False):
        net = Net()
        if eager_first:
            net(x)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(net)(x)
        reasons = [str(b.reason) for b in explained.break_reasons]
        assert explained.graph_break_count == 2 and all("disable()" in r for r in reasons), reasons
        torch.testing.assert_close(torch.compile(net, backend="aot_eager")(x), net(x))
    torch._dynamo.reset()


def test_gradient_accumulation_fusion_trains_as_without_it():
    """The fused weight gradients (the linears' GEMMs and the untied embedding's rows, into main_grad) train
    as the plain ones do, and the embedding takes the fused path; the tied embedding (gpt2) keeps autograd's."""
    for family in FAMILIES:
        fused, plain = (train(layout_args(family, extra=extra)) for extra in ([], ["--no-gradient-accumulation-fusion"]))
        assert_trains_like(fused, (plain["losses"], plain["grad_norms"], full_weights(plain)), f"{family} fused")
        weight = fused["model"][0].module.embedding.word_embeddings.weight
        assert fused["model"][0].module.embedding.word_embeddings.gradient_accumulation_fusion
        assert getattr(weight, "zero_out_wgrad", False) == (family == "gpt2")


# ---------------------------------------------------------------- checkpoints


def _resume(rank, world_size, save_dir):
    extra = ["--use-distributed-optimizer"]
    out = {}
    for name, load in (("straight", None), ("first", None), ("resumed", save_dir)):
        args = layout_args("gpt2", 1, 2, 2, False, extra, world=world_size, iters=6, dropout=0.1)
        if name == "first":  # a job of 6 iterations stopped after 3 (same LR schedule as the straight run)
            args.save, args.save_interval, args.exit_interval = save_dir, 3, 3
        if load:
            args.load = load
        ps.initialize_model_parallel(1, 2, 2)
        try:
            result = train(args)
            out[name] = [d["lm loss"] for d in result["losses"]]
        finally:
            ps.destroy_model_parallel()
    return out


def test_resume_is_exact(tmp_path):
    """6 iterations straight equal 3, save, resume, 3 more: loss by loss (dropout on, ZeRO-1, PP=2 V=2, DP=2)."""
    results = run_distributed(_resume, 4, args=(str(tmp_path / "ckpt"),), timeout=300)
    for r in results:
        assert r["first"] == r["straight"][:3]
        assert r["resumed"] == r["straight"][3:], (r["resumed"], r["straight"])
    assert (tmp_path / "ckpt" / checkpointing.LATEST_FILE).read_text() == "3"


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    args = layout_args("gpt2", iters=2)
    result = train(args)
    model, opt, sched = result["model"], result["optimizer"], result["scheduler"]
    save_dir = str(tmp_path)
    checkpointing.save_checkpoint(save_dir, 2, model, opt, sched, extra={"consumed_train_samples": 32})
    before = {n: p.detach().clone() for n, p in model[0].named_parameters()}

    real_replace = os.replace

    def killed_at_rename(src, dst):
        if src.endswith(".tmp") and os.path.isdir(src):
            raise KeyboardInterrupt("killed before the rename")
        return real_replace(src, dst)

    with torch.no_grad():
        for p in model[0].parameters():
            p.add_(1.0)
    monkeypatch.setattr(os, "replace", killed_at_rename)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save_checkpoint(save_dir, 4, model, opt, sched)
    monkeypatch.setattr(os, "replace", real_replace)
    assert checkpointing.read_latest_iteration(save_dir) == 2
    iteration, meta = checkpointing.load_checkpoint(save_dir, model, opt, sched)
    assert iteration == 2 and meta["extra"]["consumed_train_samples"] == 32
    for n, p in model[0].named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    # the next save of that iteration succeeds over the debris
    checkpointing.save_checkpoint(save_dir, 4, model, opt, sched)
    assert checkpointing.read_latest_iteration(save_dir) == 4


def test_checkpoint_errors_name_the_problem(tmp_path):
    args = layout_args("gpt2", iters=2)
    result = train(args)
    model = result["model"]
    save_dir = str(tmp_path)
    checkpointing.save_checkpoint(save_dir, 1, model, model_config=gpt.transformer_config_from_args(args))
    other = gpt.transformer_config_from_args(layout_args("llama"))
    with pytest.raises(checkpointing.CheckpointError, match="holds another model: num_layers|holds another model"):
        checkpointing.load_checkpoint(save_dir, model, model_config=other)
    os.remove(os.path.join(save_dir, "iter_0000001", "mp_rank_00_000", "model.safetensors"))
    with pytest.raises(checkpointing.CheckpointError, match="missing shard .*mp_rank_00_000"):
        checkpointing.load_checkpoint(save_dir, model)
    with open(os.path.join(save_dir, checkpointing.LATEST_FILE), "w") as f:
        f.write("garbage")
    with pytest.raises(checkpointing.CheckpointError, match="corrupt"):
        checkpointing.load_checkpoint(save_dir, model)
    with pytest.raises(checkpointing.CheckpointError, match="does not exist"):
        checkpointing.load_checkpoint(str(tmp_path / "nowhere"), model)


# ---------------------------------------------------------------- bad arguments


def _main_error(argv, world_size, monkeypatch):
    """examples/pretrain_gpt.py's main() itself: its exit status and message."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    pretrain_gpt = importlib.import_module("pretrain_gpt")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as info:
        pretrain_gpt.main(argv)
    assert info.value.code == 2
    return err.getvalue()


@pytest.mark.parametrize("argv,world,message", [
    (["--tensor-model-parallel-size", "3"], 4, r"world size \(4\) is not divisible by --tensor-model-parallel-size \(3\)"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "4", "--pipeline-split", "even"], 4,
     r"num_layers \(6\) is not divisible by .* = 4: no even split \(--pipeline-split even\)"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "4"], 4, r"3 layers cannot fill 4 virtual stages"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"], 1, r"--global-batch-size \(10\) is not divisible"),
    (["--num-attention-heads", "6", "--tensor-model-parallel-size", "4"], 4, r"num_attention_heads \(6\)"),
    (["--data-path", "/nonexistent/corpus_text_document"], 1, r"missing file /nonexistent/corpus_text_document.idx"),
])
def test_bad_arguments_exit_with_a_clear_message(argv, world, message, monkeypatch):
    import re

    text = _main_error(argv, world, monkeypatch)
    assert re.search(message, text), text


def test_data_dtype_too_small_for_the_vocabulary(tmp_path, monkeypatch):
    import numpy as np

    from parallel3d.data import IndexedDatasetBuilder

    prefix = str(tmp_path / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint8)
    builder.add_document([1, 2, 3], [3])
    builder.finalize(prefix + ".idx")
    text = _main_error(["--data-path", prefix, "--vocab-size", "300"], 1, monkeypatch)
    assert "tokens are stored as uint8, which cannot hold the tokenizer's vocabulary of 300" in text


def test_every_rank_reports_a_bad_layout():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--monitor-interval", "5",  # every rank prints before torchrun stops the group after the first exit
           os.path.join(ROOT, "examples", "pretrain_gpt.py"), "--pipeline-model-parallel-size", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert proc.stderr.count("error: world size (2) is not divisible") == 1, proc.stderr[-2000:]  # rank 0's
    assert "exitcode  : 2" in proc.stderr and 'pretrain_gpt.py", line' not in proc.stderr  # no worker traceback


def _other_split(rank, world_size, save_dir):
    ps.initialize_model_parallel(1, 2)
    try:
        args = layout_args("gpt2", 1, 2, extra=["--pipeline-split", "even"], world=world_size, iters=4)
        args.save, args.save_interval, args.exit_interval = save_dir, 2, 2
        train(args)  # layers 0-3 | 4-7
        args = layout_args("gpt2", 1, 2, extra=["--pipeline-model-parallel-layout", "Ettttt|tttL"],
                           world=world_size, iters=4)
        args.load = save_dir
        try:
            train(args)
        except checkpointing.CheckpointError as e:
            refused = str(e)
        else:
            refused = None
        args = layout_args("gpt2", 1, 2, extra=["--pipeline-model-parallel-layout", "Etttt|ttttL"],
                           world=world_size, iters=4)
        args.load = save_dir
        resumed = train(args)["losses"]  # the layout the error names resumes
        argv = ["--load", save_dir, "--use-checkpoint-args", "--pipeline-model-parallel-size", "7"]
        args = parse_args(argv, extra_args_provider=gpt.add_sampling_args)
        apply_checkpoint_args(args)
        # generation builds the chunks with the layers they were trained with (here 5 | 3, not 4 | 4)
        uneven = layout_args("gpt2", 1, 2, extra=["--pipeline-model-parallel-layout", "Ettttt|tttL"],
                             world=world_size, iters=2)
        uneven.save, uneven.save_interval = save_dir + "_uneven", 2
        train(uneven)
        chunks, _ = generate_tool.load_model(uneven.save)
        return (refused, len(resumed), (args.pipeline_model_parallel_size, args.pipeline_model_parallel_layout),
                [c.layer_numbers for c in chunks])
    finally:
        ps.destroy_model_parallel()


def test_a_run_that_splits_the_layers_otherwise_is_refused_with_the_layout_that_resumes(tmp_path):
    results = run_distributed(_other_split, 2, args=(str(tmp_path / "ckpt"),), timeout=300)
    for rank, (refused, resumed, layout, generation_layers) in enumerate(results):  # each rank refuses, naming the fix
        assert refused is not None, f"rank {rank} loaded a checkpoint of another layer split"
        assert "splits the layers over the pipeline stages otherwise than this run" in refused
        assert f"pipeline rank {rank} holds layers {'0-4' if rank == 0 else '5-7'}, the checkpoint's " \
               f"{'0-3' if rank == 0 else '4-7'}" in refused
        assert refused.endswith("--pipeline-model-parallel-layout 'Etttt|ttttL'")
        assert resumed == 2  # iterations 3 and 4
        assert layout == (2, "Etttt|ttttL")  # --use-checkpoint-args takes the saved split with the layout
        assert generation_layers == [range(0, 5) if rank == 0 else range(5, 8)]


def _pp2_save(rank, world_size, save_dir, vp, extra):
    ps.initialize_model_parallel(1, 2, vp)
    try:
        args = layout_args("gpt2", 1, 2, vp, extra=extra, world=world_size, iters=2)
        args.save, args.save_interval = save_dir, 2
        train(args)
    finally:
        ps.destroy_model_parallel()


THREE_LAYERS = ["--num-layers", "3"]


@pytest.mark.parametrize("vp,extra,reference", [
    # ZB-V puts rank 0's second chunk at the end of the model; the converter reads that placement.
    (2, ["--pipeline-schedule", "zb-v"], []),
    # A layer total the stages do not divide, placed by a layout (Megatron's): 1 + 2 layers.
    (None, THREE_LAYERS + ["--pipeline-model-parallel-layout", "Et|ttL"], THREE_LAYERS),
], ids=["zb-v", "3-layers-by-layout"])
def test_a_pipeline_checkpoint_converts_to_one_stage_and_equals_one_process(tmp_path, vp, extra, reference):
    run_distributed(_pp2_save, 2, args=(str(tmp_path / "pp2"), vp, extra), timeout=300)
    convert("parallel3d", "parallel3d", str(tmp_path / "pp2"), str(tmp_path / "one"))
    args = layout_args("gpt2", extra=reference, iters=2)  # the same training on one process
    args.save, args.save_interval = str(tmp_path / "ref"), 2
    train(args)
    shard = os.path.join("iter_0000002", checkpointing.rank_dir_name(0, 0), "model.safetensors")
    got, want = load_file(str(tmp_path / "one" / shard)), load_file(str(tmp_path / "ref" / shard))
    assert sorted(got) == sorted(want)
    for name in want:  # a layer in the wrong place would differ by the weights' own size, not 1e-5
        assert (got[name] - want[name]).abs().max().item() <= 2e-5, name
