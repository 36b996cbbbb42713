"""FP8's speed-ups (tensor_parallel/fp8.py, docs/fp8.md "Speed") give the same bits on the GPU as the
path without them: torch._scaled_mm with the cached weight operands, and the one-launch cast kernel
(csrc/fp8_cast.cu: both layouts from one read) against its PyTorch reference.

    python3 -m pytest -q -rs tests/gpu/test_fp8_speedups.py

The CPU tests prove the same for the emulated GEMMs and eager operations (tests/test_fp8.py); on the
GPU the cast is our CUDA kernel and the GEMMs are cuBLAS's, which
only a GPU can check. Skips, naming the reason: no CUDA GPU, compute capability below 8.9.
"""
import pytest
import torch


def _why_not() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability(0) < (8, 9):
        return f"{torch.cuda.get_device_name(0)}: FP8 GEMMs need compute capability 8.9 or higher"
    return ""


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)
SPEEDUPS = ("cache_weights", "fused_cast")  # Fp8Scaling's switches


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


def test_cast_kernel_equals_reference_on_special_values():
    """Saturation, inf, NaN, zeros, subnormals and values on rounding boundaries: the same FP8 bytes and
    scales, in both layouts, from a scale or from an amax (tensor and rowwise)."""
    from parallel3d.fused import _ext
    from parallel3d.tensor_parallel.fp8_ops import local_amax, quantize

    assert _ext.get_ext() is not None, f"the CUDA kernels did not load, so nothing would be compared: {_ext.load_error()}"
    torch.manual_seed(0)
    t = torch.cat([torch.randn(256, 64, device="cuda") * 10.0 ** e for e in range(-8, 8, 2)]).bfloat16()
    t[0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    finite = torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)
    ragged = torch.randn(37, 70, device="cuda").bfloat16()  # tiles cut by both edges
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for axis, layout in ((None, "both"), (1, "row"), (0, "col"), (None, "row"), (None, "col")):
            kw = dict(amax=local_amax(ragged, axis), layout=layout)
            fast, eager = quantize(ragged, fp8, fused=True, **kw), quantize(ragged, fp8, fused=False, **kw)
            for a, b in zip(fast, eager):
                if a is not None:
                    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), (fp8, axis, layout)
                    assert torch.equal(a.scale_inv, b.scale_inv), (fp8, axis, layout)
        cases = [dict(scale=torch.tensor(3.0e2, device="cuda"), layout="both"),
                 dict(scale=torch.tensor(7.3, device="cuda"), layout="both"),
                 dict(amax=local_amax(finite), layout="both"),
                 dict(amax=local_amax(finite, 1), layout="row"), dict(amax=local_amax(finite, 0), layout="col")]
        for case in cases:
            kw = {k: v for k, v in case.items() if k != "layout"}
            fast = quantize(t, fp8, case["layout"], fused=True, **kw)
            eager = quantize(t, fp8, case["layout"], fused=False, **kw)
            for a, b in zip(fast, eager):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), (fp8, case)
                    assert torch.equal(a.scale, b.scale) and torch.equal(a.scale_inv, b.scale_inv), (fp8, case)
                    assert a.data.is_contiguous(), (fp8, case)


def test_fp8_wgrad_accumulates_into_main_grad_like_the_product_then_an_add():
    """The cuBLASLt GEMM with beta = 1 (csrc/grad_accum.cu) against torch._scaled_mm's fp32 product added to
    main_grad. Products of FP8 values are exact in fp32; the two differ only in the order of the K-sums and
    in where the one rounding of the add happens: a few fp32 ulps of the largest partial sum."""
    from parallel3d.fused import _ext, wgrad_accumulate_fp8, wgrad_accumulate_fp8_reference

    assert _ext.get_ext() is not None, f"the CUDA kernels did not load, so nothing would be compared: {_ext.load_error()}"
    torch.manual_seed(0)
    for fa, fb in ((torch.float8_e5m2, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e4m3fn)):
        a, b = (torch.randn(384, 1024, device="cuda") * 8).to(fa), (torch.randn(512, 1024, device="cuda") * 8).to(fb)
        sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(2.5e-3, device="cuda")
        main_grad = torch.randn(384, 512, device="cuda")
        got, want = main_grad.clone(), main_grad.clone()
        wgrad_accumulate_fp8(a, sa, b, sb, got)
        wgrad_accumulate_fp8_reference(a, sa, b, sb, want)
        bound = (a.float().abs() @ b.float().abs().t()).max().item() * sa.item() * sb.item()
        torch.testing.assert_close(got, want, rtol=0, atol=8 * 2.0 ** -24 * bound, msg=f"{fa} x {fb}")
        assert not torch.equal(got, main_grad), "nothing was accumulated"


