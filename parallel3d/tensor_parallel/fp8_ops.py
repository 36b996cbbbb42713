"""FP8 operands and their GEMM: amax, scale, the saturating cast, and torch._scaled_mm (emulated off CUDA).

An operand is a 2D tensor quantized in the layout cuBLAS's FP8 GEMM reads: ``data`` [rows, K], the
contracted dimension K contiguous, and ``scale`` (fp32) with ``data ~= t * scale``: one element for a
tensor-scaled operand, [rows, 1] for a rowwise one. ``scaled_mm(a, b)`` is a @ b^T over K. Where the
GEMM contracts a tensor's first dimension (dgrad's weight, both wgrad operands) the cast writes the
tensor transposed (layout "col"); "both" writes the two layouts from one read. The cast is one kernel
launch (parallel3d/fused/fp8_cast.py), with its PyTorch reference off the GPU.

The numbers are torchao's float8 ones (tests/test_fp8.py compares where torchao is installed):
scale = fp8_max / max(amax, 1e-12), computed in fp64 and rounded to fp32; data = fp8(clamp(t.float() *
scale)), rounded to nearest even; the GEMM multiplies by ``scale.reciprocal()`` (torch._scaled_mm) or,
emulated, divides by the scale and multiplies in fp32. A rowwise fp32 result is the bf16 one widened:
torch._scaled_mm's rowwise kernel (CUTLASS's, the scales applied to the fp32 accumulator in its epilogue)
writes bf16 only. It accumulates fast or not as asked (torchao's rowwise recipe asks both).

Why not torchao's Float8TrainingTensor, which runs these same operations: its tensor-subclass dispatch
cost more host time per step than the GPU's work on a LLaMA-3B step (BENCHMARKS.md, "FP8 on one H100").
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from parallel3d.fused.fp8_cast import fp8_cast, fp8_cast_reference, local_amax  # noqa: F401 (re-exported)
from parallel3d.fused.grad_accum import wgrad_accumulate_fp8



class Fp8Operand(NamedTuple):
    data: torch.Tensor       # float8 [rows, K], K contiguous
    scale: torch.Tensor      # fp32, one element or [rows, 1]
    scale_inv: torch.Tensor  # 1 / scale: the GEMM's factor


def quantize(t: torch.Tensor, dtype: torch.dtype, layout: str, *, scale: Optional[torch.Tensor] = None,
             amax: Optional[torch.Tensor] = None, fused: bool = True, record: Optional[torch.Tensor] = None
             ) -> tuple[Optional[Fp8Operand], Optional[Fp8Operand]]:
    """(``t``'s operand contracting its dimension 1, the one contracting dimension 0), each None where
    ``layout`` does not ask for it. The scale is ``scale``, or comes from ``amax`` (a rowwise amax is
    kept along the contracted dimension). ``fused``: the one-launch kernel where it runs (the same bytes).
    ``record`` (one fp32 value): the same read also takes ``record = max(record, max |t|)``."""
    if (scale is None) == (amax is None):
        raise ValueError("quantize: give the scale or the amax, one of them")
    cast = fp8_cast if fused else fp8_cast_reference
    row, col, s, inv = cast(t, scale if scale is not None else amax, dtype, layout, amax is not None, record)
    per_row = s.dim() == 2
    return (None if row is None else Fp8Operand(row, s, inv),
            None if col is None else Fp8Operand(col, s.t() if per_row else s, inv.t() if per_row else inv))


def scaled_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype, *, fast_accum: bool, emulate: bool,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b^T (+ bias) in ``out_dtype``, the scales divided out."""
    if emulate:
        out = torch.mm(a.data.float() / a.scale, (b.data.float() / b.scale).t()).to(out_dtype)
        return out if bias is None else out + bias
    rowwise = a.scale.dim() == 2
    scale_a, scale_b = a.scale_inv, b.scale_inv
    scale_b = scale_b.t() if rowwise else scale_b  # [1, N]: one per output column
    dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    # _scaled_mm adds a bias of the result's dtype only, and none to an fp32 result: an fp32 result (or a
    # rowwise fp16 one, computed in bf16) gets its bias added afterwards, in the dtype asked for.
    in_kernel = bias is not None and dtype == out_dtype != torch.float32
    out = torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b,
                           bias=bias if in_kernel else None, out_dtype=dtype, use_fast_accum=fast_accum)
    out = out.to(out_dtype)
    if bias is not None and not in_kernel:
        out += bias
    return out


def scaled_mm_accumulate(a: Fp8Operand, b: Fp8Operand, out: torch.Tensor, *, emulate: bool) -> None:
    """out += a @ b^T (fp32 ``out``, no fast accumulation): with one scale each on CUDA, one GEMM that
    accumulates (fused/grad_accum.py); rowwise or emulated, the product then an add."""
    if emulate or a.scale.dim() == 2:
        out.add_(scaled_mm(a, b, torch.float32, fast_accum=False, emulate=emulate))
    else:
        wgrad_accumulate_fp8(a.data, a.scale_inv, b.data, b.scale_inv, out)
