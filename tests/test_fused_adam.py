"""fused.adamw_master_step: the CUDA kernel against its PyTorch reference and torch's AdamW."""
import pytest
import torch

import parallel3d.fused as fused
from parallel3d.fused import adam
from fused_reference import gpu


def _lists(sizes, device, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda scale=1.0: [(torch.randn(n, generator=g) * scale).to(device) for n in sizes]  # noqa: E731
    return make(), make(0.1), [torch.zeros(n, device=device) for n in sizes], [torch.zeros(n, device=device)
                                                                            for n in sizes]


def test_reference_equals_torch_adamw_with_clip_cpu():
    params, grads, m, v = _lists([5, 300, 1], "cpu", 0)
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    model = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    for step in (1, 2, 3):
        fused.adamw_master_step(params, grads, m, v, model, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, 0.25)
        for r, gr in zip(ref, grads):
            r.grad = gr * 0.25
        opt.step()
    for p, r, mp in zip(params, ref, model):
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(mp, p.to(torch.bfloat16))


def test_list_lengths_are_checked():
    with pytest.raises(ValueError, match="same length"):
        fused.adamw_master_step([torch.zeros(2)], [], [], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)


@gpu
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, None])
def test_kernel_equals_reference_gpu(model_dtype):
    # 40 tensors (batches of 24), chunks of 65,536 elements, 320 a launch: tensors cut between launches,
    # empty and one-element tensors
    sizes = [600_000] * 30 + [0, 1, 3, 65_536, 65_537] + [70_001] * 5
    kernel, reference = _lists(sizes, "cuda", 1), _lists(sizes, "cuda", 1)
    models = [[torch.empty(n, device="cuda", dtype=model_dtype) for n in sizes] if model_dtype else []
              for _ in range(2)]
    assert adam.use_kernel(kernel, models[0]), "the CUDA kernel path is not taken"
    for step in (1, 2, 3, 4):
        fused.adamw_master_step(*kernel, models[0], 3e-3, 0.9, 0.95, 1e-8, 0.1, step, 0.5)
        fused.adamw_master_step_reference(*reference, models[1], 3e-3, 0.9, 0.95, 1e-8, 0.1, step, 0.5)
    for got, want in zip(kernel[0] + kernel[2] + kernel[3], reference[0] + reference[2] + reference[3]):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    for p, mp in zip(kernel[0], models[0]):
        assert torch.equal(mp, p.to(model_dtype))
