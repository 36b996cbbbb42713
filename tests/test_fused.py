"""parallel3d.fused: every op against an fp64 reference, forward and backward.

CPU tests exercise the PyTorch fallbacks (what CI runs).  GPU tests run the CUDA
kernels on fresh random data over many shapes, odd ones included, with every
output the kernels allocate poisoned with NaN first (so an unwritten element
fails); they skip, with the reason, where there is no CUDA device or extension.
Error metric: ||out - ref|| / ||ref|| with ref in fp64 from the same inputs;
tolerances by output dtype (fp32 arithmetic lands far under 1e-3, bf16 output
rounding alone is ~2e-3).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import parallel3d.fused as fused
from parallel3d.fused import _ext

HAS_CUDA = torch.cuda.is_available()
EXT = _ext.get_ext() if HAS_CUDA else None
_SKIP_REASON = (
    "no CUDA device" if not HAS_CUDA else f"CUDA extension unavailable: {_ext.load_error()}"
)
gpu = pytest.mark.skipif(not HAS_CUDA or EXT is None, reason=_SKIP_REASON)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_DTYPES = [torch.float32, torch.bfloat16]
GPU_ROWS_HIDDEN = [(r, h) for r in (1, 3, 1023) for h in (1, 7, 1000, 4097, 16384)]
# The norm kernels also change shape with the row: 16383 takes 16 scalar packs per
# thread, 2048 puts several rows in a block (257 leaves one partly filled), and
# 20000 rows of 64 make each block of the persistent backward grid loop.
NORM_GPU_ROWS_HIDDEN = GPU_ROWS_HIDDEN + [(3, 16383), (257, 2048), (20000, 64)]
CPU_ROWS_HIDDEN = [(1, 1), (3, 7), (37, 1000), (2, 4097)]


# ---- helpers ----------------------------------------------------------------------------------

def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor).

    ``floor`` is the size of the terms that cancel into ref where ref is
    cancellation-dominated (a norm's input gradient at hidden size 1 is ~0), so
    the error is judged against what fp32 arithmetic can resolve.
    """
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite element in output (unwritten or NaN)"
    denom = max(ref.norm().item(), floor)
    return (out - ref).norm().item() / denom if denom > 0 else out.norm().item()


def fwd_bwd(fn, args, grad_idx, dy=None):
    """Run fn(*args) and its backward with a random (or given) output gradient."""
    args = [
        a.detach().clone().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    ]
    out = fn(*args)
    if dy is None:
        dy = torch.randn_like(out)
    out.backward(dy)
    return out.detach(), [args[i].grad for i in grad_idx], dy


def check_against_reference(fn, ref_fn, args, grad_idx, tol, floors=None):
    """fn vs ref_fn (run in fp64 on the same inputs): output and the gradients of args[grad_idx].

    floors: {"out" or arg index: f(args64, dy64) -> float}, see rel_err.
    """
    out, grads, dy = fwd_bwd(fn, args, grad_idx)
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref_out, ref_grads, _ = fwd_bwd(ref_fn, args64, grad_idx, dy=dy.double())
    out_floor = floors["out"](args64, dy.double()) if floors and "out" in floors else 0.0
    errs = {"out": rel_err(out, ref_out, out_floor)}
    for i, g, rg in zip(grad_idx, grads, ref_grads):
        assert g is not None and g.dtype == args[i].dtype, f"grad {i}: {None if g is None else g.dtype}"
        floor = floors[i](args64, dy.double()) if floors and i in floors else 0.0
        errs[f"grad{i}"] = rel_err(g, rg, floor)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"errors over {tol}: {bad}"


