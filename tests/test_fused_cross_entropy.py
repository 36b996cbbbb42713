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


def check(device: str, dtype: torch.dtype, rows: int, padded: int, vocab: int, smoothing: float,
          inplace: bool = False) -> None:
    g = torch.Generator().manual_seed(rows * 7 + padded)
    logits = (3 * torch.randn(2, rows, padded, generator=g)).to(device=device, dtype=dtype)
    target = torch.randint(0, vocab, (2, rows), generator=g).to(device)
    dy = torch.rand(2, rows, generator=g, dtype=torch.float32).to(device)
    # in place: logits computed from the leaf (x * 1, exact), as a model's output layer computes them
    out, (grad,), _ = fwd_bwd(lambda x: fused.cross_entropy(x * 1 if inplace else x, target, smoothing, vocab,
                                                            inplace_backward=inplace), [logits], [0], dy)
    ref, (ref_grad,), _ = fwd_bwd(lambda x: reference(x, target, smoothing, vocab), [logits.double()], [0],
                                  dy.double())
    where = f"{device} {dtype} rows={rows} padded={padded} vocab={vocab} smoothing={smoothing} inplace={inplace}"
    assert out.dtype == torch.float32, where
    assert rel_err(out, ref) <= 1e-5, f"{where}: loss {rel_err(out, ref):.3g}"
    assert grad.dtype == dtype, where
    assert rel_err(grad, ref_grad) <= TOL[dtype], f"{where}: gradient {rel_err(grad, ref_grad):.3g}"
    assert not grad[..., vocab:].any(), f"{where}: padding columns got a gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded,vocab,smoothing", [(64, 64, 0.0), (64, 50, 0.1), (37, 30, 0.0)])
@pytest.mark.parametrize("inplace", [False, True])
def test_fallback_equals_reference(dtype, padded, vocab, smoothing, inplace):
    check("cpu", dtype, 5, padded, vocab, smoothing, inplace)


def test_inplace_backward_refuses_a_leaf():
    """Writing the gradient over a leaf would overwrite a parameter with its own gradient."""
    leaf = torch.randn(4, 10, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        fused.cross_entropy(leaf, torch.zeros(4, dtype=torch.long), inplace_backward=True)


@gpu
@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,padded,vocab,smoothing", [
    (1, 8, 8, 0.0), (3, 7, 5, 0.0),  # 7: one-element packs
    (5, 50304, 50257, 0.0), (5, 50304, 50257, 0.1),  # GPT-2's vocabulary padded as Megatron pads it
    (2, 128256, 128256, 0.0), (300, 1024, 1000, 0.05)])
@pytest.mark.parametrize("inplace", [False, True])
def test_kernel_equals_reference(dtype, rows, padded, vocab, smoothing, inplace):
    check("cuda", dtype, rows, padded, vocab, smoothing, inplace)


@gpu
def test_kernel_inplace_backward_writes_over_the_logits():
    """With inplace_backward the gradient takes the logits' memory (one logits-sized tensor in the backward,
    not two) and a second backward through the overwritten logits raises instead of reading gradients."""
    leaf = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = leaf * 1
    kept = logits.detach().clone()
    grads = []
    logits.register_hook(lambda g: grads.append(g))
    loss = fused.cross_entropy(logits, torch.arange(6, device="cuda"), inplace_backward=True)
    assert type(loss.grad_fn).__name__ == "_CrossEntropyKernelBackward", "the kernel did not run"
    loss.sum().backward(retain_graph=True)
    assert grads[0].data_ptr() == logits.data_ptr(), "the gradient did not take the logits' memory"
    ref = torch.softmax(kept.float(), -1) - F.one_hot(torch.arange(6, device="cuda"), 64)
    torch.testing.assert_close(leaf.grad.float(), ref, rtol=2e-2, atol=2e-2)
    # torch names the overwrite in one of two messages, by whether it sees the logits or their 2-D view
    with pytest.raises(RuntimeError, match="modified by an inplace operation|modified inplace"):
        loss.sum().backward()
    # without it the logits are left as they were
    logits = leaf * 1
    fused.cross_entropy(logits, torch.arange(6, device="cuda")).sum().backward()
    assert torch.equal(logits.detach(), kept)


@gpu
def test_kernel_runs_and_a_bad_target_gives_nan():
    logits = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.tensor([1, 2, 70, 3], device="cuda")  # 70 >= vocab 64
    loss = fused.cross_entropy(logits, target)
    assert type(loss.grad_fn).__name__ == "_CrossEntropyKernelBackward", "the kernel did not run"
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    loss.sum().backward()
    assert torch.isnan(logits.grad[2]).all() and torch.isfinite(logits.grad[[0, 1, 3]]).all()
