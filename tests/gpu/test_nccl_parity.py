"""The GPU suite: NCCL runs of every layout equal one GPU, resume is exact, and every job exits.

    python3 -m pytest -q tests/gpu          (README, "Tests"; docs/gpu-tests.md has the last run)

One process per GPU over NCCL, the fused kernels on (built once here, before any multi-process
launch). One launch of tests/gpu/parity_worker.py on one GPU trains the references (both families,
fp32 and bf16); one launch on 2 GPUs (and one on 4 where present) trains every layout of that size,
and each layout is its own test, compared with the reference of its family and precision:
- fp32: each iteration's loss and gradient norm within 1e-5 (relative above 1), every weight within
  2e-5, as the CPU sweep;
- bf16: each loss and gradient norm, and all of a rank's weights together (relative L2), within one
  bf16 step (2^-7, relative) of the one-GPU bf16 run: the most two computations can differ that
  agree up to rounding; docs/gpu-tests.md derives it.
With fewer GPUs the larger cases skip, naming the count; test_driver_on_cpu_ranks runs the 4-GPU
layouts through the same driver on 4 gloo CPU ranks, so those layouts are proven on every machine
(all but the CUDA-graph one: graphs need CUDA).
"""
import json
import os

import pytest
import torch

import torchrun

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
FAMILIES = ("gpt2", "llama")
DTYPES = ("fp32", "bf16")
BF16_STEP = 2.0 ** -7  # the spacing of bf16 numbers relative to their size (8 significant bits)
EXIT_LIMIT_S = 30.0

# name: (TP, PP, V, SP, extra flags); DP = GPUs / (TP x PP)
LAYOUTS = {
    2: {"tp2-sp": (2, 1, None, True, []),
        "pp2-1f1b": (1, 2, None, False, []),
        "pp2-v2": (1, 2, 2, False, []),
        "pp2-zbh1": (1, 2, None, False, ["--pipeline-schedule", "zb-h1"]),
        "pp2-zbv": (1, 2, 2, False, ["--pipeline-schedule", "zb-v", "--overlap-grad-reduce"]),
        "dp2-overlap": (1, 1, None, False, ["--overlap-grad-reduce"]),
        "dp2-zero1": (1, 1, None, False, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
        "tp2-sp-compile": (2, 1, None, True, ["--compile"]),  # Inductor's kernels beside the NCCL linears
        # the layers replayed as CUDA graphs from the second step (the fused wgrad's flag, the DDP hooks)
        "tp2-sp-graph": (2, 1, None, True, ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]),
        "dp2-overlap-graph": (1, 1, None, False, ["--overlap-grad-reduce", "--enable-cuda-graph",
                                                  "--cuda-graph-warmup-steps", "1"]),
        # 1F1B with graphs: the first stage replays two slots, one per micro-batch in flight
        "pp2-graph": (1, 2, None, False, ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]),
        # TP without SP (all-reduces inside the graphs); and no graph flag at all: TP on GPUs replays by default
        "tp2-graph": (2, 1, None, False, ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]),
        "tp2-sp-graph-default": (2, 1, None, True, ["--cuda-graph-warmup-steps", "1"])},
    4: {"tp2-pp2-v2-sp": (2, 2, 2, True, []),
        "tp2-dp2": (2, 1, None, False, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
        "pp2-dp2": (1, 2, None, False, ["--use-distributed-optimizer"]),
        "pp4": (1, 4, None, False, []),
        # CUDA graphs with TP + SP and ZeRO-1's parameter updates (the graphs read the weights in place)
        "tp2-dp2-sp-graph": (2, 1, None, True, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                                "--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]),
        "tp2-pp2-v2-sp-graph": (2, 2, 2, True, ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]),
        # TP=4: the row-parallel reduce-scatter's exchange is an all-to-all (TP=2: an all-gather)
        "tp4-sp": (4, 1, None, True, [])},
}
MAX_TP = {"llama": 2}  # the harness's LLaMA has 2 query groups, which TP must divide
GRAPHS_NEED_CUDA = "graph"  # layouts whose name holds this run on GPUs only (--enable-cuda-graph needs CUDA)
RESUME = {2: [("tp2-sp", "llama"), ("pp2-v2", "gpt2")], 4: [("tp2-pp2-v2-sp", "gpt2")]}


