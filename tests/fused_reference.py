"""Shared by tests/test_fused_*.py: the GPU skip mark, tolerances, shapes and the fp64 comparison helpers.

parallel3d.fused: every op against an fp64 reference, forward and backward.
CPU tests exercise the PyTorch fallbacks (what CI runs).  GPU tests run the CUDA
kernels on fresh random data over many shapes, odd ones included, with every
output the kernels allocate poisoned with NaN first (the ``poisoned`` fixture in
tests/conftest.py, so an unwritten element fails); they skip, with the reason,
where there is no CUDA device or extension.
Error metric: ||out - ref|| / ||ref|| with ref in fp64 from the same inputs;
tolerances by output dtype (fp32 arithmetic lands far under 1e-3, bf16 output
rounding alone is ~2e-3).
"""
from __future__ import annotations

import pytest
import torch

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
CPU_ROWS_HIDDEN = [(1, 1), (3, 7), (37, 1000), (2, 4097)]


# ---- helpers ---------------------------------------------------------------------------------

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


def emulated_rope_apply(ts, cos, sin, outs, backward, copy_last=False):
    """The kernel's contract in PyTorch (csrc/rope.cu): each t, a 4-D [s, b, h, d] or 5-D [s, b, g, h, d]
    view, rotated (backward: the transposed rotation) into its out, in fp32 and rounded once; with
    copy_last, the last t copied unrotated."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    assert len(ts) == len(outs) and 1 <= len(ts) - copy_last <= 2 and (len(ts) >= 2 or not copy_last)
    for i, (t, out) in enumerate(zip(ts, outs)):
        assert t.dim() in (4, 5) and out.shape == t.shape and t.stride(-1) == out.stride(-1) == 1
        if copy_last and i == len(ts) - 1:
            out.copy_(t)
            continue
        x = t.float().reshape(t.shape[0], t.shape[1], -1, t.shape[-1])
        c, sn = cos[:, :, None], sin[:, :, None]
        y = x[..., :rot] * sn
        turned = torch.cat((y[..., half:], -y[..., :half]), -1) if backward else \
            torch.cat((-x[..., half:rot], x[..., :half]), -1) * sn
        x = torch.cat((x[..., :rot] * c + turned, x[..., rot:]), -1)
        out.copy_(x.view(out.shape).to(out.dtype))
