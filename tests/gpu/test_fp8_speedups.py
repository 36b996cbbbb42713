"""FP8's speed-ups (tensor_parallel/fp8.py, docs/fp8.md "Speed") give the same bits on the GPU as the
path without them: torch._scaled_mm with the cached weight (dgrad's copy column-major), the compiled
scale-and-cast kernel against the eager operations, the lean eager quantization, wgrad's reuse of
dgrad's FP8 grad_output.

    python3 -m pytest -q -rs tests/gpu/test_fp8_speedups.py

The CPU tests prove the same for the emulated GEMMs and eager operations (tests/test_fp8.py); on the
GPU the cast is compiled (Triton's round-to-nearest-even conversion) and the GEMMs are cuBLAS's, which
only a GPU can check. Skips, naming the reason: no CUDA GPU, no torchao, compute capability below 8.9.
"""
import importlib.util

import pytest
import torch


def _why_not() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not importable (FP8's library): put its wheel on PYTHONPATH or pip install parallel3d[fp8]"
    if torch.cuda.get_device_capability(0) < (8, 9):
        return f"{torch.cuda.get_device_name(0)}: FP8 GEMMs need compute capability 8.9 or higher"
    return ""


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)
SPEEDUPS = ("cache_weights", "lean_quantize", "compile_cast", "reuse_grad_output")  # Fp8Scaling's switches


def _train(recipe, fmt, layer_cls, off, steps=2, micro=3):
    """Outputs, input and weight gradients of a bf16 linear over ``steps`` SGD steps of ``micro``
    micro-batches, with the speed-ups named in ``off`` switched off."""
    from parallel3d.tensor_parallel.fp8 import Fp8Recipe, update_fp8_scaling

    torch.manual_seed(0)
    lin = layer_cls(512, 1024, fp8=Fp8Recipe(format=fmt, recipe=recipe), bias=False, params_dtype=torch.bfloat16,
                    device=torch.device("cuda"))
    for name in off:
        setattr(lin.fp8_scaling, name, False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    g = torch.Generator(device="cuda").manual_seed(1)
    got = []
    for _ in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x = (torch.randn(256, 512, device="cuda", generator=g) * (1 + m)).bfloat16().requires_grad_(True)
            out, _ = lin(x)
            out.backward((torch.randn(256, 1024, device="cuda", generator=g) * 1e-3).bfloat16())
            got += [out.detach(), x.grad]
        got.append(lin.weight.grad.clone())
        opt.step()
        update_fp8_scaling([lin], None)
    return got


@pytest.mark.parametrize("recipe,fmt", [("tensorwise", "hybrid"), ("rowwise", "e4m3"), ("delayed", "hybrid")])
@pytest.mark.parametrize("layer", ["column", "row"])
@pytest.mark.parametrize("off", [SPEEDUPS] + [(s,) for s in SPEEDUPS])
def test_speedup_gives_the_same_bits(recipe, fmt, layer, off):
    from parallel3d.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cls = ColumnParallelLinear if layer == "column" else RowParallelLinear
    fast, slow = _train(recipe, fmt, cls, ()), _train(recipe, fmt, cls, off)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert torch.equal(a, b), f"tensor {i} differs with {off} off: max |diff| {(a - b).abs().max().item():.3g}"


def test_compiled_cast_equals_eager_on_special_values():
    """Saturation, inf, NaN, zeros, subnormals and values on rounding boundaries: the same FP8 bytes."""
    from parallel3d.tensor_parallel.fp8 import Fp8Recipe, Fp8Scaling

    torch.manual_seed(0)
    t = torch.cat([torch.randn(256, 64, device="cuda") * 10.0 ** e for e in range(-8, 8, 2)]).bfloat16()
    t[0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    fast = Fp8Scaling(Fp8Recipe(recipe="tensorwise"), 0, None)
    eager = Fp8Scaling(Fp8Recipe(recipe="tensorwise"), 0, None, compile_cast=False, lean_quantize=False)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for scale in (torch.tensor(3.0e2, device="cuda"), torch.tensor(7.3, device="cuda"),
                      torch.rand(t.size(0), 1, device="cuda") * 1e3):
            a, b = fast._cast(t, scale, fp8), eager._cast(t, scale, fp8)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (fp8, scale.shape)