def _case(kind, name, family, dtype, layout=(1, 1, None, False, [])):
    tp, pp, vp, sp, extra = layout
    return {"kind": kind, "name": name, "family": family, "dtype": dtype, "tp": tp, "pp": pp, "vp": vp, "sp": sp,
            "extra": extra}


def layout_cases(world, families=FAMILIES, dtypes=DTYPES):
    return [_case("layout", f"{lname}-{family}-{dtype}", family, dtype, layout)
            for lname, layout in LAYOUTS[world].items() for family in families for dtype in dtypes
            if layout[0] <= MAX_TP.get(family, layout[0])]


def launch(nproc, cases, out, device, timeout=420):
    """Run the cases in one torchrun launch; fails naming the output if the job failed or did not end."""
    path = os.path.join(out, f"cases_{nproc}.json")
    with open(path, "w") as f:
        json.dump(cases, f)
    env = {"PARALLEL3D_DEVICE": device, "PARALLEL3D_JIT": "1"}
    result = torchrun.run(nproc, ["tests/gpu/parity_worker.py", path, out], timeout, env)
    assert result.returncode == 0, f"parity launch on {nproc} {device} rank(s) failed:\n{result.output[-6000:]}"
    return result


def _rank_records(out, name):
    files = sorted(f for f in os.listdir(out) if f.startswith(name + ".rank"))
    assert files, f"{name}: no rank wrote a result"
    records = []
    for fname in files:
        with open(os.path.join(out, fname)) as f:
            records.append(json.load(f))
    return records


def check_case(out, case):
    """Every rank's losses, gradient norms and weights against the one-GPU run of the same precision."""
    name, family, dtype = case["name"], case["family"], case["dtype"]
    ref = _rank_records(out, f"ref_{family}_{dtype}")[0]
    rel = BF16_STEP if dtype == "bf16" else 1e-5
    for rank, rec in enumerate(_rank_records(out, name)):
        where = f"{name} rank {rank}"
        if GRAPHS_NEED_CUDA in name:  # the graphs ran, not only the eager layers beside them
            assert rec["cuda_graph_replays"] > 0, f"{where}: no training forward replayed its CUDA graphs"
        for what in ("losses", "grad_norms"):
            for it, (got, want) in enumerate(zip(rec[what], ref[what], strict=True)):
                bound = rel * max(1.0, abs(want)) if dtype == "fp32" else rel * abs(want)
                assert abs(got - want) <= bound, \
                    f"{where} iteration {it + 1} {what}: {got} vs one GPU {want} (bound {bound:.3g})"
        weights = rec["weights"]
        if dtype == "fp32":
            for wname, err in weights.items():
                assert err["max_abs"] <= 2e-5, f"{where} weight {wname} differs from one GPU by {err['max_abs']:.3g}"
        else:
            total = (sum(e["diff_sq"] for e in weights.values()) / sum(e["ref_sq"] for e in weights.values())) ** 0.5
            worst = sorted(weights, key=lambda n: weights[n]["diff_sq"] / max(weights[n]["ref_sq"], 1e-30))[-3:]
            assert total <= BF16_STEP, f"{where} weights: relative L2 {total:.3g} from one GPU > {BF16_STEP:.3g} " \
                                       f"(most different: {worst})"


def check_resume(out, name):
    for rank, rec in enumerate(_rank_records(out, name)):
        assert rec["first"] == rec["straight"][:3], f"{name} rank {rank}: {rec['first']} vs {rec['straight'][:3]}"
        assert rec["resumed"] == rec["straight"][3:], f"{name} rank {rank}: {rec['resumed']} vs {rec['straight'][3:]}"


def _resume_cases(world):
    return [_case("resume", f"resume-{lname}-{family}", family, "fp32", LAYOUTS[world][lname])
            for lname, family in RESUME[world]]


# ------------------------------------------------------------------------------------------ GPU runs