def randn(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


# ---- fp64 references (written from Megatron-Core / HF, independent of the wrappers) -------------

def ref_bias_gelu(x, b, approximate):
    z = x + b if b is not None else x
    if approximate == "tanh":
        return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def ref_bias_swiglu(x, b):
    z = x + b if b is not None else x
    a, g = torch.chunk(z, 2, dim=-1)
    return a * torch.sigmoid(a) * g


def ref_layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * w
    return y + b if b is not None else y


def ref_rms_norm(x, w, eps):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def ref_rope_megatron(t, freqs):
    """Megatron-Core apply_rotary_pos_emb_bshd (non-interleaved), t [s, b, h, d], freqs [s, 1|b, 1, rot]."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * torch.cos(freqs)) + (_rotate_half(t) * torch.sin(freqs))
    return torch.cat((t, t_pass), dim=-1)


def ref_rope_hf(q, emb):
    """HF LLaMA apply_rotary_pos_emb, q [b, h, s, d], cos/sin from emb [s, d]."""
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    return (q * cos) + (_rotate_half(q) * sin)


def ref_causal_softmax(x, scale):
    sq, sk = x.shape[-2:]
    mask = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=x.device), diagonal=1)
    return torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)


def rope_freqs(s, rot, device, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((f, f), dim=-1)  # [s, rot]


# ---- shared checks (CPU: fallbacks; GPU: kernels) ------------------------------------------------

# Floors for the element-wise ops: gelu(z) and swiglu's derivatives pass through ~0
# (gelu's tail, gelu' and the swiglu gate derivative have zeros), where a norm-wise
# relative error of a tiny tensor (a single element) measures rounding of the
# cancelling terms; a tenth of the terms' size still catches any wrong formula.
def _z(args64):
    x, b = args64[0], args64[1]
    return x + b if b is not None else x


GELU_FLOORS = {"out": lambda a, dy: 0.1 * _z(a).norm().item(), 0: lambda a, dy: 0.1 * dy.norm().item(),
               1: lambda a, dy: 0.1 * dy.norm().item()}


def _swiglu_grad_floor(a64, dy):
    ga, gg = torch.chunk(_z(a64), 2, dim=-1)
    return 0.1 * (dy * (ga.abs() + gg.abs())).norm().item()


SWIGLU_FLOORS = {"out": lambda a, dy: 0.1 * torch.mul(*torch.chunk(_z(a), 2, dim=-1)).norm().item(),
                 0: _swiglu_grad_floor, 1: _swiglu_grad_floor}


def _check_bias_gelu(device, dtype, rows, hidden, approximate, with_bias=True):
    x = randn(rows, hidden, dtype=dtype, device=device, scale=2.0)
    b = randn(hidden, dtype=dtype, device=device) if with_bias else None
    grad_idx = [0, 1] if with_bias else [0]
    check_against_reference(
        lambda x, b: fused.bias_gelu(x, b, approximate), lambda x, b: ref_bias_gelu(x, b, approximate),
        [x, b], grad_idx, TOL[dtype], floors=GELU_FLOORS,
    )


def _check_bias_swiglu(device, dtype, rows, f, with_bias=True):
    x = randn(rows, 2 * f, dtype=dtype, device=device, scale=2.0)
    b = randn(2 * f, dtype=dtype, device=device) if with_bias else None
    check_against_reference(
        fused.bias_swiglu, ref_bias_swiglu, [x, b], [0, 1] if with_bias else [0], TOL[dtype], floors=SWIGLU_FLOORS
    )


def _norm_dx_floor(rms):
    """Size of the terms of a norm's dx before they cancel: ||dy * w * rstd||.

    (The weight gradient's floor is ||dy||: at hidden size 1, LayerNorm's xhat is 0.)
    """
    def floor(args64, dy64):
        x, w = args64[0], args64[1]
        var = (x**2).mean(-1, keepdim=True) if rms else x.var(-1, unbiased=False, keepdim=True)
        return (dy64 * w / torch.sqrt(var + 1e-5)).norm().item()
    return floor


def _check_layer_norm(device, dtype, rows, hidden, with_bias=True):
    x = randn(rows, hidden, dtype=dtype, device=device, scale=3.0) + 0.5
    w = randn(hidden, dtype=dtype, device=device)
    b = randn(hidden, dtype=dtype, device=device) if with_bias else None
    check_against_reference(
        lambda x, w, b: fused.layer_norm(x, w, b, 1e-5), lambda x, w, b: ref_layer_norm(x, w, b, 1e-5),
        [x, w, b], [0, 1, 2] if with_bias else [0, 1], TOL[dtype],
        floors={0: _norm_dx_floor(rms=False), 1: lambda a, dy: dy.norm().item()},
    )


def _check_rms_norm(device, dtype, rows, hidden):
    x = randn(rows, hidden, dtype=dtype, device=device, scale=3.0)
    w = randn(hidden, dtype=dtype, device=device)
    check_against_reference(
        lambda x, w: fused.rms_norm(x, w, 1e-6), lambda x, w: ref_rms_norm(x, w, 1e-6), [x, w], [0, 1], TOL[dtype],
        floors={0: _norm_dx_floor(rms=True), 1: lambda a, dy: dy.norm().item()},
    )


def _check_rope_sbhd(device, dtype, s, b, h, d, rot, per_sample=False):
    t = randn(s, b, h, d, dtype=dtype, device=device)
    if per_sample:  # [s, b, 1, rot]: each sample its own positions
        freqs = torch.stack([rope_freqs(s + 3 * i, rot, device)[3 * i:] for i in range(b)], dim=1)[:, :, None]
    else:  # Megatron's [S, 1, 1, rot] with S > s
        freqs = rope_freqs(s + 5, rot, device)[:, None, None]
    check_against_reference(
        lambda t: fused.apply_rotary_pos_emb(t, freqs, "sbhd"),
        lambda t: ref_rope_megatron(t, freqs[:s].double()),
        [t], [0], TOL[dtype],
    )


def _check_rope_bhsd(device, dtype, b, h, s, d):
    q = randn(b, h, s, d, dtype=dtype, device=device)
    emb = rope_freqs(s, d, device)
    check_against_reference(
        lambda q: fused.apply_rotary_pos_emb(q, emb, "bhsd"), lambda q: ref_rope_hf(q, emb.double()),
        [q], [0], TOL[dtype],
    )


def _check_rope_qk(device, dtype, layout):
    """q and k (grouped-query: 8 and 2 heads) rotated in one call, against two reference calls."""
    s, b, d = 33, 2, 64
    if layout == "sbhd":  # partial rotary, Megatron's [S, 1, 1, rot] freqs
        q, k = randn(s, b, 8, d, dtype=dtype, device=device), randn(s, b, 2, d, dtype=dtype, device=device)
        freqs = rope_freqs(s + 5, 48, device)[:, None, None]

        def ref(t):
            return ref_rope_megatron(t, freqs[:s].double())
    else:
        q, k = randn(b, 8, s, d, dtype=dtype, device=device), randn(b, 2, s, d, dtype=dtype, device=device)
        freqs = rope_freqs(s, d, device)

        def ref(t):
            return ref_rope_hf(t, freqs.double())

    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    out_q, out_k = fused.apply_rotary_pos_emb_qk(qa, ka, freqs, layout)
    dq, dk = torch.randn_like(out_q), torch.randn_like(out_k)
    torch.autograd.backward([out_q, out_k], [dq, dk])
    for t, out, dy, grad in ((q, out_q, dq, qa.grad), (k, out_k, dk, ka.grad)):
        t64 = t.double().requires_grad_()
        ref_out = ref(t64)
        ref_out.backward(dy.double())
        assert rel_err(out, ref_out) <= TOL[dtype]
        assert rel_err(grad, t64.grad) <= TOL[dtype]


def _check_causal_softmax(device, dtype, batches, s):
    x = randn(batches, s, s, dtype=dtype, device=device, scale=4.0)
    scale = 0.37
    check_against_reference(
        lambda x: fused.scaled_upper_triang_masked_softmax(x, scale), lambda x: ref_causal_softmax(x, scale),
        [x], [0], TOL[dtype],
    )


def _check_wgrad(device, dtype, n, out_f, in_f):
    inp = randn(n, in_f, dtype=dtype, device=device)
    go = randn(n, out_f, dtype=dtype, device=device)
    main_grad = torch.randn(out_f, in_f, device=device)
    ref = main_grad.double() + go.double().t() @ inp.double()
    fused.wgrad_accumulate(inp, go, main_grad)
    assert main_grad.dtype == torch.float32
    assert rel_err(main_grad, ref) <= 1e-5  # products of bf16/fp16 are exact in fp32; fp32 accumulation only


# ---- CPU: fallbacks ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,hidden", CPU_ROWS_HIDDEN)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_cpu(dtype, rows, hidden, approximate):
    _check_bias_gelu("cpu", dtype, rows, hidden, approximate)


def test_bias_gelu_no_bias_cpu():
    _check_bias_gelu("cpu", torch.float32, 5, 33, "tanh", with_bias=False)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,f", [(1, 1), (3, 7), (37, 1000)])
def test_bias_swiglu_cpu(dtype, rows, f):
    _check_bias_swiglu("cpu", dtype, rows, f)
    _check_bias_swiglu("cpu", dtype, rows, f, with_bias=False)


def test_bias_swiglu_matches_megatron_layout_cpu():
    # Megatron-Core: y_1, y_2 = chunk(x, 2, -1); silu(y_1) * y_2 -- gate is the FIRST half.
    x = torch.randn(4, 3, 10)
    y = fused.bias_swiglu(x)
    assert y.shape == (4, 3, 5)
    torch.testing.assert_close(y, F.silu(x[..., :5]) * x[..., 5:])


# Hidden size 1 is left to the GPU test: the fallback is torch's own layer_norm, whose
# fp32 x - mean at h = 1 is not exactly 0, and 1/sqrt(eps) amplifies that in dweight.
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,hidden", [(3, 5)] + CPU_ROWS_HIDDEN[1:])
def test_layer_norm_cpu(dtype, rows, hidden):
    _check_layer_norm("cpu", dtype, rows, hidden)


def test_layer_norm_no_bias_and_non_contiguous_cpu():
    _check_layer_norm("cpu", torch.float32, 6, 40, with_bias=False)
    x = torch.randn(40, 6).t()  # non-contiguous [6, 40], e.g. a transposed sequence shard
    w, b = torch.randn(40), torch.randn(40)
    torch.testing.assert_close(
        fused.layer_norm(x, w, b, 1e-5), ref_layer_norm(x.double(), w.double(), b.double(), 1e-5).float()
    )


def test_norms_with_fp32_weights_on_bf16_input_cpu():
    # fp32 parameters on bf16 activations (e.g. under autocast): PyTorch in fp32, output bf16.
    x = torch.randn(5, 64).to(torch.bfloat16)
    w, b = torch.randn(64), torch.randn(64)
    ln = fused.layer_norm(x, w, b, 1e-5)
    rms = fused.rms_norm(x, w, 1e-5)
    assert ln.dtype == rms.dtype == torch.bfloat16
    assert rel_err(ln, ref_layer_norm(x.double(), w.double(), b.double(), 1e-5)) <= TOL[torch.bfloat16]
    assert rel_err(rms, ref_rms_norm(x.double(), w.double(), 1e-5)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,hidden", CPU_ROWS_HIDDEN)
def test_rms_norm_cpu(dtype, rows, hidden):
    _check_rms_norm("cpu", dtype, rows, hidden)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("s,b,h,d,rot", [(1, 1, 1, 2, 2), (7, 3, 5, 64, 64), (9, 2, 3, 96, 32)])
def test_rope_sbhd_cpu(dtype, s, b, h, d, rot):
    _check_rope_sbhd("cpu", dtype, s, b, h, d, rot)


def test_rope_per_sample_freqs_cpu():
    _check_rope_sbhd("cpu", torch.float32, 6, 3, 2, 16, 8, per_sample=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rope_bhsd_cpu(dtype):
    _check_rope_bhsd("cpu", dtype, 2, 3, 11, 32)


@pytest.mark.parametrize("layout", ["sbhd", "bhsd"])
def test_rope_qk_cpu(layout):
    _check_rope_qk("cpu", torch.float32, layout)


def test_rope_layouts_agree_cpu():
    t = torch.randn(5, 2, 3, 16)
    freqs = rope_freqs(5, 16, "cpu")
    a = fused.apply_rotary_pos_emb(t, freqs[:, None, None], "sbhd")
    b = fused.apply_rotary_pos_emb(t.permute(1, 2, 0, 3), freqs, "bhsd")
    torch.testing.assert_close(a, b.permute(2, 0, 1, 3))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("batches,s", [(1, 1), (3, 7), (2, 100)])
def test_causal_softmax_cpu(dtype, batches, s):
    _check_causal_softmax("cpu", dtype, batches, s)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_wgrad_accumulate_cpu(dtype):
    _check_wgrad("cpu", dtype, 37, 11, 23)


def test_bias_dropout_add_eval_cpu():
    x, r, b = torch.randn(4, 9), torch.randn(4, 9), torch.randn(9)
    torch.testing.assert_close(fused.bias_dropout_add(x, b, r, 0.5, training=False), r + x + b)
    torch.testing.assert_close(fused.bias_dropout_add(x, None, r, 0.0, training=True), r + x)


@pytest.mark.parametrize("use_generator", [False, True])
def test_bias_dropout_add_reproducible_cpu(use_generator):
    x, r, b = torch.randn(64, 96), torch.randn(64, 96), torch.randn(96)
    p = 0.3
    gen = torch.Generator().manual_seed(123) if use_generator else None
    state = gen.get_state() if use_generator else torch.get_rng_state()
    out1 = fused.bias_dropout_add(x, b, r, p, True, generator=gen)
    out_other = fused.bias_dropout_add(x, b, r, p, True, generator=gen)
    if use_generator:
        gen.set_state(state)
    else:
        torch.set_rng_state(state)
    out2 = fused.bias_dropout_add(x, b, r, p, True, generator=gen)
    assert torch.equal(out1, out2)
    assert not torch.equal(out1, out_other)
    kept = out1 != r
    frac = kept.float().mean().item()
    assert abs(frac - (1 - p)) < 0.03, frac
    torch.testing.assert_close(out1[kept], (r + (x + b) / (1 - p))[kept])


def test_validation_errors_cpu():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\), got \(7,\)"):
        fused.bias_gelu(x, torch.randn(7))
    with pytest.raises(ValueError, match="approximate"):
        fused.bias_gelu(x, None, "sigmoid")
    with pytest.raises(ValueError, match="must be even"):
        fused.bias_swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"prob must be in \[0, 1\), got 1.0"):
        fused.bias_dropout_add(x, None, x, 1.0, True)
    with pytest.raises(ValueError, match="residual shape"):
        fused.bias_dropout_add(x, None, torch.randn(3, 9), 0.1, True)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        fused.layer_norm(x, torch.randn(9), None)
    with pytest.raises(ValueError, match="floating-point"):
        fused.rms_norm(x, torch.ones(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"freqs cover 3 positions but t has 5"):
        fused.apply_rotary_pos_emb(torch.randn(5, 1, 2, 8), torch.randn(3, 1, 1, 8))
    with pytest.raises(ValueError, match="rot_dim"):
        fused.apply_rotary_pos_emb(torch.randn(5, 1, 2, 8), torch.randn(5, 1, 1, 10))
    with pytest.raises(ValueError, match="sq == sk"):
        fused.scaled_upper_triang_masked_softmax(torch.randn(2, 3, 4), 1.0)
    with pytest.raises(ValueError, match=r"main_grad must be \[5, 4\]"):
        fused.wgrad_accumulate(torch.randn(6, 4), torch.randn(6, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="input has 6 rows but grad_output has 7"):
        fused.wgrad_accumulate(torch.randn(6, 4), torch.randn(7, 5), torch.zeros(5, 4))


def test_fusion_switch():
    assert fused.fusion_enabled() == (os.environ.get("PARALLEL3D_DISABLE_FUSION") != "1")
    before = fused.fusion_enabled()
    try:
        fused.set_fusion_enabled(False)
        assert not fused.fusion_enabled()
        assert not _ext.use_kernel(torch.empty(1))
        fused.set_fusion_enabled(True)
        assert fused.fusion_enabled()
        assert not _ext.use_kernel(torch.empty(1))  # CPU tensors never take the kernel
    finally:
        fused.set_fusion_enabled(before)


def test_cpu_use_never_loads_extension_and_env_switch():
    code = (
        "import torch, parallel3d.fused as f\n"
        "from parallel3d.fused import _ext\n"
        "x = torch.randn(4, 8)\n"
        "f.layer_norm(x, torch.ones(8), None); f.rms_norm(x, torch.ones(8)); f.bias_gelu(x, None)\n"
        "f.bias_swiglu(x); f.bias_dropout_add(x, None, x, 0.1, True)\n"
        "f.scaled_upper_triang_masked_softmax(torch.randn(1, 4, 4), 1.0)\n"
        "f.apply_rotary_pos_emb(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8))\n"
        "f.wgrad_accumulate(x, x, torch.zeros(8, 8))\n"
        "assert not _ext._ext_tried, 'CPU calls looked up the CUDA extension'\n"
        "assert not f.fusion_enabled()\n"
    )
    env = dict(os.environ, PARALLEL3D_DISABLE_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# ---- GPU: kernels ------------------------------------------------------------------------------

@pytest.fixture
def poisoned():
    """Kernels fill each output they allocate with NaN before writing it."""
    EXT.set_poison_outputs(True)
    try:
        yield
    finally:
        EXT.set_poison_outputs(False)


def _assert_kernel_path(*tensors):
    assert _ext.use_kernel(*tensors), "the CUDA kernel path is not taken"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", GPU_ROWS_HIDDEN)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_gpu(poisoned, dtype, rows, hidden, approximate):
    _assert_kernel_path(torch.empty(1, device="cuda"))
    _check_bias_gelu("cuda", dtype, rows, hidden, approximate)


@gpu
def test_bias_gelu_no_bias_gpu(poisoned):
    _check_bias_gelu("cuda", torch.bfloat16, 9, 4096, "tanh", with_bias=False)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,f", GPU_ROWS_HIDDEN)
def test_bias_swiglu_gpu(poisoned, dtype, rows, f):
    _check_bias_swiglu("cuda", dtype, rows, f)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_swiglu_no_bias_gpu(poisoned, dtype):
    _check_bias_swiglu("cuda", dtype, 33, 1000, with_bias=False)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_GPU_ROWS_HIDDEN)
def test_layer_norm_gpu(poisoned, dtype, rows, hidden):
    _check_layer_norm("cuda", dtype, rows, hidden)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_no_bias_and_non_contiguous_gpu(poisoned, dtype):
    _check_layer_norm("cuda", dtype, 77, 1000, with_bias=False)
    x = randn(1000, 77, dtype=dtype, device="cuda").t()  # non-contiguous [77, 1000]
    w, b = randn(1000, dtype=dtype, device="cuda"), randn(1000, dtype=dtype, device="cuda")
    out = fused.layer_norm(x, w, b, 1e-5)
    assert rel_err(out, ref_layer_norm(x.double(), w.double(), b.double(), 1e-5)) <= TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_GPU_ROWS_HIDDEN)
def test_rms_norm_gpu(poisoned, dtype, rows, hidden):
    _check_rms_norm("cuda", dtype, rows, hidden)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "s,b,h,d,rot",
    [(1, 1, 1, 2, 2), (7, 3, 5, 64, 64), (33, 2, 4, 128, 64), (17, 2, 3, 96, 32), (5, 2, 3, 80, 40),
     (9, 1, 2, 10, 6), (128, 2, 8, 128, 128), (64, 4, 32, 128, 128)],
)
def test_rope_sbhd_gpu(poisoned, dtype, s, b, h, d, rot):
    _check_rope_sbhd("cuda", dtype, s, b, h, d, rot)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_per_sample_freqs_gpu(poisoned, dtype):
    _check_rope_sbhd("cuda", dtype, 19, 3, 4, 64, 32, per_sample=True)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["sbhd", "bhsd"])
def test_rope_qk_gpu(poisoned, dtype, layout):
    _check_rope_qk("cuda", dtype, layout)


@gpu
def test_rope_follows_freqs_changed_in_place_gpu():
    """The kernel's cos/sin are computed once per freqs tensor; an in-place change must not reuse them."""
    t = randn(7, 2, 3, 32, dtype=torch.float32, device="cuda")
    freqs = rope_freqs(7, 32, "cuda")[:, None, None]
    fused.apply_rotary_pos_emb(t, freqs, "sbhd")
    freqs.mul_(2.0)
    out = fused.apply_rotary_pos_emb(t, freqs, "sbhd")
    assert rel_err(out, ref_rope_megatron(t.double(), freqs.double())) <= 1e-6


@gpu
def test_rope_far_positions_gpu():
    """Angles of thousands of radians (position 8191 x inv_freq 1) are as exact as torch's cos/sin."""
    s, d = 8192, 64
    t = randn(s, 1, 2, d, dtype=torch.float32, device="cuda")
    freqs = rope_freqs(s, d, "cuda")[:, None, None]
    out = fused.apply_rotary_pos_emb(t, freqs, "sbhd")
    assert rel_err(out, ref_rope_megatron(t.double(), freqs.double())) <= 1e-6


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,h,s,d", [(2, 3, 11, 32), (1, 8, 257, 128), (3, 2, 5, 6)])
def test_rope_bhsd_gpu(poisoned, dtype, b, h, s, d):
    _check_rope_bhsd("cuda", dtype, b, h, s, d)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_strided_view_gpu(poisoned, dtype):
    # q as a slice of a fused [s, b, h, 3d] QKV tensor: head stride 3d, last dim contiguous.
    s, b, h, d = 13, 2, 4, 64
    qkv = randn(s, b, h, 3 * d, dtype=dtype, device="cuda")
    q = qkv[..., :d]
    freqs = rope_freqs(s, d, "cuda")[:, None, None]
    out = fused.apply_rotary_pos_emb(q, freqs, "sbhd")
    assert rel_err(out, ref_rope_megatron(q.double(), freqs.double())) <= TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batches,s", [(1, 1), (3, 7), (2, 1000), (1, 4097), (1, 9001), (1, 16384)])
def test_causal_softmax_gpu(poisoned, dtype, batches, s):
    _check_causal_softmax("cuda", dtype, batches, s)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,out_f,in_f", [(1, 1, 1), (3, 7, 5), (1023, 1000, 4097), (4096, 2048, 1024)])
def test_wgrad_accumulate_gpu(dtype, n, out_f, in_f):
    torch.backends.cuda.matmul.allow_tf32 = True  # the op must switch TF32 off for fp32 itself
    try:
        _check_wgrad("cuda", dtype, n, out_f, in_f)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 1), (3, 7), (1023, 1000), (1023, 4097), (64, 16384)])
