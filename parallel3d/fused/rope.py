"""Fused rotary position embedding (non-interleaved, "rotate_half" convention).

Matches Megatron-Core's ``apply_rotary_pos_emb`` (layout "sbhd": t [s, b, h, d],
freqs [S, 1, 1, rot_dim], or [S, b, 1, rot_dim] for per-sample positions) and HF
LLaMA's ``apply_rotary_pos_emb`` (layout "bhsd": t [b, h, s, d], with cos/sin =
cos/sin of freqs [S, rot_dim], [1 or b, S, rot_dim] or [1 or b, 1, S, rot_dim]).  In both,
freqs are the angles ``cat(inv_freq * pos, inv_freq * pos)``; the first
``rot_dim`` features of each head rotate as

    out = t * cos(freqs) + rotate_half(t) * sin(freqs),  rotate_half(x) = cat(-x2, x1)

and features past ``rot_dim`` pass through (partial rotary).  Only the first s
rows of freqs are used (S >= s), like Megatron's fused path.  Arithmetic is fp32
and the result is rounded once to t's dtype.  The kernel takes fp32 cos and sin
of the angles, computed by torch once per freqs tensor (see ``_cos_sin``).
"""
from __future__ import annotations

import torch

from parallel3d.fused import _ext
from parallel3d.fused.bias_grad import bias_grad_reference

_LAYOUTS = ("sbhd", "bhsd")


def _as_sbhd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "sbhd" else t.permute(2, 0, 1, 3)


class _RoPEFunction(torch.autograd.Function):
    """Rotates one tensor or two (q and k) in one kernel launch."""

    @staticmethod
    def forward(ctx, cos: torch.Tensor, sin: torch.Tensor, layout: str, *ts: torch.Tensor):
        outs = [torch.empty_like(t) for t in ts]
        _ext.get_ext().rope_apply([_as_sbhd(t, layout) for t in ts], cos, sin, [_as_sbhd(o, layout) for o in outs], False)
        ctx.save_for_backward(cos, sin)
        ctx.layout = layout
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dys = [dy if dy.stride(-1) == 1 else dy.contiguous() for dy in dys]
        dts = [torch.empty_like(dy) for dy in dys]
        _ext.get_ext().rope_apply(
            [_as_sbhd(dy, ctx.layout) for dy in dys], cos, sin, [_as_sbhd(dt, ctx.layout) for dt in dts], True
        )
        return (None, None, None, *dts)