@pytest.fixture(scope="session")
def gpu_out(tmp_path_factory):
    """The references on one GPU, after building the kernels once (not in two ranks at a time)."""
    if GPUS < 1:
        pytest.skip(f"the GPU suite needs CUDA GPUs; this machine has {GPUS}")
    os.environ["PARALLEL3D_JIT"] = "1"
    from parallel3d.fused import _ext

    _ext.get_ext()
    out = str(tmp_path_factory.mktemp("gpu_parity"))
    launch(1, [_case("reference", f"ref_{f}_{d}", f, d) for f in FAMILIES for d in DTYPES], out, "cuda")
    return out


def _selected_cases(items, world):
    """The cases of ``world`` GPUs that the selected tests check (``-k tp2-sp`` launches those alone); all of
    them when only the exit-time test of that size is selected."""
    def chosen(name):
        return [i.callspec.params for i in items if i.originalname == name and i.callspec.params["world"] == world]

    names = {params["case"]["name"] for params in chosen("test_layout_equals_one_gpu")}
    cases = [c for c in layout_cases(world) if c["name"] in names]
    cases += _resume_cases(world) if chosen("test_resume_is_exact_on_gpus") else []
    return cases or layout_cases(world) + _resume_cases(world)


@pytest.fixture(scope="session")
def gpu_launches(gpu_out, request):
    """{world size: the launch} of the selected layouts of that size that this machine can run."""
    return {world: launch(world, _selected_cases(request.session.items, world), gpu_out, "cuda")
            for world in LAYOUTS if GPUS >= world}


def test_fused_kernels_are_on(gpu_out):
    """The suite proves the layouts with the kernels the training runs use, where they can be built."""
    from torch.utils.cpp_extension import CUDA_HOME

    from parallel3d.fused import _ext

    if _ext.get_ext() is None and CUDA_HOME is None:
        pytest.skip(f"no compiled kernels and no nvcc to build them ({_ext.load_error()}): the runs used the fallbacks")
    assert _ext.get_ext() is not None, f"the fused kernels failed to build: {_ext.load_error()}"


def _gpu_params():
    return [pytest.param(world, case, id=case["name"],
                         marks=pytest.mark.skipif(GPUS < world, reason=f"needs {world} GPUs, this machine has {GPUS}"))
            for world in LAYOUTS for case in layout_cases(world)]


@pytest.mark.parametrize("world, case", _gpu_params())
def test_layout_equals_one_gpu(gpu_out, gpu_launches, world, case):
    check_case(gpu_out, case)


@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.skipif(GPUS < w, reason=f"needs {w} GPUs"))
                                   for w in LAYOUTS])
def test_resume_is_exact_on_gpus(gpu_out, gpu_launches, world):
    for case in _resume_cases(world):
        check_resume(gpu_out, case["name"])


@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.skipif(GPUS < w, reason=f"needs {w} GPUs"))
                                   for w in LAYOUTS])
def test_parity_jobs_exit_promptly(gpu_launches, world):
    delay = gpu_launches[world].exit_delay("parity: done")
    assert delay <= EXIT_LIMIT_S, f"the {world}-GPU job took {delay:.1f} s to exit after its last result"


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # Megatron's default
DROPOUT_PAIR = [_case("layout", f"tp2-sp-dropout-{name}", "gpt2", "fp32", (2, 1, None, True, DROPOUT + flags))
                for name, flags in (("eager", ["--cuda-graph-impl", "none"]),
                                    ("graph", ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]))]


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, this machine has {GPUS}")
def test_graphs_with_dropout_train_as_the_eager_layers_do(gpu_out):
    """Dropout inside the TP graphs (the RNG tracker's streams registered with each graph): TP=2 + SP with
    Megatron's default dropout, graphs from step 2, trains as the same layout run eagerly, rank by rank: the
    same masks. One mask replayed every step, or numbers drawn from another offset, would move the loss by
    far more than the bound."""
    launch(2, DROPOUT_PAIR, gpu_out, "cuda")
    eager, graphs = (_rank_records(gpu_out, case["name"]) for case in DROPOUT_PAIR)
    for rank, (want, got) in enumerate(zip(eager, graphs, strict=True)):
        assert got["cuda_graph_replays"] > 0, f"rank {rank}: no training forward replayed its CUDA graphs"
        for what in ("losses", "grad_norms"):
            for it, (g, w) in enumerate(zip(got[what], want[what], strict=True)):
                assert abs(g - w) <= 1e-6 * max(1.0, abs(w)), \
                    f"rank {rank} iteration {it + 1} {what}: graphs {g} vs eager {w}"


