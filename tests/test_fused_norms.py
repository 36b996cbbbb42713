"""parallel3d.fused LayerNorm and RMSNorm against fp64 references: the CPU fallbacks and the CUDA kernels."""
import pytest
import torch
import torch.nn.functional as F

import parallel3d.fused as fused
from parallel3d.fused import _ext
from fused_reference import (
    CPU_DTYPES, CPU_ROWS_HIDDEN, DTYPES, GPU_ROWS_HIDDEN, TOL, check_against_reference, gpu, randn, rel_err,
)

# The norm kernels also change shape with the row: 16383 takes 16 scalar packs per
# thread, 2048 puts several rows in a block (257 leaves one partly filled), and
# 20000 rows of 64 make each block of the persistent backward grid loop.
NORM_GPU_ROWS_HIDDEN = GPU_ROWS_HIDDEN + [(3, 16383), (257, 2048), (20000, 64)]


# ---- fp64 references and checks --------------------------------------------------------------

def ref_layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * w
    return y + b if b is not None else y


def ref_rms_norm(x, w, eps):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w


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


# ---- CPU: fallbacks --------------------------------------------------------------------------

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


# ---- GPU: kernels ----------------------------------------------------------------------------

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


def _check_norm_with_residual(device, dtype, rows, hidden, rms):
    """(norm(x), x) with the residual's gradient summed into x's by the norm's backward kernel: the output
    y + r / 2 and every gradient against fp64."""
    x = randn(rows, hidden, dtype=dtype, device=device, scale=3.0) + 0.5
    w = randn(hidden, dtype=dtype, device=device)
    if rms:
        fn = lambda x, w: _plus_half(*fused.rms_norm_with_residual(x, w, 1e-6))  # noqa: E731
        ref = lambda x, w: ref_rms_norm(x, w, 1e-6) + x / 2  # noqa: E731
        args, idx = [x, w], [0, 1]
    else:
        b = randn(hidden, dtype=dtype, device=device)
        fn = lambda x, w, b: _plus_half(*fused.layer_norm_with_residual(x, w, b, 1e-5))  # noqa: E731
        ref = lambda x, w, b: ref_layer_norm(x, w, b, 1e-5) + x / 2  # noqa: E731
        args, idx = [x, w, b], [0, 1, 2]
    check_against_reference(fn, ref, args, idx, TOL[dtype],
                            floors={0: _norm_dx_floor(rms), 1: lambda a, dy: dy.norm().item()})


def _plus_half(y, residual):
    return y + residual / 2


class _NormExtOnCpu:
    """The norm kernels' contract in plain PyTorch on the CPU (fp32), recording whether backward got the
    residual's gradient: the wiring of the with_residual Functions, testable without a GPU."""

    def __init__(self):
        self.dresiduals = []

    def _fwd(self, x, w, b, eps, rms):
        xf = x.float()
        mean = torch.zeros(x.shape[0]) if rms else xf.mean(-1)
        var = (xf ** 2).mean(-1) if rms else ((xf - mean[:, None]) ** 2).mean(-1)
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean[:, None]) * rstd[:, None] * w.float() + (b.float() if b is not None else 0)
        return y.to(x.dtype), mean, rstd

    def _bwd(self, dy, x, eps_unused, w, b, dres, rms):
        self.dresiduals.append(dres)
        with torch.enable_grad():  # (backward runs without it)
            xr = x.detach().float().requires_grad_()
            wr, br = w.detach().float().requires_grad_(), None if b is None else b.detach().float().requires_grad_()
            y = F.rms_norm(xr, (x.shape[-1],), wr, 1e-6) if rms else F.layer_norm(xr, (x.shape[-1],), wr, br, 1e-5)
            grads = torch.autograd.grad(y, [xr, wr] + ([br] if br is not None else []), dy.float())
        dx = grads[0] + (dres.float() if dres is not None else 0)
        return [dx.to(x.dtype)] + [g.to(w.dtype) for g in grads[1:]]

    def layer_norm_fwd(self, x, w, b, eps):
        return list(self._fwd(x, w, b, eps, False))

    def layer_norm_bwd(self, dy, x, mean, rstd, w, has_bias, dresidual=None):
        return self._bwd(dy, x, None, w, w if has_bias else None, dresidual, False)  # (a bias's value: no gradient)

    def rms_norm_fwd(self, x, w, eps):
        y, _, rstd = self._fwd(x, w, None, eps, True)
        return [y, rstd]

    def rms_norm_bwd(self, dy, x, rstd, w, dresidual=None):
        return self._bwd(dy, x, None, w, None, dresidual, True)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_with_residual_adds_the_residual_gradient_in_the_kernel_cpu(monkeypatch, rms):
    ext = _NormExtOnCpu()
    monkeypatch.setattr(_ext, "get_ext", lambda: ext)
    monkeypatch.setattr(_ext, "use_kernel", lambda *tensors: True)
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    b = None if rms else torch.randn(16, requires_grad=True)
    h = x * 1.0  # a non-leaf, as a layer's input is
    y, residual = fused.rms_norm_with_residual(h, w, 1e-6) if rms else fused.layer_norm_with_residual(h, w, b, 1e-5)
    assert torch.equal(residual, h)
    (y * 3 + residual * 5).sum().backward()
    assert len(ext.dresiduals) == 1 and torch.equal(ext.dresiduals[0], torch.full((6, 16), 5.0)), \
        "the residual's gradient did not reach the norm's backward kernel"
    params = [w] + ([b] if b is not None else [])
    got = [t.grad.clone() for t in [x] + params]
    for t in [x] + params:
        t.grad = None
    norm = lambda t: F.rms_norm(t, (16,), w, 1e-6) if rms else F.layer_norm(t, (16,), w, b, 1e-5)  # noqa: E731
    (norm(x * 1.0) * 3 + x * 5).sum().backward()
    for g, t in zip(got, [x] + params):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 1), (3, 7), (257, 2048), (3, 16383), (20000, 64)])
@pytest.mark.parametrize("rms", [False, True])
def test_norm_with_residual_gpu(poisoned, dtype, rows, hidden, rms):
    _check_norm_with_residual("cuda", dtype, rows, hidden, rms)


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
