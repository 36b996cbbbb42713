"""FP8 GEMMs of the tensor-parallel linears: Megatron's recipe fields, torchao's float8 primitives.

A linear has three GEMMs, each on two quantized operands (roles, torchao's names):

    fprop  out        = input       @ weight^T    e4m3 x e4m3
    dgrad  grad_input = grad_output @ weight      grad_output e5m2 under "hybrid", e4m3 under "e4m3"
    wgrad  grad_weight= grad_output^T @ input     high precision (the bf16/fp32 path) with fp8_wgrad=False

A tensor is quantized as ``fp8(t * scale)`` with ``scale = fp8_max / amax``; the GEMM divides the
scales back out. Recipes (``--fp8-recipe``):

- ``delayed`` (Megatron's default): the scale of each role comes from the amax history of the
  previous ``fp8_amax_history_len`` steps (``most_recent`` or ``max`` of it, divided by
  ``2**fp8_margin``). A step's amaxes are the
  maximum over its microbatches, the TP and the DP ranks (``update_fp8_scaling``, once per step in
  ``finalize_model_grads``), so every layout quantizes with the same scales; history and scales
  are buffers, saved in checkpoints. Two choices differ from Transformer Engine, both so that DP=k
  equals one process with k times the microbatches: the update runs once per optimizer step, not
  after every microbatch; and the first step, with no history yet, scales each tensor by its own
  amax (tensorwise) instead of by 1.0 (a fixed scale is not invariant to the 1/microbatches factor
  in the gradients, which differs between such layouts; amax-derived scales follow it exactly).
- ``tensorwise`` (current scaling): the scale from this tensor's own amax.
- ``rowwise`` (torchao/torchtitan's axiswise scaling, a parallel3d name: Megatron has none): one
  scale per row of each GEMM operand, along the dimension the GEMM does not contract.

TP: a shard's amax is made the full tensor's (a MAX all-reduce over the TP group, one per GEMM) wherever the
amax covers the split dimension, so TP=k quantizes exactly like TP=1. Sequence parallelism
quantizes the gathered input. On CUDA the GEMMs are ``torch._scaled_mm`` through torchao; elsewhere
torchao's emulation (dequantize, fp32 matmul), so the CPU tests run the same numerics.

Weight cache (``Fp8Scaling.cache_weights``): a weight's FP8 operands (fprop's, and dgrad's in the
column-major layout torch._scaled_mm takes) are kept until the weight changes, so the micro-batches of
a step and the dgrad GEMMs reuse them. A weight changes only through an in-place write the cache sees:
the key is the weight's storage address and ``_version`` (and, under delayed scaling, the scale
buffer's ``_version``). Writes through ``.data`` or into a buffer the parameter is a view of bump no
version: whoever writes so (the optimizers' copy of the updated weights, DDP's broadcast) calls
``torch.autograd.graph.increment_version`` on the parameters. Every TP rank
updates its weights with the same operations, so the ranks of a TP group miss the cache together and
the amax all-reduce of a miss stays matched.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import all_reduce_over
from .utils import group_rank_and_size, tp_collective

FORMATS = ("e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise", "rowwise")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
# Megatron's --fp8-recipe values with no implementation here, and what to use instead.
REFUSED_RECIPES = {
    "mxfp8": "MXFP8 needs Blackwell GPUs and is not implemented; use rowwise (per-row scales) or tensorwise",
    "blockwise": "blockwise scaling is not implemented; use rowwise (per-row scales) or tensorwise",
    "custom": "custom quantizer factories are not implemented; use delayed, tensorwise or rowwise",
}
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
ROLES = ("input", "weight", "grad_output")
# The submodule name that holds a linear's FP8 state in the model's state dict.
STATE_MODULE = "fp8_scaling"


class Fp8ConfigError(ValueError):
    pass


@functools.lru_cache(maxsize=1)
def torchao_float8() -> Any:
    """torchao's float8 modules, imported on first use; a clear error without the fp8 extra."""
    level = logging.getLogger("torchao").level
    if not torch.cuda.is_available():  # its CUDA-only extensions cannot load on a CPU build: not a problem here
        logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        from torchao.float8 import float8_training_tensor as tensor
        from torchao.float8 import float8_utils as utils
    except ImportError as e:
        raise ImportError(f"FP8 training (--fp8-format) needs torchao: pip install 'parallel3d[fp8]' "
                          f"(torchao 0.18 for torch 2.11+); import failed: {e}") from None
    finally:
        logging.getLogger("torchao").setLevel(level)
    return tensor, utils


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """Megatron's FP8 settings (TransformerConfig's fp8, fp8_recipe, fp8_margin, fp8_amax_history_len,
    fp8_amax_compute_algo, fp8_wgrad), checked once. ``emulate``: None = emulated off CUDA only."""
    format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True
    emulate: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise Fp8ConfigError(f"fp8={self.format!r} is not an FP8 format; use one of {FORMATS}")
        if self.recipe in REFUSED_RECIPES:
            raise Fp8ConfigError(f"fp8_recipe={self.recipe!r} is not supported: {REFUSED_RECIPES[self.recipe]}")
        if self.recipe not in RECIPES:
            raise Fp8ConfigError(f"fp8_recipe={self.recipe!r} is not a recipe; use one of {RECIPES}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise Fp8ConfigError(f"fp8_amax_compute_algo={self.amax_compute_algo!r}; use one of {AMAX_COMPUTE_ALGOS}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise Fp8ConfigError(f"fp8_amax_history_len must be a positive integer, got {self.amax_history_len!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise Fp8ConfigError(f"fp8_margin must be an integer >= 0, got {self.margin!r}")

    @classmethod
    def from_config(cls, config: Any) -> Optional["Fp8Recipe"]:
        """The recipe of a Megatron-style config (None where ``config.fp8`` is None: no FP8)."""
        if getattr(config, "fp8", None) is None:
            return None
        return cls(format=config.fp8, recipe=getattr(config, "fp8_recipe", "delayed"),
                   margin=getattr(config, "fp8_margin", 0),
                   amax_history_len=getattr(config, "fp8_amax_history_len", 1),
                   amax_compute_algo=getattr(config, "fp8_amax_compute_algo", "most_recent"),
                   wgrad=getattr(config, "fp8_wgrad", True))

    def dtype(self, role: int) -> torch.dtype:
        return torch.float8_e5m2 if role == GRAD_OUTPUT and self.format == "hybrid" else torch.float8_e4m3fn

    def describe(self) -> str:
        """One line for the training log."""
        text = f"FP8 {self.format} ({'e4m3 forward, e5m2 gradients' if self.format == 'hybrid' else 'e4m3'}), " \
               f"recipe {self.recipe}"
        if self.recipe == "delayed":
            text += (f" (amax history {self.amax_history_len}, {self.amax_compute_algo}, margin {self.margin}, "
                     "updated once per step)")
        text += ", wgrad in FP8" if self.wgrad else ", wgrad in high precision"
        # Said where the user reads it: this path is correct but measured slower than bf16 so far.
        return text + ("; output layer and embeddings in high precision. Not yet faster than bf16: see "
                       "BENCHMARKS.md, 'FP8 on one H100'")


# Which dimension of each 2D operand is split over TP: [partition_dim][role]. A column-parallel
# linear (weight split along its output, dim 0) sees the whole input and a slice of the output's
# gradient; a row-parallel one (weight split along its input, dim 1) a slice of the input.
_SPLIT_DIM = {0: (None, 0, 1), 1: (1, 1, None)}
# rowwise: the dimension each operand's amax runs over (the GEMM's contracted one), per GEMM.
_ROWWISE_AXIS = {"fprop": {INPUT: 1, WEIGHT: 1}, "dgrad": {GRAD_OUTPUT: 1, WEIGHT: 0},
                 "wgrad": {GRAD_OUTPUT: 0, INPUT: 0}}


class Fp8Scaling(nn.Module):
    """One linear's FP8: its recipe, its TP split and, under delayed scaling, its state.

    Buffers (delayed only, so other recipes add nothing to a checkpoint): ``amax_history``
    [3 roles, history_len] (newest first) and ``scale`` [3]; ``amax_pending`` (not saved) collects
    this step's amaxes until :func:`update_fp8_scaling`."""

    def __init__(self, recipe: Fp8Recipe, partition_dim: int, tp_group: Optional[dist.ProcessGroup],
                 device: Optional[torch.device] = None, cache_weights: bool = True,
                 lean_quantize: bool = True, compile_cast: bool = True, reuse_grad_output: bool = True,
                 merge_amax_reduce: bool = True) -> None:
        super().__init__()
        torchao_float8()  # a missing torchao is said when the layer is built, not at its first GEMM
        self.recipe, self.partition_dim, self.tp_group = recipe, partition_dim, tp_group
        self.emulate = recipe.emulate
        # False: quantize the weight at every GEMM (the same numbers; for measuring the cache's worth).
        self.cache_weights = cache_weights
        # False: amax and cast with torchao's unfused operations (the same numbers; for measuring).
        self.lean_quantize = lean_quantize
        # False: on CUDA, the eager operations instead of one compiled kernel for the scale and the cast.
        self.compile_cast = compile_cast
        # False: wgrad quantizes grad_output again instead of taking dgrad's FP8 copy (same scale, same bits).
        self.reuse_grad_output = reuse_grad_output
        # False: one TP all-reduce per operand amax instead of one per GEMM (the same maxima).
        self.merge_amax_reduce = merge_amax_reduce
        self._weight_cache: dict[str, Any] = {}
        if recipe.recipe == "delayed":
            self.register_buffer("amax_history", torch.zeros(3, recipe.amax_history_len, device=device))
            self.register_buffer("scale", torch.ones(3, device=device))
            self.register_buffer("amax_pending", torch.zeros(3, device=device), persistent=False)
            self.register_load_state_dict_post_hook(_history_loaded)
        self.has_history = False  # delayed: no update yet, so the first step scales like tensorwise

    def extra_repr(self) -> str:
        return f"{self.recipe.format}, {self.recipe.recipe}, partition_dim={self.partition_dim}"

    # --- scales -----------------------------------------------------------------------------------
    def _current_scales(self, items: list[tuple[torch.Tensor, int, Optional[int]]]) -> list[torch.Tensor]:
        """The scales of one GEMM's operands ``items`` [(tensor, role, axis or None)] from their amaxes
        (whole, or over ``axis`` kept), each made the full tensor's where TP splits what it covers: the
        amaxes that need it go in one MAX all-reduce (an elementwise maximum: the same as one each)."""
        amaxes = [self._local_amax(t, axis) for t, _, axis in items]
        shared = [i for i, (_, role, axis) in enumerate(items)
                  if _SPLIT_DIM[self.partition_dim][role] is not None
                  and (axis is None or axis == _SPLIT_DIM[self.partition_dim][role])]
        if shared and group_rank_and_size(self.tp_group)[1] > 1:
            what = f"FP8 amax all-reduce ({', '.join(ROLES[items[i][1]] for i in shared)})"
            flat = amaxes[shared[0]] if len(shared) == 1 else torch.cat([amaxes[i].reshape(-1) for i in shared])
            with tp_collective(what, self.tp_group):
                dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.tp_group)
            if len(shared) > 1:
                for i, part in zip(shared, flat.split([amaxes[i].numel() for i in shared])):
                    amaxes[i] = part.view_as(amaxes[i])
        amax_to_scale = torchao_float8()[1].amax_to_scale
        if self.compile_cast and items[0][0].is_cuda:
            amax_to_scale = compiled_on_cuda(amax_to_scale)
        return [amax_to_scale(a, self.recipe.dtype(role)) for a, (_, role, _) in zip(amaxes, items)]

    def _current_scale(self, t: torch.Tensor, role: int, axis: Optional[int]) -> torch.Tensor:
        return self._current_scales([(t, role, axis)])[0]

    def _record(self, t: torch.Tensor, role: int, amax: Optional[torch.Tensor] = None) -> None:
        """Delayed scaling: this tensor's (local) amax (``amax`` where already known) joins the step's; TP
        and DP reduce at the update."""
        amax = self._local_amax(t.detach(), None) if amax is None else amax
        self.amax_pending[role] = torch.maximum(self.amax_pending[role], amax)

    def _from_history(self) -> bool:
        return self.recipe.recipe == "delayed" and self.has_history

    # --- quantize + GEMM ----------------------------------------------------------------------------
    def _emulated(self, t: torch.Tensor) -> bool:
        return self.emulate if self.emulate is not None else t.device.type != "cuda"

    def _fp8(self, t2d: torch.Tensor, role: int, scale: torch.Tensor, axis: Optional[int],
             out_dtype: torch.dtype) -> torch.Tensor:
        """torchao's Float8TrainingTensor of ``t2d``; GEMMs on two of them run torch._scaled_mm (or emulate it)
        and return ``out_dtype`` (the first operand's)."""
        data = self._cast(t2d, scale, self.recipe.dtype(role))
        return self._wrap(data, role, scale, axis, out_dtype)

    def _local_amax(self, t: torch.Tensor, axis: Optional[int]) -> torch.Tensor:
        """max |t| (over ``axis``, kept) in fp32. Lean: the infinity norm, one pass that reads ``t`` once,
        where abs() then amax() writes and reads a copy. A maximum involves no rounding, NaN and inf
        propagate alike: the same value."""
        if self.lean_quantize:
            a = torch.linalg.vector_norm(t, ord=float("inf")) if axis is None else \
                torch.linalg.vector_norm(t, ord=float("inf"), dim=axis, keepdim=True)
        else:
            a = t.abs().amax() if axis is None else t.abs().amax(dim=axis, keepdim=True)
        return a.float()

    def _cast(self, t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp8(clamp(t * scale, -fp8_max, fp8_max)), the product in fp32 (torchao's to_fp8_saturated of
        t.float() * scale). Lean: no fp32 copy of ``t``. A 0-dim fp32 scale would not promote a bf16
        ``t`` (the product would round to bf16); a 1-element one does, so the multiply reads ``t`` in
        its dtype and computes in fp32, the same products; the clamp runs in place."""
        if self.compile_cast and t.is_cuda:
            return compiled_on_cuda(_saturated_cast)(t, scale, dtype)
        if not self.lean_quantize:
            return torchao_float8()[1].to_fp8_saturated(t.float() * scale, dtype)
        x = t * (scale if scale.dim() else scale.reshape(1))
        if x.dtype != torch.float32:  # t in fp64: as t.float() * scale would
            x = t.float() * scale
        fmax = torch.finfo(dtype).max
        return x.clamp_(-fmax, fmax).to(dtype)

    def _wrap(self, data: torch.Tensor, role: int, scale: torch.Tensor, axis: Optional[int],
              out_dtype: torch.dtype) -> torch.Tensor:
        tensor, _ = torchao_float8()
        config = tensor.ScaledMMConfig(emulate=self._emulated(data), use_fast_accum=False)
        mm_config = tensor.LinearMMConfig(output=config._replace(use_fast_accum=True), grad_input=config,
                                          grad_weight=config)  # torchao's defaults: fast accumulation in fprop
        gemm_role = (tensor.GemmInputRole.INPUT, tensor.GemmInputRole.WEIGHT, tensor.GemmInputRole.GRAD_OUTPUT)[role]
        axiswise_dim = None if axis is None else (-1 if axis == 1 else 0)
        return tensor.Float8TrainingTensor(data, scale, out_dtype, mm_config, gemm_role, axiswise_dim)

    def _operand(self, t2d: torch.Tensor, role: int, gemm: str, scales: Optional[torch.Tensor],
                 out_dtype: torch.dtype, current: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(FP8 operand, its scale): delayed from ``scales``, tensorwise from ``scales`` when given (reused
        from an earlier GEMM) else current, rowwise always current along the GEMM's axis. ``current``:
        the current scale where the caller computed it (with another operand's, one all-reduce)."""
        if self.recipe.recipe == "rowwise":
            axis = _ROWWISE_AXIS[gemm][role]
            scale = self._current_scale(t2d, role, axis) if current is None else current
            return self._fp8(t2d, role, scale, axis, out_dtype), None
        scale = scales[role] if scales is not None else self._current_scale(t2d, role, None) if current is None \
            else current
        return self._fp8(t2d, role, scale, None, out_dtype), scale

    def _axis(self, gemm: str, role: int) -> Optional[int]:
        return _ROWWISE_AXIS[gemm][role] if self.recipe.recipe == "rowwise" else None

    def _merged_scales(self, t2d: torch.Tensor, role: int, weight: torch.Tensor, gemm: str,
                       out_dtype: torch.dtype) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(``t2d``'s, the weight's) current scales for ``gemm`` from one amax all-reduce, where both are
        current and the weight is to be quantized now; else (None, None): each operand as it would alone."""
        if not (self.merge_amax_reduce and self._weight_pending(weight, gemm, out_dtype)):
            return None, None
        both = self._current_scales([(t2d, role, self._axis(gemm, role)), (weight, WEIGHT, self._axis(gemm, WEIGHT))])
        return both[0], both[1]

    def _weight_entry(self, weight: torch.Tensor, out_dtype: torch.dtype) -> dict[str, Any]:
        """The cache of this weight's FP8 operands, emptied where the weight (delayed: or its scale) changed."""
        delayed = self.recipe.recipe == "delayed"
        key = (weight.device, weight.data_ptr(), weight._version, weight.shape, weight.stride(), out_dtype,
               (self.scale._version, self._from_history()) if delayed else None)
        if self._weight_cache.get("key") != key:
            # Holding the weight keeps its storage, so no other tensor takes its address while cached.
            self._weight_cache = {"key": key, "weight": weight.detach()}
        return self._weight_cache

    def _caches(self, weight: torch.Tensor) -> bool:
        """An inference-mode tensor has no version counter: it could change unseen, so it is not cached."""
        return self.cache_weights and not weight.is_inference()

    def _weight_pending(self, weight: torch.Tensor, gemm: str, out_dtype: torch.dtype) -> bool:
        """Whether :meth:`_weight_operand` quantizes the weight for ``gemm`` now (not cached, not made from
        fprop's)."""
        if not self._caches(weight):
            return True
        cache = self._weight_entry(weight, out_dtype)
        return gemm not in cache and not (gemm == "dgrad" and "fprop" in cache and self.recipe.recipe != "rowwise")

    def _weight_operand(self, weight: torch.Tensor, gemm: str, scales: Optional[torch.Tensor],
                        out_dtype: torch.dtype, current: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The weight's FP8 operand for ``gemm`` ("fprop" or "dgrad"), from the cache while the weight (and,
        delayed, the scale) is unchanged. dgrad's is column-major on torch._scaled_mm (torchao would copy
        the row-major one at every dgrad); tensorwise and delayed make it from fprop's (same scale, same
        values), rowwise quantizes it along its own axis. ``current``: as for :meth:`_operand`."""
        if not self._caches(weight):
            return self._operand(weight, WEIGHT, gemm, scales, out_dtype, current)[0]
        cache = self._weight_entry(weight, out_dtype)
        if gemm in cache:
            return cache[gemm]
        derived = gemm == "dgrad" and "fprop" in cache and self.recipe.recipe != "rowwise"
        op = cache["fprop"] if derived else self._operand(weight, WEIGHT, gemm, scales, out_dtype, current)[0]
        if gemm == "dgrad" and not self._emulated(weight):
            op = self._wrap(op._data.t().contiguous().t(), WEIGHT, op._scale,
                            None if op._axiswise_dim is None else (1 if op._axiswise_dim == -1 else 0), out_dtype)
        # A tensorwise/delayed dgrad not made from this weight's fprop used the saved ``scales``: not cached.
        if gemm == "fprop" or derived or self.recipe.recipe == "rowwise":
            cache[gemm] = op
        return op

    def _weight_amax(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """Delayed scaling: the weight's local amax for the step's record, computed once per cached weight
        (after :meth:`_weight_operand` of this forward)."""
        if not self._caches(weight):
            return None
        if "amax" not in self._weight_cache:
            self._weight_cache["amax"] = self._local_amax(weight.detach(), None)
        return self._weight_cache["amax"]

    def fprop(self, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
              ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor], bool]]:
        """(x @ weight^T + bias, what dgrad needs: the scales backward reuses and whether they came from
        the history). Delayed scaling records the amaxes of a training forward only: a module in eval
        mode (evaluation, generation) leaves the next step's scales alone."""
        scales = self.scale.clone() if self._from_history() else None  # backward uses this step's too
        x_now = w_now = None
        if scales is None:  # current scales (rowwise: always)
            x_now, w_now = self._merged_scales(x2d, INPUT, weight, "fprop", x2d.dtype)
        x8, x_scale = self._operand(x2d, INPUT, "fprop", scales, x2d.dtype, x_now)
        w8 = self._weight_operand(weight, "fprop", scales, x2d.dtype, w_now)
        w_scale = None if self.recipe.recipe == "rowwise" else w8._scale
        if self.recipe.recipe == "delayed" and self.training:
            self._record(x2d, INPUT)
            self._record(weight, WEIGHT, self._weight_amax(weight))
        out = torch.mm(x8, w8.t()) if bias is None else torch.addmm(bias.to(x2d.dtype), x8, w8.t())
        if scales is None and self.recipe.recipe != "rowwise":  # current scales: grad_output's comes in dgrad
            scales = torch.stack([x_scale, w_scale, torch.zeros_like(x_scale)])
        return out, (scales, self._from_history())

    def dgrad(self, grad_output2d: torch.Tensor, weight: torch.Tensor, saved: tuple[Optional[torch.Tensor], bool]
              ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """(grad_output @ weight, what wgrad reuses: fprop's scales with grad_output's, and grad_output's
        FP8 operand where wgrad quantizes it alike: tensorwise and delayed, one scale for the tensor;
        a deferred (zero-bubble) wgrad holds it until W). ``saved``: what fprop returned (its scales, and
        whether they came from the history)."""
        scales, from_history = saved
        if self.recipe.recipe == "delayed":
            self._record(grad_output2d, GRAD_OUTPUT)
        if scales is not None and not from_history:
            scales = scales.clone()
            scales[GRAD_OUTPUT] = self._current_scale(grad_output2d, GRAD_OUTPUT, None)
        g_now = w_now = None
        if self.recipe.recipe == "rowwise":  # tensorwise and delayed: the weight's scale is fprop's
            g_now, w_now = self._merged_scales(grad_output2d, GRAD_OUTPUT, weight, "dgrad", grad_output2d.dtype)
        g8, _ = self._operand(grad_output2d, GRAD_OUTPUT, "dgrad", scales, grad_output2d.dtype, g_now)
        w8 = self._weight_operand(weight, "dgrad", scales, grad_output2d.dtype, w_now)
        reuse = self.reuse_grad_output and self.recipe.wgrad and self.recipe.recipe != "rowwise"
        return torch.mm(g8, w8), (scales, g8 if reuse else None)

    def wgrad(self, grad_output2d: torch.Tensor, x2d: torch.Tensor,
              saved: tuple[Optional[torch.Tensor], Optional[torch.Tensor]]) -> torch.Tensor:
        """grad_output^T @ input in fp32 (added to main_grad or cast to the weight's dtype by the caller).
        ``saved``: what dgrad returned."""
        scales, dgrad_g8 = saved
        if dgrad_g8 is not None:  # the same bytes and scale; only the GEMM's output dtype differs
            g8 = self._wrap(dgrad_g8._data, GRAD_OUTPUT, dgrad_g8._scale, None, torch.float32)
        else:
            g8, _ = self._operand(grad_output2d, GRAD_OUTPUT, "wgrad", scales, torch.float32)
        x8, _ = self._operand(x2d, INPUT, "wgrad", scales, torch.float32)
        return torch.mm(g8.t(), x8)

    # --- delayed scaling: once per step ---------------------------------------------------------------
    def update_from(self, amax: torch.Tensor) -> None:
        """Megatron's (Transformer Engine's) delayed-scaling update with this step's reduced amaxes [3]."""
        history = torch.roll(self.amax_history, 1, dims=1)
        history[:, 0] = amax
        self.amax_history.copy_(history)
        use = history[:, 0] if self.recipe.amax_compute_algo == "most_recent" else history.amax(dim=1)
        fp8_max = torch.tensor([torch.finfo(self.recipe.dtype(r)).max for r in range(3)], device=use.device)
        new = fp8_max / use / (2.0 ** self.recipe.margin)
        keep = (use > 0) & torch.isfinite(use)  # no amax (a linear that did not run) or inf/nan: keep the scale
        self.scale.copy_(torch.where(keep, new, self.scale))
        self.amax_pending.zero_()
        self.has_history = True


def _saturated_cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's to_fp8_saturated(t.float() * scale, dtype), written out so that torch.compile traces
    no import; compiled, one kernel."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(min=-fmax, max=fmax).to(dtype)


@functools.lru_cache(maxsize=None)
def compiled_on_cuda(fn: Any) -> Any:
    """``fn`` through torch.compile (one kernel for its pointwise operations; dynamic shapes, so the
    micro-batch shapes share one graph). Used on CUDA tensors only: the CPU tests run the eager
    operations, and tests/gpu/test_fp8_speedups.py checks the compiled bits equal the eager ones (both
    round to nearest-even after the same fp32/fp64 arithmetic and clamp before the cast)."""
    return torch.compile(fn, dynamic=True)


def _history_loaded(module: Fp8Scaling, _incompatible_keys: Any) -> None:
    """A loaded (checkpointed) history gives the next step's scales."""
    module.has_history = bool(module.amax_history.any())


def fp8_modules(modules: Iterable[nn.Module]) -> list[Fp8Scaling]:
    """Every delayed-scaling Fp8Scaling inside ``modules``, in module order."""
    return [m for module in modules for m in module.modules()
            if isinstance(m, Fp8Scaling) and m.recipe.recipe == "delayed"]


@torch.no_grad()
def update_fp8_scaling(modules: Iterable[nn.Module], dp_group: Optional[dist.ProcessGroup]) -> None:
    """End of a step: each delayed-scaling linear's amaxes, maximum over its TP and the DP ranks, enter its
    history and give next step's scales. One all-reduce per group for all the linears of ``modules``.
    Every rank of a TP and DP group holds the same linears, so the buffers line up."""
    by_group: dict[Any, list[Fp8Scaling]] = {}
    for m in fp8_modules(modules):
        by_group.setdefault(m.tp_group, []).append(m)
    for tp_group, ms in by_group.items():
        flat = torch.cat([m.amax_pending for m in ms])
        all_reduce_over(flat, dist.ReduceOp.MAX, [tp_group, dp_group])
        for m, amax in zip(ms, flat.split(3)):
            m.update_from(amax)


def is_fp8_state_key(name: str) -> bool:
    """Whether a state-dict key is FP8 scaling state (not a weight): conversions skip it."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == STATE_MODULE