# --eval-iters 10: the end-of-training evaluation (Megatron's default 100 batches of each split) would put a few
# seconds of forward passes between the last iteration and the exit this test times
TINY_GPT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "4", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "10",
            "--no-progress-bar"]


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, this machine has {GPUS}")
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--pipeline-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
], ids=["tp2-sp", "pp2", "pp2-v2"])
def test_training_job_exits_after_its_last_iteration(gpu_out, tmp_path, layout):
    """examples/pretrain_gpt.py under torchrun: done within EXIT_LIMIT_S of its last log line."""
    result = torchrun.run(2, ["examples/pretrain_gpt.py"] + TINY_GPT + layout, timeout=240,
                          env={"PARALLEL3D_DEVICE": "cuda", "PARALLEL3D_JIT": "1",
                               "PARALLEL3D_CACHE": str(tmp_path / "cache")})
    assert "iteration      4/4" in result.output, result.output[-3000:]
    assert result.returncode == 0, result.output[-3000:]
    delay = result.exit_delay("iteration      4/4")
    assert delay <= EXIT_LIMIT_S, f"exited {delay:.1f} s after its last iteration:\n{result.output[-2000:]}"


# ------------------------------------------------------------------------------------------ CPU ranks


def test_driver_on_cpu_ranks(tmp_path):
    """The driver's 4-GPU path on 4 gloo ranks: each kind of case (reference, layout, resume), each family and
    each check (fp32's and bf16's), in TP x PP x V with SP, the layout that uses every dimension of a world of
    4. Its other 4-GPU layouts are the same code with other sizes, and every layout's training is compared on
    CPU ranks in tests/test_gpt_training.py: this test proves the GPU suite's driver, not the layouts."""
    out = str(tmp_path)
    refs = [_case("reference", "ref_llama_fp32", "llama", "fp32"), _case("reference", "ref_gpt2_bf16", "gpt2", "bf16")]
    launch(1, refs, out, "cpu", timeout=240)
    chosen = ("tp2-pp2-v2-sp-llama-fp32",)
    cases = [c for c in layout_cases(4, dtypes=("fp32",)) if c["name"] in chosen]
    assert len(cases) == len(chosen), "a chosen case left LAYOUTS[4]: choose its successor"
    cases += [c for c in layout_cases(4, ("gpt2",), ("bf16",))
              if c["name"].startswith("tp2-pp2") and GRAPHS_NEED_CUDA not in c["name"]]
    result = launch(4, cases + _resume_cases(4), out, "cpu", timeout=400)
    for case in cases:
        check_case(out, case)
    for case in _resume_cases(4):
        check_resume(out, case["name"])
    assert result.exit_delay("parity: done") <= EXIT_LIMIT_S


def test_a_selection_launches_its_cases_alone():
    """``pytest tests/gpu -k graph`` trains the graph layouts only, not the whole sweep of each size."""
    class Item:
        def __init__(self, name, **params):
            self.originalname, self.callspec = name, type("Callspec", (), {"params": params})()

    cases = {c["name"]: c for c in layout_cases(2)}
    picked = [Item("test_layout_equals_one_gpu", world=2, case=cases["tp2-sp-graph-llama-bf16"]),
              Item("test_layout_equals_one_gpu", world=4, case=layout_cases(4)[0])]
    assert _selected_cases(picked, 2) == [cases["tp2-sp-graph-llama-bf16"]]
    with_resume = picked + [Item("test_resume_is_exact_on_gpus", world=2)]
    assert _selected_cases(with_resume, 2) == [cases["tp2-sp-graph-llama-bf16"]] + _resume_cases(2)
    everything = layout_cases(2) + _resume_cases(2)
    assert _selected_cases([Item("test_parity_jobs_exit_promptly", world=2)], 2) == everything