@pytest.mark.parametrize("fast_accum", [False, True])
def test_rowwise_gemm_applies_its_scales_in_the_kernel(fast_accum):
    """A rowwise GEMM on the GPU (CUTLASS: the scales applied to the fp32 accumulator, bf16 written) against
    the emulated one (exact FP8 products summed in fp32, divided by the scales). They differ by the bf16
    rounding, 2^-8 of the value, and by the two K-sums' rounding, a fraction of sum_k |a_ik b_jk| / (s_i s_j):
    K 2^-24 in each fp32 sum (the kernel's and the reference's), so 2 K 2^-24; Hopper's fast accumulation
    keeps about 14 bits, so 2^-6 there. fp32 asked for is the bf16 result widened, with the bias added in
    fp32."""
    from parallel3d.tensor_parallel.fp8_ops import local_amax, quantize, scaled_mm

    torch.manual_seed(0)
    x = (torch.randn(256, 512, device="cuda") * torch.logspace(-2, 2, 256, device="cuda")[:, None]).bfloat16()
    w = (torch.randn(384, 512, device="cuda") * torch.logspace(1, -1, 384, device="cuda")[:, None]).bfloat16()
    a, _ = quantize(x, torch.float8_e4m3fn, "row", amax=local_amax(x, 1))
    b, _ = quantize(w, torch.float8_e4m3fn, "row", amax=local_amax(w, 1))
    assert a.scale.shape == (256, 1) and b.scale.shape == (384, 1)
    want = scaled_mm(a, b, torch.float32, fast_accum=False, emulate=True)
    bound = (a.data.float().abs() @ b.data.float().abs().t()) / (a.scale * b.scale.t())
    got = scaled_mm(a, b, torch.bfloat16, fast_accum=fast_accum, emulate=False)
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs() - 2.0 ** -8 * want.abs()
    sum_error = 2.0 ** -6 if fast_accum else 2 * 512 * 2.0 ** -24
    assert (err <= sum_error * bound).all(), f"worst: {(err / bound).max().item():.3g} of the bound"
    bias = torch.randn(384, device="cuda")
    got32 = scaled_mm(a, b, torch.float32, fast_accum=fast_accum, emulate=False, bias=bias)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, got.float() + bias, rtol=0, atol=0)


def test_cast_kernel_records_the_amax_it_reads():
    """Delayed scaling's record in the cast's read: amax_out = max(amax_out, max |x|) as the reference
    takes it (torch.maximum of the infinity norm), exactly; below, above and NaN, in both kernels."""
    from parallel3d.fused import _ext
    from parallel3d.fused.fp8_cast import fp8_cast, fp8_cast_reference

    assert _ext.get_ext() is not None, f"the CUDA kernels did not load, so nothing would be compared: {_ext.load_error()}"
    torch.manual_seed(0)
    s = torch.tensor(3.0, device="cuda")
    for shape in ((256, 128), (37, 70)):  # the 64 x 64 tiled kernel, and tiles cut by both edges
        x = (torch.randn(*shape, device="cuda") * 5).bfloat16()
        for start in (0.0, 1e3, float("nan")):
            for poison in (None, float("inf"), float("nan")):
                t = x.clone()
                if poison is not None:
                    t[shape[0] - 1, shape[1] // 2] = -poison if poison == float("inf") else poison
                got = torch.full((1,), start, device="cuda")
                want = got.clone()
                fp8_cast(t, s, torch.float8_e4m3fn, "both", False, amax_out=got)
                fp8_cast_reference(t, s, torch.float8_e4m3fn, "both", False, amax_out=want)
                assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all()), (shape, start, poison,
                                                                                              got, want)