def _cos_sin(freqs: torch.Tensor, f3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin of f3 (a view of freqs), contiguous, for the kernel.

    Every layer of a forward (and its recomputation) passes the same freqs
    tensor, so they are computed once per step and kept on that tensor, keyed by
    the view taken and freqs' version counter (an in-place change recomputes).
    """
    key = (tuple(f3.shape), f3.stride(), f3.storage_offset(), freqs._version)
    cached = getattr(freqs, "_parallel3d_cos_sin", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    f = f3.float()
    cos_sin = (torch.cos(f).contiguous(), torch.sin(f).contiguous())
    freqs._parallel3d_cos_sin = (key, cos_sin)
    return cos_sin


def _freqs_3d(t: torch.Tensor, freqs: torch.Tensor, layout: str) -> torch.Tensor:
    """freqs as [s, bf, rot_dim] (bf = 1 or the batch size), its first s positions."""
    if layout not in _LAYOUTS:
        raise ValueError(f"apply_rotary_pos_emb: layout must be one of {_LAYOUTS}, got {layout!r}")
    if t.dim() != 4:
        raise ValueError(f"apply_rotary_pos_emb: t must be 4-D ({layout}), got shape {tuple(t.shape)}")
    s, b = (t.shape[0], t.shape[1]) if layout == "sbhd" else (t.shape[2], t.shape[0])
    d = t.shape[-1]
    rot = freqs.shape[-1]
    if rot < 2 or rot % 2 != 0 or rot > d:
        raise ValueError(f"apply_rotary_pos_emb: rot_dim = freqs.shape[-1] must be even and in [2, {d}], got {rot}")
    if freqs.dim() == 2:  # [S, rot]
        f3 = freqs.unsqueeze(1)
    elif layout == "sbhd" and freqs.dim() == 4 and freqs.shape[2] == 1:  # [S, 1 or b, 1, rot]
        f3 = freqs.squeeze(2)
    elif layout == "bhsd" and freqs.dim() == 4 and freqs.shape[1] == 1:  # [1 or b, 1, S, rot]
        f3 = freqs.squeeze(1).transpose(0, 1)
    elif layout == "bhsd" and freqs.dim() == 3:  # [1 or b, S, rot]
        f3 = freqs.transpose(0, 1)
    else:
        expected = "[S, 1 or b, 1, rot_dim]" if layout == "sbhd" else "[1 or b, 1, S, rot_dim] or [1 or b, S, rot_dim]"
        raise ValueError(
            f"apply_rotary_pos_emb: freqs for layout {layout} must be [S, rot_dim] or {expected}, got {tuple(freqs.shape)}"
        )
    if f3.shape[1] not in (1, b):
        raise ValueError(f"apply_rotary_pos_emb: freqs batch dim must be 1 or {b}, got {f3.shape[1]}")
    if f3.shape[0] < s:
        raise ValueError(f"apply_rotary_pos_emb: freqs cover {f3.shape[0]} positions but t has {s}")
    return f3[:s]


def apply_rotary_pos_emb_reference(t: torch.Tensor, freqs: torch.Tensor, layout: str = "sbhd",
                                   in_fp32: bool = True) -> torch.Tensor:
    """The op in plain PyTorch: the fallback off the GPU and the model's unfused path (its one reference).
    ``in_fp32``: computed in fp32 (at least) and rounded once, as the kernel; False: in t's dtype, Megatron's
    unfused RoPE."""
    return _rotate(t, _freqs_3d(t, freqs, layout), layout, in_fp32)


def _rotate(t: torch.Tensor, f3: torch.Tensor, layout: str, in_fp32: bool = True) -> torch.Tensor:
    rot = f3.shape[-1]
    compute = torch.promote_types(t.dtype, torch.float32) if in_fp32 else t.dtype
    f = f3.to(compute) if in_fp32 else f3  # unfused: cos and sin in the angles' dtype, then t's
    f = f.unsqueeze(2) if layout == "sbhd" else f.transpose(0, 1).unsqueeze(1)  # broadcastable to t
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    x = t_rot.to(compute)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (x * torch.cos(f).to(compute) + rotated * torch.sin(f).to(compute)).to(t.dtype)
    return torch.cat((out, t_pass), dim=-1)


def _kernel_ok(t: torch.Tensor, freqs: torch.Tensor, layout: str) -> bool:
    return _ext.use_kernel(t, freqs) and t.shape[1 if layout == "sbhd" else 0] <= 65535


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, layout: str = "sbhd") -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` features of every head of t by the angles in freqs."""
    f3 = _freqs_3d(t, freqs, layout)
    if _kernel_ok(t, freqs, layout):
        return _RoPEFunction.apply(*_cos_sin(freqs, f3), layout, _last_dim_contiguous(t))[0]
    return _rotate(t, f3, layout)


def apply_rotary_pos_emb_qk(
    q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, layout: str = "sbhd"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs))`` in one kernel launch.

    q and k may differ in head count (grouped-query attention) but share the
    other dimensions and the dtype.
    """
    f3 = _freqs_3d(q, freqs, layout)
    _freqs_3d(k, freqs, layout)
    same = q.dtype == k.dtype and q.device == k.device and (
        q.shape[:2] == k.shape[:2] if layout == "sbhd" else (q.shape[0], q.shape[2]) == (k.shape[0], k.shape[2])
    ) and q.shape[-1] == k.shape[-1]
    if same and _kernel_ok(q, freqs, layout) and _kernel_ok(k, freqs, layout):
        return _RoPEFunction.apply(*_cos_sin(freqs, f3), layout, _last_dim_contiguous(q), _last_dim_contiguous(k))
    return apply_rotary_pos_emb(q, freqs, layout), apply_rotary_pos_emb(k, freqs, layout)


class _QKVRoPEFunction(torch.autograd.Function):
    """linear_qkv's output [s, b, ng, (qpg + 2) d] -> rotated q [s, b, ng * qpg, d], rotated k [s, b, ng, d],
    and v, a view of it. Backward writes the three gradients straight into one [s, b, ng, (qpg + 2) d]
    tensor in one launch (v's copied), where torch.split's backward would concatenate them after the rotation
    wrote two of them, and the forward reads q in place, where q.reshape would copy it (grouped heads do not
    merge into one stride)."""

    @staticmethod
    def forward(ctx, mixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qpg: int, d: int):
        s, b, ng, _ = mixed.shape
        q_in, k_in, v = torch.split(mixed, [qpg * d, d, d], dim=3)
        q = mixed.new_empty(s, b, ng * qpg, d)
        k = mixed.new_empty(s, b, ng, d)
        _ext.get_ext().rope_apply([q_in.unflatten(3, (qpg, d)), k_in], cos, sin, [q.view(s, b, ng, qpg, d), k], False)
        ctx.save_for_backward(cos, sin)
        ctx.shape, ctx.dtype, ctx.qpg, ctx.d = mixed.shape, mixed.dtype, qpg, d
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        ng, qpg, d = ctx.shape[2], ctx.qpg, ctx.d
        dmixed = torch.empty(ctx.shape, dtype=ctx.dtype, device=cos.device)
        dq_out, dk_out, dv_out = torch.split(dmixed, [qpg * d, d, d], dim=3)
        # an unused output's gradient comes as zeros (autograd materializes it), never None
        dq, dk, dv = (_last_dim_contiguous(t) for t in (dq, dk, dv))
        _ext.get_ext().rope_apply([dq.unflatten(2, (ng, qpg)), dk, dv], cos, sin,
                                  [dq_out.unflatten(3, (qpg, d)), dk_out, dv_out], True, True)
        return dmixed, None, None, None, None


class _SplitQKVFunction(torch.autograd.Function):
    """torch.split of linear_qkv's output, and the gradient of linear_qkv's bias: the linear adds the bias in its
    GEMM but leaves this gradient here (``linear_qkv(x, defer_bias_grad=True)``), where one kernel
    writes dq, dk and dv into the [s, b, ng, (qpg + 2) d] gradient and sums its columns in the same pass.
    torch.split's backward would concatenate them and the linear read the result again for the sum."""

    @staticmethod
    def forward(ctx, mixed: torch.Tensor, bias: torch.Tensor, qpg: int, d: int):
        ctx.shape, ctx.qpg, ctx.d = mixed.shape[:3], qpg, d
        return split_qkv(mixed, qpg, d)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        (s, b, ng), qpg, d = ctx.shape, ctx.qpg, ctx.d
        want_sum = ctx.needs_input_grad[1]
        if _ext.use_kernel(dq, dk, dv):  # an unused output's gradient comes as zeros, never None
            dq, dk, dv = (_last_dim_contiguous(t) for t in (dq, dk, dv))
            out = _ext.get_ext().qkv_grad_merge(dq.unflatten(2, (ng, qpg)), dk, dv, want_sum)
            return out[0], (out[1] if want_sum else None), None, None
        dmixed = torch.cat([dq.reshape(s, b, ng, qpg * d), dk, dv], dim=3)
        return dmixed, (bias_grad_reference(dmixed.flatten(2)) if want_sum else None), None, None


def split_qkv(mixed: torch.Tensor, qpg: int, d: int, bias: torch.Tensor | None = None):
    """linear_qkv's output [s, b, ng, (qpg + 2) d] (Megatron's layout: each group's qpg query heads, then its
    key and value) -> (q [s, b, ng * qpg, d], k [s, b, ng, d], v [s, b, ng, d]), as torch.split and reshape.
    ``bias``: linear_qkv's bias, already added to ``mixed`` by a linear called with ``defer_bias_grad=True``;
    its gradient (the column sum of mixed's) comes from here. None: no bias, or the linear computes its own;
    torch.split's views, then."""
    if bias is not None:
        return _SplitQKVFunction.apply(mixed, bias, qpg, d)
    s, b, ng, _ = mixed.shape
    q, k, v = torch.split(mixed, [qpg * d, d, d], dim=3)
    return q.reshape(s, b, ng * qpg, d), k, v


def split_qkv_rope(mixed: torch.Tensor, qpg: int, d: int, freqs: torch.Tensor):
    """linear_qkv's output [s, b, ng, (qpg + 2) d] (Megatron's layout: each group's qpg query heads, then its
    key and value) -> (q [s, b, ng * qpg, d], k [s, b, ng, d], v [s, b, ng, d]), q and k rotated by freqs
    (``apply_rotary_pos_emb``'s sbhd freqs). One kernel each way on the GPU; elsewhere the same as
    torch.split, reshape and ``apply_rotary_pos_emb_qk``."""
    s, b, ng, _ = mixed.shape
    q, k, v = torch.split(mixed, [qpg * d, d, d], dim=3)
    f3 = _freqs_3d(k, freqs, "sbhd")
    if mixed.stride(-1) == 1 and _kernel_ok(mixed, freqs, "sbhd"):
        return _QKVRoPEFunction.apply(mixed, *_cos_sin(freqs, f3), qpg, d)
    q, k = apply_rotary_pos_emb_qk(q.reshape(s, b, ng * qpg, d), k, freqs)
    return q, k, v