def test_bias_dropout_add_gpu(poisoned, dtype, rows, hidden):
    p = 0.25
    x = randn(rows, hidden, dtype=dtype, device="cuda")
    b = randn(hidden, dtype=dtype, device="cuda")
    r = randn(rows, hidden, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    dy = randn(rows, hidden, dtype=dtype, device="cuda")
    dy[dy == 0] = 1.0  # a normal draw can round to 0 in fp16; kept elements must have dx != 0
    out, (dx, db, dr), dy = fwd_bwd(
        lambda x, b, r: fused.bias_dropout_add(x, b, r, p, True, gen), [x, b, r], [0, 1, 2], dy=dy
    )
    assert torch.equal(dr, dy)
    keep = dx != 0
    mask = keep.double()
    ref_out = r.double() + mask * (x.double() + b.double()) / (1 - p)
    assert rel_err(out, ref_out) <= TOL[dtype]
    assert torch.equal(out[~keep], r[~keep]), "forward and backward masks differ"
    assert rel_err(dx, dy.double() * mask / (1 - p)) <= TOL[dtype]
    assert rel_err(db, (dy.double() * mask / (1 - p)).sum(0)) <= TOL[dtype]
    if rows * hidden >= 4096:
        assert abs(keep.double().mean().item() - (1 - p)) < 0.02


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_eval_gpu(poisoned, dtype):
    x, b, r = (randn(*s, dtype=dtype, device="cuda") for s in ((33, 1000), (1000,), (33, 1000)))
    check_against_reference(
        lambda x, b, r: fused.bias_dropout_add(x, b, r, 0.5, False), lambda x, b, r: r + x + b, [x, b, r], [0, 1, 2],
        TOL[dtype],
    )


@gpu
def test_dropout_mask_reproduced_when_generator_state_restored(poisoned):
    x, r = randn(1000, 1024, dtype=torch.bfloat16, device="cuda"), randn(1000, 1024, dtype=torch.bfloat16, device="cuda")
    x[x == 0] = 1.0  # CUDA's randn returns an exact 0 about once in 10^7 draws; kept elements are read as x != 0
    b = randn(1024, dtype=torch.bfloat16, device="cuda")
    # Explicit generator.
    gen = torch.Generator(device="cuda").manual_seed(7)
    state = gen.get_state()
    out1 = fused.bias_dropout_add(x, b, r, 0.1, True, gen)
    out_next = fused.bias_dropout_add(x, b, r, 0.1, True, gen)
    gen.set_state(state)
    out2 = fused.bias_dropout_add(x, b, r, 0.1, True, gen)
    assert torch.equal(out1, out2)
    assert not torch.equal(out1, out_next)
    # Default CUDA generator, as the RNG tracker uses it (set_rng_state).
    torch.cuda.manual_seed(11)
    cuda_state = torch.cuda.get_rng_state()
    out3 = fused.bias_dropout_add(x, b, r, 0.1, True)
    torch.cuda.set_rng_state(cuda_state)
    out4 = fused.bias_dropout_add(x, b, r, 0.1, True)
    assert torch.equal(out3, out4)
    # Recomputation: the backward of a recomputed forward sees the same mask.
    # Kept elements, read without residual or bias (r + a small kept value can round back to r in
    # bf16, and x + b can be exactly 0).
    torch.cuda.set_rng_state(cuda_state)
    kept = fused.bias_dropout_add(x, None, torch.zeros_like(r), 0.1, True) != 0
    torch.cuda.set_rng_state(cuda_state)
    xr = x.clone().requires_grad_()
    fused.bias_dropout_add(xr, b, r, 0.1, True).sum().backward()
    assert torch.equal(xr.grad != 0, kept)


@gpu
def test_fusion_disabled_uses_fallback_gpu():
    x = randn(5, 64, dtype=torch.float32, device="cuda")
    w = randn(64, dtype=torch.float32, device="cuda")
    try:
        fused.set_fusion_enabled(False)
        assert not _ext.use_kernel(x)
        out = fused.rms_norm(x, w, 1e-6)
    finally:
        fused.set_fusion_enabled(True)
    assert _ext.use_kernel(x)
    assert rel_err(out, ref_rms_norm(x.double(), w.double(), 1e-6)) <= 1e-5


@gpu
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gpt_training_step_with_fusion_equals_without_gpu(family):
    """One bf16 forward/backward of a small GPT on the kernels equals the plain-PyTorch step."""
    from parallel3d.models import GPTModel, gpt2_config, llama_config

    make = gpt2_config if family == "gpt2" else llama_config
    cfg = make("tiny", bf16=True, hidden_dropout=0.0, attention_dropout=0.0, seq_length=128)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    labels = torch.randint(0, cfg.vocab_size, (2, 128), device="cuda")
    results = []
    for enabled in (True, False):
        fused.set_fusion_enabled(enabled)
        try:
            model = GPTModel(cfg).cuda()  # the same weights both times: initialisation is seeded by cfg.seed
            loss = model(ids, None, labels=labels).mean()
            loss.backward()
            results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
        finally:
            fused.set_fusion_enabled(True)
    (loss_on, grads_on), (loss_off, grads_off) = results
    assert torch.allclose(loss_on, loss_off, rtol=1e-2), (loss_on, loss_off)
    for name, g in grads_off.items():
        rel = (grads_on[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert rel < 3e-2, f"{family} {name}: fused vs plain gradient differs by {rel:.3g} (relative L2)"
