"""parallel3d.fused rotary embeddings (sbhd / bhsd, q and k together) against fp64 Megatron-Core and HF references."""
import pytest
import torch

import parallel3d.fused as fused
from fused_reference import (CPU_DTYPES, DTYPES, TOL, check_against_reference, emulated_rope_apply, gpu, randn,
                             rel_err)


# ---- fp64 references (written from Megatron-Core / HF, independent of the wrappers) and checks 


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


def rope_freqs(s, rot, device, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((f, f), dim=-1)  # [s, rot]


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


# ---- CPU: fallbacks --------------------------------------------------------------------------

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


# ---- GPU: kernels ----------------------------------------------------------------------------

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


# ---- linear_qkv's output split and rotated in place (split_qkv_rope) -------------------------

def _check_split_qkv_rope(device, dtype, per_sample=False):
    """split_qkv_rope against torch.split and the fp64 Megatron rotation: q (3 heads a group, 2 groups), k and
    v; the gradient of linear_qkv's output from strided q/k/v gradients, as SDPA's [b, n, s, d] permuted."""
    s, b, ng, qpg, d, rot = 9, 2, 2, 3, 16, 8
    mixed = randn(s, b, ng, (qpg + 2) * d, dtype=dtype, device=device)
    if per_sample:
        freqs = torch.stack([rope_freqs(s + 3 * i, rot, device)[3 * i:] for i in range(b)], dim=1)[:, :, None]
    else:
        freqs = rope_freqs(s + 5, rot, device)[:, None, None]
    grads = [randn(b, n, s, d, dtype=dtype, device=device).permute(2, 0, 1, 3) for n in (ng * qpg, ng, ng)]

    got_in = mixed.clone().requires_grad_()
    got = fused.split_qkv_rope(got_in, qpg, d, freqs)
    torch.autograd.backward(got, grads)
    ref_in = mixed.double().requires_grad_()
    q, k, v = torch.split(ref_in, [qpg * d, d, d], dim=3)
    want = (ref_rope_megatron(q.reshape(s, b, ng * qpg, d), freqs[:s].double()),
            ref_rope_megatron(k, freqs[:s].double()), v)
    torch.autograd.backward(want, [g.double() for g in grads])
    for name, x, y in zip("qkv", got, want):
        assert x.shape == y.shape and rel_err(x, y) <= TOL[dtype], name
    assert rel_err(got_in.grad, ref_in.grad) <= TOL[dtype]
    return got


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("per_sample", [False, True])
def test_split_qkv_rope_cpu(dtype, per_sample):
    _check_split_qkv_rope("cpu", dtype, per_sample)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_split_qkv_rope_through_the_kernels_contract_cpu(monkeypatch, dtype):
    """The kernel's path (one autograd function writing the three gradients into one tensor) with the kernel
    emulated: what the GPU case below checks with the kernel itself."""
    from types import SimpleNamespace

    from parallel3d.fused import _ext, rope

    calls = []
    monkeypatch.setattr(_ext, "use_kernel", lambda *tensors: True)
    monkeypatch.setattr(_ext, "get_ext", lambda: SimpleNamespace(
        rope_apply=lambda *a: (calls.append(a[4:]), emulated_rope_apply(*a))))
    q, k, v = _check_split_qkv_rope("cpu", dtype)
    assert calls == [(False,), (True, True)]  # one launch each way, v's gradient copied in the second
    assert type(q.grad_fn).__name__ == rope._QKVRoPEFunction.__name__ + "Backward"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_sample", [False, True])
def test_split_qkv_rope_gpu(poisoned, dtype, per_sample):
    _check_split_qkv_rope("cuda", dtype, per_sample)


# ---- linear_qkv's output split, its bias's gradient summed in the merge (split_qkv) ------------

def _check_split_qkv(device, dtype, qpg=3, d=16, bias_grad=True, strided=True):
    """split_qkv against torch.split of (output + bias) in fp64: the views, the output's gradient merged from
    q/k/v gradients (strided as SDPA's [b, n, s, d] permuted, or contiguous) and the bias's gradient."""
    s, b, ng = 9, 2, 2
    raw = randn(s, b, ng, (qpg + 2) * d, dtype=dtype, device=device)
    bias = randn(ng * (qpg + 2) * d, dtype=dtype, device=device)
    if strided:
        grads = [randn(b, n, s, d, dtype=dtype, device=device).permute(2, 0, 1, 3) for n in (ng * qpg, ng, ng)]
    else:
        grads = [randn(s, b, n, d, dtype=dtype, device=device) for n in (ng * qpg, ng, ng)]

    got_raw, got_bias = raw.clone().requires_grad_(), bias.clone().requires_grad_(bias_grad)
    got = fused.split_qkv(got_raw + got_bias.detach().view(ng, -1), qpg, d, got_bias)
    torch.autograd.backward(got, grads)
    ref_raw, ref_bias = raw.double().requires_grad_(), bias.double().requires_grad_()
    q, k, v = torch.split(ref_raw + ref_bias.view(ng, -1), [qpg * d, d, d], dim=3)
    want = (q.reshape(s, b, ng * qpg, d), k, v)
    torch.autograd.backward(want, [g.double() for g in grads])
    for name, x, y in zip("qkv", got, want):
        assert x.shape == y.shape and rel_err(x, y) <= TOL[dtype], name
    assert torch.equal(got_raw.grad, ref_raw.grad.to(dtype))  # a copy: exact
    if bias_grad:
        assert got_bias.grad.dtype == dtype and rel_err(got_bias.grad, ref_bias.grad) <= TOL[dtype]
    else:
        assert got_bias.grad is None
    return got


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("qpg", [1, 3])
def test_split_qkv_cpu(dtype, qpg):
    _check_split_qkv("cpu", dtype, qpg)


def test_split_qkv_without_bias_is_torch_split_cpu():
    mixed = randn(5, 2, 2, 3 * 8, dtype=torch.float32, device="cpu")
    q, k, v = fused.split_qkv(mixed, 1, 8)
    assert q._base is mixed and k._base is mixed and v._base is mixed  # views, no autograd function


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_split_qkv_through_the_kernels_contract_cpu(monkeypatch, dtype):
    """The kernel's path with the kernel emulated: dq as [s, b, groups, q heads a group, d], dk and dv as
    [s, b, groups, d], one launch that also sums the bias's gradient (the GPU cases check the kernel)."""
    from types import SimpleNamespace

    from parallel3d.fused import _ext

    calls = []

    def merge(dq, dk, dv, with_sum):
        calls.append((dq.dim(), dk.dim(), dv.dim(), with_sum))
        out = torch.cat([dq.flatten(3), dk, dv], dim=3)
        return [out, out.flatten(0, 1).sum((0,), dtype=torch.float32).flatten().to(out.dtype)]

    monkeypatch.setattr(_ext, "use_kernel", lambda *tensors: True)
    monkeypatch.setattr(_ext, "get_ext", lambda: SimpleNamespace(qkv_grad_merge=merge))
    _check_split_qkv("cpu", dtype)
    assert calls == [(5, 4, 4, True)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qpg,d,strided", [(1, 16, True), (3, 16, True), (1, 64, False), (2, 6, True)])
def test_split_qkv_gpu(poisoned, dtype, qpg, d, strided):
    _check_split_qkv("cuda", dtype, qpg, d, strided=strided)


@gpu
def test_split_qkv_frozen_bias_gpu(poisoned):
    _check_split_qkv("cuda", torch.bfloat16, bias_grad=False)
