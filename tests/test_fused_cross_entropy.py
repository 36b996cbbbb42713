"""parallel3d.fused.cross_entropy (the loss at TP = 1) against an fp64 reference: the PyTorch fallback
on the CPU, the CUDA kernel on a GPU (padded vocabularies, odd widths, label smoothing, bad targets)."""
import pytest
import torch
import torch.nn.functional as F

import parallel3d.fused as fused
from fused_reference import DTYPES, TOL, fwd_bwd, gpu, rel_err


def reference(logits: torch.Tensor, target: torch.Tensor, smoothing: float, vocab: int) -> torch.Tensor:
    real = logits.double()[..., :vocab]
    return F.cross_entropy(real.flatten(0, -2), target.flatten(), reduction="none",
                           label_smoothing=smoothing).view(target.shape)


def check(device: str, dtype: torch.dtype, rows: int, padded: int, vocab: int, smoothing: float) -> None:
    g = torch.Generator().manual_seed(rows * 7 + padded)
    logits = (3 * torch.randn(2, rows, padded, generator=g)).to(device=device, dtype=dtype)
    target = torch.randint(0, vocab, (2, rows), generator=g).to(device)
    dy = torch.rand(2, rows, generator=g, dtype=torch.float32).to(device)
    out, (grad,), _ = fwd_bwd(lambda x: fused.cross_entropy(x, target, smoothing, vocab), [logits], [0], dy)
    ref, (ref_grad,), _ = fwd_bwd(lambda x: reference(x, target, smoothing, vocab), [logits.double()], [0],
                                  dy.double())
    where = f"{device} {dtype} rows={rows} padded={padded} vocab={vocab} smoothing={smoothing}"
    assert out.dtype == torch.float32, where
    assert rel_err(out, ref) <= 1e-5, f"{where}: loss {rel_err(out, ref):.3g}"
    assert grad.dtype == dtype, where
    assert rel_err(grad, ref_grad) <= TOL[dtype], f"{where}: gradient {rel_err(grad, ref_grad):.3g}"
    assert not grad[..., vocab:].any(), f"{where}: padding columns got a gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded,vocab,smoothing", [(64, 64, 0.0), (64, 50, 0.1), (37, 30, 0.0)])
def test_fallback_equals_reference(dtype, padded, vocab, smoothing):
    check("cpu", dtype, 5, padded, vocab, smoothing)


@gpu
@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,padded,vocab,smoothing", [
    (1, 8, 8, 0.0), (3, 7, 5, 0.0),  # 7: one-element packs
    (5, 50304, 50257, 0.0), (5, 50304, 50257, 0.1),  # GPT-2's vocabulary padded as Megatron pads it
    (2, 128256, 128256, 0.0), (300, 1024, 1000, 0.05)])
def test_kernel_equals_reference(dtype, rows, padded, vocab, smoothing):
    check("cuda", dtype, rows, padded, vocab, smoothing)


@gpu
def test_kernel_runs_and_a_bad_target_gives_nan():
    logits = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.tensor([1, 2, 70, 3], device="cuda")  # 70 >= vocab 64
    loss = fused.cross_entropy(logits, target)
    assert type(loss.grad_fn).__name__ == "_CrossEntropyKernelBackward", "the kernel did not run"
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    loss.sum().backward()
    assert torch.isnan(logits.grad[2]).all() and torch.isfinite(logits.grad[[0, 1, 3]]).all()
