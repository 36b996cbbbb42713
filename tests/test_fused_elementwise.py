"""parallel3d.fused bias-GeLU/SwiGLU, bias-dropout-add, a bias's gradient, causal softmax, wgrad accumulation; the
fusion switch."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import parallel3d.fused as fused
from parallel3d.fused import _ext
from fused_reference import (
    CPU_DTYPES, CPU_ROWS_HIDDEN, DTYPES, GPU_ROWS_HIDDEN, TOL, check_against_reference, fwd_bwd, gpu, randn, rel_err,
)


# ---- fp64 references and checks --------------------------------------------------------------

def ref_bias_gelu(x, b, approximate):
    z = x + b if b is not None else x
    if approximate == "tanh":
        return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def ref_bias_swiglu(x, b):
    z = x + b if b is not None else x
    a, g = torch.chunk(z, 2, dim=-1)
    return a * torch.sigmoid(a) * g


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


def _check_causal_softmax(device, dtype, batches, s):
    x = randn(batches, s, s, dtype=dtype, device=device, scale=4.0)
    scale = 0.37
    check_against_reference(  # the kernel (the fallback on the CPU) against the op's reference in fp64
        lambda x: fused.scaled_upper_triang_masked_softmax(x, scale),
        lambda x: fused.scaled_upper_triang_masked_softmax_reference(x, scale), [x], [0], TOL[dtype],
    )


def _check_wgrad(device, dtype, n, out_f, in_f):
    inp = randn(n, in_f, dtype=dtype, device=device)
    go = randn(n, out_f, dtype=dtype, device=device)
    main_grad = torch.randn(out_f, in_f, device=device)
    ref = main_grad.double() + go.double().t() @ inp.double()
    fused.wgrad_accumulate(inp, go, main_grad)
    assert main_grad.dtype == torch.float32
    assert rel_err(main_grad, ref) <= 1e-5  # products of bf16/fp16 are exact in fp32; fp32 accumulation only


# ---- CPU: fallbacks --------------------------------------------------------------------------

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


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("batches,s", [(1, 1), (3, 7), (2, 100)])
def test_causal_softmax_cpu(dtype, batches, s):
    _check_causal_softmax("cpu", dtype, batches, s)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_wgrad_accumulate_cpu(dtype):
    _check_wgrad("cpu", dtype, 37, 11, 23)


def _check_bias_grad(device, dtype, shape, contiguous=True):
    dy = randn(*shape, dtype=dtype, device=device, scale=3.0)
    if not contiguous:  # a transposed view: the op reads it as it is
        dy = dy.transpose(0, 1).contiguous().transpose(0, 1)
    ref = dy.double().reshape(-1, shape[-1]).sum(0)
    out = fused.bias_grad(dy)
    assert out.dtype == dtype and out.shape == (shape[-1],)
    # fp32 accumulation, then one rounding to dtype: the rounding's relative error, whatever the row count
    assert rel_err(out, ref) <= TOL[dtype]
    return out


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (37, 1000), (4, 3, 7)])
def test_bias_grad_cpu(dtype, shape):
    _check_bias_grad("cpu", dtype, shape)
    _check_bias_grad("cpu", dtype, shape, contiguous=False)


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


# ---- GPU: kernels ----------------------------------------------------------------------------

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
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (1023, 1000), (1023, 4097), (64, 16384), (2048, 4, 2048),
                                   (8192, 6144), (5, 0), (0, 8)])
def test_bias_grad_gpu(poisoned, dtype, shape):
    dy = torch.empty(shape, dtype=dtype, device="cuda")
    _assert_kernel_path(dy)
    if dy.numel() == 0:
        assert torch.equal(fused.bias_grad(dy), torch.zeros(shape[-1], dtype=dtype, device="cuda"))
        return
    out = _check_bias_grad("cuda", dtype, shape)
    assert not _check_bias_grad("cuda", dtype, shape, contiguous=False).isnan().any()  # the fallback
    dy = randn(*shape, dtype=dtype, device="cuda")
    assert torch.equal(fused.bias_grad(dy), fused.bias_grad(dy)), "the sum's order must not change from run to run"
    assert out.is_cuda


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
