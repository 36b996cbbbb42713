"""FP8 on GPUs: TP=2 + SP and PP=2 1F1B (each eager and replayed as CUDA graphs), PP=2 ZB-H1 (whose W step
runs the deferred weight-gradient GEMM) and one GPU with CUDA graphs train like one eager GPU in the same
FP8 recipe, both model families, each of Megatron's recipes we accept.

    python3 -m pytest -q -rs tests/gpu/test_fp8_parity.py     (docs/gpu-tests.md: the tolerance, derived)

The machinery of test_nccl_parity.py: one launch of tests/gpu/parity_worker.py on one GPU trains the
references (bf16, then FP8 per recipe, whose weights are also measured against bf16's: FP8's own
effect); one launch on 2 GPUs trains every layout. Each loss, gradient norm and rank's weights
(relative L2) must be within the larger of one bf16 step and twice FP8's own effect on the same
quantity: a correct layout is an FP8 run as far from bf16 as the one-GPU FP8 run is, so by the
triangle inequality at most twice that from it.

Skips, naming the reason: no CUDA GPU; a GPU without FP8 tensor cores (compute capability below 8.9).
"""
import math
import os

import pytest
import torch

from test_nccl_parity import BF16_STEP, GPUS, _case, _rank_records, launch

FAMILIES = ("gpt2", "llama")
RECIPES = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise")  # tests/gpu/parity_worker.py's PRECISIONS
# name: (TP, PP, V, SP, extra flags), on 2 GPUs
GRAPHS = ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]  # replayed from the second step
LAYOUTS = {"tp2-sp": (2, 1, None, True, ["--cuda-graph-impl", "none"]),
           "tp2-sp-graph": (2, 1, None, True, GRAPHS),
           "pp2-1f1b": (1, 2, None, False, ["--cuda-graph-impl", "none"]),
           "pp2-1f1b-graph": (1, 2, None, False, GRAPHS),  # the first stage replays two slots
           "pp2-zbh1": (1, 2, None, False, ["--pipeline-schedule", "zb-h1"])}
ONE_GPU_GRAPHS = (1, 1, None, False, GRAPHS)  # run in the references' launch


def _why_not() -> str:
    if GPUS < 1:
        return f"FP8 parity needs a CUDA GPU; this machine has {GPUS}"
    cc = torch.cuda.get_device_capability(0)
    if cc < (8, 9):
        return f"{torch.cuda.get_device_name(0)} has compute capability {cc[0]}.{cc[1]}; FP8 GEMMs need 8.9 or higher"
    return ""


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)


def layout_cases():
    return [_case("layout", f"{lname}-{family}-{recipe}", family, recipe, layout)
            for lname, layout in LAYOUTS.items() for family in FAMILIES for recipe in RECIPES]


def one_gpu_graph_cases():
    return [_case("layout", f"1gpu-graph-{family}-{recipe}", family, recipe, ONE_GPU_GRAPHS)
            for family in FAMILIES for recipe in RECIPES]


@pytest.fixture(scope="module")
def fp8_out(tmp_path_factory):
    """References and FP8's effect on one GPU, after building the kernels once; then every 2-GPU layout."""
    os.environ["PARALLEL3D_JIT"] = "1"
    from parallel3d.fused import _ext

    _ext.get_ext()
    out = str(tmp_path_factory.mktemp("fp8_parity"))
    refs = [_case("reference", f"ref_{f}_bf16", f, "bf16") for f in FAMILIES]
    refs += [{**_case("reference", f"ref_{f}_{r}", f, r), "against": "bf16"} for f in FAMILIES for r in RECIPES]
    launch(1, refs + one_gpu_graph_cases(), out, "cuda")
    if GPUS >= 2:
        launch(2, layout_cases(), out, "cuda")
    return out


def _relative_l2(weights, names):
    return math.sqrt(sum(weights[n]["diff_sq"] for n in names) / max(sum(weights[n]["ref_sq"] for n in names), 1e-30))


def check_fp8_case(out, case):
    """Every rank against the one-GPU run of the same recipe, within max(one bf16 step, 2 x FP8's effect)."""
    name, family, recipe = case["name"], case["family"], case["dtype"]
    ref = _rank_records(out, f"ref_{family}_{recipe}")[0]
    bf16 = _rank_records(out, f"ref_{family}_bf16")[0]
    effect = ref["weights"]  # the one-GPU FP8 run's weights against the one-GPU bf16 run's
    assert ref["losses"][0] != bf16["losses"][0], f"{recipe}: the one-GPU FP8 run's first loss equals bf16's " \
                                                  f"({bf16['losses'][0]}): FP8 did not take effect"
    for rank, rec in enumerate(_rank_records(out, name)):
        where = f"{name} rank {rank}"
        if "graph" in name:  # the graphs ran, not only the eager layers beside them
            assert rec["cuda_graph_replays"] > 0, f"{where}: no training forward replayed its CUDA graphs"
        for what in ("losses", "grad_norms"):
            for it, (got, want, plain) in enumerate(zip(rec[what], ref[what], bf16[what], strict=True)):
                bound = max(BF16_STEP * abs(want), 2 * abs(want - plain))
                assert abs(got - want) <= bound, f"{where} iteration {it + 1} {what}: {got} vs one GPU {want} " \
                                                 f"(bound {bound:.3g}; bf16 on one GPU: {plain})"
        names = list(rec["weights"])  # a TP shard is held to its whole tensor's effect
        total, fp8_effect = _relative_l2(rec["weights"], names), _relative_l2(effect, names)
        bound = max(BF16_STEP, 2 * fp8_effect)
        worst = sorted(names, key=lambda n: rec["weights"][n]["diff_sq"] / max(rec["weights"][n]["ref_sq"], 1e-30))
        assert total <= bound, f"{where} weights: relative L2 {total:.3g} from one GPU > {bound:.3g} (FP8's own " \
                               f"effect on them {fp8_effect:.3g}; most different: {worst[-3:]})"


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, this machine has {GPUS}")
@pytest.mark.parametrize("case", layout_cases(), ids=lambda c: c["name"])
def test_fp8_layout_equals_one_gpu(fp8_out, case):
    check_fp8_case(fp8_out, case)


@pytest.mark.parametrize("case", one_gpu_graph_cases(), ids=lambda c: c["name"])
def test_fp8_with_cuda_graphs_on_one_gpu_equals_eager(fp8_out, case):
    """The layers replayed as CUDA graphs, their FP8 weight operands refreshed in place before each replay."""
    check_fp8_case(fp8_out, case)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_one_gpu_trains_like_bf16(fp8_out, family, recipe):
    """The one-GPU FP8 run's losses are finite and, at every step, within 1% of bf16's (issue 28's goal
    for the convergence run, here over the few steps of the parity model)."""
    fp8 = _rank_records(fp8_out, f"ref_{family}_{recipe}")[0]["losses"]
    bf16 = _rank_records(fp8_out, f"ref_{family}_bf16")[0]["losses"]
    for it, (got, want) in enumerate(zip(fp8, bf16, strict=True)):
        assert math.isfinite(got) and abs(got - want) <= 0.01 * abs(want), \
            f"{family} {recipe} iteration {it + 1}: loss {got} against bf16's {want}"
