"""Gradient-accumulation fusion: accumulate a linear layer's weight gradient into main_grad.

Megatron's ``gradient_accumulation_fusion``: instead of computing the weight
gradient ``grad_output^T @ input`` into a new tensor and adding it to the fp32
``main_grad`` buffer, one cuBLAS GEMM with beta = 1 writes into ``main_grad``.
"""
from __future__ import annotations

import torch

from parallel3d.fused import _ext


def _check(input2d: torch.Tensor, grad_output2d: torch.Tensor, main_grad: torch.Tensor) -> None:
    if input2d.dim() != 2 or grad_output2d.dim() != 2:
        raise ValueError(
            f"wgrad_accumulate: input and grad_output must be 2-D [tokens, features], got "
            f"{tuple(input2d.shape)} and {tuple(grad_output2d.shape)}"
        )
    n, in_features = input2d.shape
    if grad_output2d.shape[0] != n:
        raise ValueError(f"wgrad_accumulate: input has {n} rows but grad_output has {grad_output2d.shape[0]}")
    out_features = grad_output2d.shape[1]
    if tuple(main_grad.shape) != (out_features, in_features):
        raise ValueError(
            f"wgrad_accumulate: main_grad must be [{out_features}, {in_features}] (out, in), "
            f"got {tuple(main_grad.shape)}"
        )
    if main_grad.dtype != torch.float32:
        raise ValueError(f"wgrad_accumulate: main_grad must be float32, got {main_grad.dtype}")
    if input2d.dtype != grad_output2d.dtype:
        raise ValueError(f"wgrad_accumulate: input dtype {input2d.dtype} differs from grad_output dtype {grad_output2d.dtype}")
    if input2d.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"wgrad_accumulate: unsupported dtype {input2d.dtype}")
    if not (input2d.device == grad_output2d.device == main_grad.device):
        raise ValueError(
            f"wgrad_accumulate: tensors on different devices: {input2d.device}, {grad_output2d.device}, {main_grad.device}"
        )


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """t itself if cuBLAS can read it as row-major rows (unit column stride), else a copy."""
    if t.stride(1) == 1 and t.stride(0) >= max(t.shape[1], 1):
        return t
    return t.contiguous()


@torch.no_grad()
def wgrad_accumulate(input2d: torch.Tensor, grad_output2d: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output2d.T @ input2d`` in place.

    input2d [N, in] and grad_output2d [N, out] share a dtype (bf16, fp16 or fp32);
    main_grad is the fp32 [out, in] gradient buffer.  With the CUDA extension this
    is one GEMM with fp32 accumulation into main_grad (TF32 off for fp32 operands).
    Without it: on CUDA, the GEMM in the operands' dtype followed by an add (what
    Megatron does without the fusion); on CPU, an fp32 addmm.
    """
    _check(input2d, grad_output2d, main_grad)
    if _ext.use_kernel(input2d, grad_output2d, main_grad) and main_grad.is_contiguous():
        _ext.get_ext().wgrad_gemm_accum_fp32(_row_major(input2d), _row_major(grad_output2d), main_grad)
        return
    if input2d.is_cuda and input2d.dtype != torch.float32:
        main_grad.add_(grad_output2d.t() @ input2d)
    else:
        main_grad.addmm_(grad_output2d.t().float(), input2d.float())


def wgrad_accumulate_fp8_reference(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                                   b_scale_inv: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += (a @ b^T) * a_scale_inv * b_scale_inv`` in plain PyTorch (CUDA): the fp32 product of
    torch._scaled_mm, then an add."""
    main_grad.add_(torch._scaled_mm(a, b.t(), scale_a=a_scale_inv, scale_b=b_scale_inv, out_dtype=torch.float32))


@torch.no_grad()
def wgrad_accumulate_fp8(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                         main_grad: torch.Tensor) -> None:
    """The FP8 weight gradient accumulated into main_grad: ``main_grad[out, in] += (a[out, K] @ b[in, K]^T) *
    a_scale_inv * b_scale_inv`` for FP8 operands with one scale each (tensor_parallel/fp8.py's wgrad: K the
    tokens, contiguous). With the CUDA extension one cuBLASLt GEMM with beta = 1 writes main_grad, as
    :func:`wgrad_accumulate` does in bf16; without it, :func:`wgrad_accumulate_fp8_reference`."""
    if a.dim() != 2 or b.dim() != 2 or a.size(1) != b.size(1):
        raise ValueError(f"wgrad_accumulate_fp8: a [out, K] and b [in, K] must share K, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if tuple(main_grad.shape) != (a.size(0), b.size(0)) or main_grad.dtype != torch.float32:
        raise ValueError(f"wgrad_accumulate_fp8: main_grad must be float32 [{a.size(0)}, {b.size(0)}], got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    if _ext.use_kernel(main_grad, a, b) and main_grad.is_contiguous() and a.is_contiguous() and b.is_contiguous() \
            and not (a.dtype == b.dtype == torch.float8_e5m2):
        _ext.get_ext().wgrad_gemm_accum_fp8(a, a_scale_inv.float(), b, b_scale_inv.float(), main_grad)
        return
    wgrad_accumulate_fp8_reference(a, a_scale_inv, b, b_scale_inv, main_grad)
