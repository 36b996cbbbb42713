"""The FP8 operand cast of tensor_parallel/fp8_ops.py: the scale (given, or from an amax), the saturating
cast and the layouts cuBLAS's FP8 GEMM reads, in one kernel launch (csrc/fp8_cast.cu).

For x [M, N] and s (one value, per row [M, 1] or per column [1, N]):

    scale     = s, or fp8_max / max(amax, 1e-12) in fp64 rounded to fp32 (torchao's amax_to_scale)
    q         = fp8(clamp(x.float() * scale, -fp8_max, fp8_max)), rounded to nearest even
    scale_inv = 1 / scale (torch.reciprocal), the factor torch._scaled_mm takes

and q is returned as x's layout ("row"), transposed and contiguous ("col"), or both from one read of x.
With ``amax_out`` (one fp32 value) the same read also records ``amax_out = max(amax_out, max |x|)``, NaN
kept: the delayed recipe's amax without a launch of its own.
Eager PyTorch does this in about ten launches; a step's GEMMs issue thousands of casts, and the host's
launch time was what an FP8 step waited on.
"""
from __future__ import annotations

from typing import Optional

import torch

from parallel3d.fused import _ext

EPS = 1e-12  # torchao's floor under amax: an all-zero tensor gets a finite scale
LAYOUTS = ("row", "col", "both")
Cast = tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]


def local_amax(t: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """max |t| (over ``axis``, kept) in fp32: the infinity norm reads ``t`` once (abs() then amax()
    would write and read a copy), in one launch. A maximum rounds nothing; NaN and inf propagate."""
    return torch.linalg.vector_norm(t, ord=float("inf"), dim=axis, keepdim=axis is not None, dtype=torch.float32)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8_max / amax in fp64, rounded to fp32 (so that every implementation agrees, as in torchao)."""
    return (torch.finfo(dtype).max / torch.clamp(amax.double(), min=EPS)).float()


def fp8_cast_reference(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, layout: str, from_amax: bool,
                       amax_out: Optional[torch.Tensor] = None) -> Cast:
    """(q or None, q^T contiguous or None, scale, scale_inv) in plain PyTorch: the fallback, and what the
    kernel must equal byte for byte."""
    if amax_out is not None:
        torch.maximum(amax_out, local_amax(x.detach()).reshape(amax_out.shape), out=amax_out)
    scale = amax_to_scale(s, dtype) if from_amax else s
    fmax = torch.finfo(dtype).max
    q = (x.float() * scale).clamp(min=-fmax, max=fmax).to(dtype)
    return (None if layout == "col" else q), (None if layout == "row" else q.t().contiguous()), scale, \
        scale.reciprocal()


def fp8_cast(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, layout: str, from_amax: bool,
             amax_out: Optional[torch.Tensor] = None) -> Cast:
    """As :func:`fp8_cast_reference`, on the kernel where it runs (2-D CUDA x, fusion on)."""
    if layout not in LAYOUTS:
        raise ValueError(f"fp8_cast: layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_cast: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"fp8_cast: x must be 2-D, got shape {tuple(x.shape)}")
    per_tensor = s.numel() == 1 and s.dim() < 2
    if not per_tensor and s.shape not in ((x.size(0), 1), (1, x.size(1))):
        raise ValueError(f"fp8_cast: s must hold one value, [{x.size(0)}, 1] or [1, {x.size(1)}]; "
                         f"got shape {tuple(s.shape)}")
    if layout == "both" and not per_tensor:
        raise ValueError("fp8_cast: layout 'both' needs one scale for the tensor (a rowwise scale belongs to one layout)")
    if amax_out is not None and (amax_out.numel() != 1 or amax_out.dtype != torch.float32):
        raise ValueError(f"fp8_cast: amax_out must be one fp32 value, got {amax_out.dtype} {tuple(amax_out.shape)}")
    if not (_ext.use_kernel(x, s) and s.dtype == torch.float32):
        return fp8_cast_reference(x, s, dtype, layout, from_amax, amax_out)
    mode = 0 if per_tensor else 1 if s.shape == (x.size(0), 1) else 2
    row, col, scale, scale_inv = _ext.get_ext().fp8_cast(
        x.contiguous(), s.contiguous(), mode, from_amax, dtype == torch.float8_e5m2, layout != "col", layout != "row",
        amax_out)
    return (row if layout != "col" else None), (col if layout != "row" else None), scale, scale_inv
