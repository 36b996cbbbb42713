"""FP8 GEMMs of the tensor-parallel linears: Megatron's recipe fields, which scales, which operands.

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
quantizes the gathered input. The quantization and the GEMM (``torch._scaled_mm`` on CUDA; elsewhere
an emulation, dequantize and fp32 matmul, so the CPU tests run the same numerics) are fp8_ops.py's.

Weight cache (``Fp8Scaling.cache_weights``): a weight's FP8 operands (fprop's, and dgrad's: the
transpose, from the same read) are kept until the weight changes, so the micro-batches of a step and the
dgrad GEMMs reuse them. A weight changes only through an in-place write the cache sees:
the key is the weight's storage address and ``_version`` (and, under delayed scaling, the scale
buffer's ``_version``). Writes through ``.data`` or into a buffer the parameter is a view of bump no
version: whoever writes so (the optimizers' copy of the updated weights, DDP's broadcast) calls
``torch.autograd.graph.increment_version`` on the parameters. Every TP rank
updates its weights with the same operations, so the ranks of a TP group miss the cache together and
the amax all-reduce of a miss stays matched.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import all_reduce_over
from .fp8_ops import Fp8Operand, local_amax, quantize, scaled_mm, scaled_mm_accumulate
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
        # Said where the user reads it: the eager FP8 step launches more per linear than bf16's, so its gain
        # needs the graphs (or a fast host and large micro-batches).
        return text + ("; output layer and embeddings in high precision. Eager, small micro-batches wait on the "
                       "host's launches (slower than bf16); with the layers as CUDA graphs, the default on GPUs, "
                       "they do not: see docs/fp8.md, 'Speed'")


# Which dimension of each 2D operand is split over TP: [partition_dim][role]. A column-parallel
# linear (weight split along its output, dim 0) sees the whole input and a slice of the output's
# gradient; a row-parallel one (weight split along its input, dim 1) a slice of the input.
_SPLIT_DIM = {0: (None, 0, 1), 1: (1, 1, None)}
# The dimension each GEMM contracts of each operand (fprop x @ w^T, dgrad g @ w, wgrad g^T @ x): the
# operand's layout ("row": dim 1, "col": dim 0), and the axis of a rowwise amax.
_CONTRACT = {"fprop": {INPUT: 1, WEIGHT: 1}, "dgrad": {GRAD_OUTPUT: 1, WEIGHT: 0}, "wgrad": {GRAD_OUTPUT: 0, INPUT: 0}}


class Fp8Scaling(nn.Module):
    """One linear's FP8: its recipe, its TP split and, under delayed scaling, its state.

    Buffers (delayed only, so other recipes add nothing to a checkpoint): ``amax_history``
    [3 roles, history_len] (newest first) and ``scale`` [3]; ``amax_pending`` (not saved) collects
    this step's amaxes until :func:`update_fp8_scaling`."""

    def __init__(self, recipe: Fp8Recipe, partition_dim: int, tp_group: Optional[dist.ProcessGroup],
                 device: Optional[torch.device] = None, cache_weights: bool = True, fused_cast: bool = True) -> None:
        super().__init__()
        self.recipe, self.partition_dim, self.tp_group = recipe, partition_dim, tp_group
        self.emulate = recipe.emulate
        # False: quantize the weight at every GEMM (the same numbers; for measuring the cache's worth).
        self.cache_weights = cache_weights
        # False: on CUDA, the eager operations instead of the one-launch cast kernel (the same bytes).
        self.fused_cast = fused_cast
        self._weight_cache: dict[str, Any] = {}
        # True while CUDA graphs replay this linear (training/cuda_graphs.py): a graph reads the cached operands'
        # tensors, so a changed weight is quantized again into those same tensors, not into new ones.
        self.weight_cache_in_place = False
        if recipe.recipe == "delayed":
            self.register_buffer("amax_history", torch.zeros(3, recipe.amax_history_len, device=device))
            self.register_buffer("scale", torch.ones(3, device=device))
            self.register_buffer("amax_pending", torch.zeros(3, device=device), persistent=False)
            self.register_load_state_dict_post_hook(_history_loaded)
        self.has_history = False  # delayed: no update yet, so the first step scales like tensorwise

    def extra_repr(self) -> str:
        return f"{self.recipe.format}, {self.recipe.recipe}, partition_dim={self.partition_dim}"

    def _emulated(self, t: torch.Tensor) -> bool:
        return self.emulate if self.emulate is not None else t.device.type != "cuda"

    def _from_history(self) -> bool:
        return self.recipe.recipe == "delayed" and self.has_history

    def _rowwise(self) -> bool:
        return self.recipe.recipe == "rowwise"

    # --- amaxes and quantization ----------------------------------------------------------------------
    def _amaxes(self, items: list[tuple[torch.Tensor, int, str]]) -> list[torch.Tensor]:
        """The amaxes of one GEMM's operands ``items`` [(tensor, role, gemm)]: whole, or rowwise along the
        GEMM's contracted dimension; each the full tensor's where TP splits what it covers. Those that
        need it share one MAX all-reduce (an elementwise maximum: the same as one each)."""
        axes = [_CONTRACT[gemm][role] if self._rowwise() else None for _, role, gemm in items]
        amaxes = [local_amax(t, axis) for (t, _, _), axis in zip(items, axes)]
        shared = [i for i, ((_, role, _), axis) in enumerate(zip(items, axes))
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
        return amaxes

    def _quantize(self, t: torch.Tensor, role: int, layout: str, scale: Optional[torch.Tensor] = None,
                  amax: Optional[torch.Tensor] = None, record: bool = False
                  ) -> tuple[Optional[Fp8Operand], Optional[Fp8Operand]]:
        """``t`` quantized for ``role`` (its FP8 dtype) in ``layout``, from ``scale`` or ``amax``; with
        ``record`` (delayed) its local amax joins the step's in the same read (:meth:`_record`'s effect)."""
        pending = self.amax_pending[role:role + 1] if record else None
        return quantize(t, self.recipe.dtype(role), layout, scale=scale, amax=amax, fused=self.fused_cast,
                        record=pending)

    def _record(self, t: torch.Tensor, role: int, amax: Optional[torch.Tensor] = None) -> None:
        """Delayed scaling: this tensor's (local) amax (``amax`` where already known) joins the step's; TP
        and DP reduce at the update."""
        amax = local_amax(t.detach()) if amax is None else amax
        pending = self.amax_pending[role:role + 1]  # a view: one in-place launch, no gather and scatter
        torch.maximum(pending, amax.reshape(1), out=pending)

    def _mm(self, a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype, fast_accum: bool = False,
            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        # Fast accumulation in fprop only, as torchao's and Transformer Engine's defaults.
        return scaled_mm(a, b, out_dtype, fast_accum=fast_accum, emulate=self._emulated(a.data), bias=bias)

    # --- the weight's operands, cached until it changes ------------------------------------------------
    def _caches(self, weight: torch.Tensor) -> bool:
        """An inference-mode tensor has no version counter: it could change unseen, so it is not cached."""
        return self.cache_weights and not weight.is_inference()

    def _weight_entry(self, weight: torch.Tensor) -> dict[str, Any]:
        """The cache of this weight's FP8 operands, emptied where the weight (delayed: or its scale) changed."""
        if not self._caches(weight):
            self._weight_cache = {}
            return {}  # this call's only
        delayed = self.recipe.recipe == "delayed"
        key = (weight.device, weight.data_ptr(), weight._version, weight.shape, weight.stride(),
               (self.scale._version, self._from_history()) if delayed else None)
        if self._weight_cache.get("key") != key:
            kept = {g: self._weight_cache[g] for g in ("fprop", "dgrad") if g in self._weight_cache} \
                if self.weight_cache_in_place else {}
            # Holding the weight keeps its storage, so no other tensor takes its address while cached.
            self._weight_cache = {"key": key, "weight": weight.detach(), "kept": kept}
        return self._weight_cache

    def _weight_operands(self, weight: torch.Tensor, gemm: str, scale: Optional[torch.Tensor],
                         other: Optional[tuple[torch.Tensor, int]] = None
                         ) -> tuple[Fp8Operand, Optional[torch.Tensor]]:
        """(the weight's operand for ``gemm``, ``other``'s amax or None). Tensor-scaled, fprop quantizes
        both layouts from one read (dgrad's is the transpose, same scale); rowwise, each GEMM its own axis.
        ``scale``: delayed's from the history (None: current). ``other`` = (tensor, role): the GEMM's other
        operand needing a current amax, all-reduced with the weight's where both need it."""
        cache = self._weight_entry(weight)
        if gemm in cache:
            return cache[gemm], None
        other_amax = None
        if scale is None:
            items = [(weight, WEIGHT, gemm)] + ([(other[0], other[1], gemm)] if other is not None else [])
            amax, *rest = self._amaxes(items)
            other_amax = rest[0] if rest else None
        layout = ("row" if gemm == "fprop" else "col") if self._rowwise() or not self._caches(weight) else "both"
        row, col = self._quantize(weight, WEIGHT, layout, scale=scale, amax=None if scale is not None else amax)
        kept = cache.get("kept", {})
        row, col = _into(kept.get("fprop"), row), _into(kept.get("dgrad"), col)
        cache.update({"fprop": row} if row is not None else {})
        cache.update({"dgrad": col} if col is not None else {})
        return (row if gemm == "fprop" else col), other_amax

    def _record_weight(self, weight: torch.Tensor) -> None:
        """Delayed scaling: the weight's local amax joins the step's once a step (the weight does not change
        within one; every micro-batch's forward would record the same value). The cache entry is the step's:
        its key holds the scale's version, which each update changes."""
        cache = self._weight_entry(weight)
        if not cache.get("recorded"):
            if "amax" not in cache:
                cache["amax"] = local_amax(weight.detach())
            self._record(weight, WEIGHT, cache["amax"])
            cache["recorded"] = True

    def refresh_weight(self, weight: torch.Tensor) -> None:
        """Before a captured layer replays (training/cuda_graphs.py): the weight's operands of both GEMMs, where the
        weight (delayed: or its scale) changed, quantized into the tensors the graph reads; and, delayed in a
        training forward, its amax recorded for the step. The eager forward's own calls, made before the replay."""
        if not self._caches(weight):
            return  # no cache: the graph quantizes the weight itself
        cache = self._weight_entry(weight)
        if "fprop" not in cache or "dgrad" not in cache:  # else a hit: the later replays of the step launch nothing
            scale = self.scale.clone()[WEIGHT] if self._from_history() else None
            for gemm in ("fprop", "dgrad"):
                self._weight_operands(weight, gemm, scale)
        if self.recipe.recipe == "delayed" and self.training:
            self._record_weight(weight)

    # --- the three GEMMs ------------------------------------------------------------------------------
    def keeps_input_operand(self) -> bool:
        """Whether fprop also writes the input's wgrad operand (the transpose, fprop's scale: the very bytes
        wgrad would quantize), which backward then keeps instead of the bf16 input: an FP8 wgrad with one
        scale per tensor. Rowwise scales the wgrad operand along another axis."""
        return self.recipe.wgrad and not self._rowwise()

    def fprop(self, x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], keep_input: bool = False
              ) -> tuple[torch.Tensor, tuple[Optional[list[torch.Tensor]], bool, Optional[Fp8Operand]]]:
        """(x @ weight^T + bias, what dgrad needs: the scales backward reuses, whether they came from the
        history, and with ``keep_input`` (where ``keeps_input_operand``) the input's wgrad operand, from the
        same read as fprop's). Delayed scaling records the amaxes of a training forward only: a module in
        eval mode (evaluation, generation) leaves the next step's scales alone."""
        layout = "both" if keep_input and self.keeps_input_operand() else "row"
        # The roles' scales as a list of 0-dim tensors (views or the casts' own: no launch to gather them);
        # delayed copies the buffer, which backward's GEMMs use after the forward.
        scales = list(self.scale.clone().unbind()) if self._from_history() else None
        record = self.recipe.recipe == "delayed" and self.training
        if scales is not None:  # delayed: the cast records the input's amax in its read
            w8, _ = self._weight_operands(weight, "fprop", scales[WEIGHT])
            x8, x8t = self._quantize(x2d, INPUT, layout, scale=scales[INPUT], record=record)
        else:  # current scales: one all-reduce for both amaxes where the weight is quantized now
            w8, x_amax = self._weight_operands(weight, "fprop", None, (x2d, INPUT))
            x_amax = self._amaxes([(x2d, INPUT, "fprop")])[0] if x_amax is None else x_amax
            x8, x8t = self._quantize(x2d, INPUT, layout, amax=x_amax)
            if record:  # delayed's first step: the amax is at hand (over TP: the update takes that maximum too)
                self._record(x2d, INPUT, x_amax)
        if record:
            self._record_weight(weight)
        out = self._mm(x8, w8, x2d.dtype, fast_accum=True, bias=None if bias is None else bias.to(x2d.dtype))
        if scales is None and not self._rowwise():  # current scales: grad_output's comes in dgrad
            scales = [x8.scale, w8.scale, None]
        return out, (scales, self._from_history(), x8t)

    def dgrad(self, grad_output2d: torch.Tensor, weight: torch.Tensor, saved: tuple
              ) -> tuple[torch.Tensor, tuple[Optional[list[torch.Tensor]], Optional[Fp8Operand], Optional[Fp8Operand]]]:
        """(grad_output @ weight, what wgrad takes: fprop's scales with grad_output's, grad_output's
        transposed operand, quantized here from the same read where wgrad runs in FP8 with a tensor scale
        (a deferred, zero-bubble wgrad holds it until W), and fprop's input operand). ``saved``: what fprop
        returned."""
        scales, from_history, x8t = saved
        g = grad_output2d
        record = self.recipe.recipe == "delayed"
        if self._rowwise():
            w8, g_amax = self._weight_operands(weight, "dgrad", None, (g, GRAD_OUTPUT))
            g_amax = self._amaxes([(g, GRAD_OUTPUT, "dgrad")])[0] if g_amax is None else g_amax
            g8, _ = self._quantize(g, GRAD_OUTPUT, "row", amax=g_amax)
            return self._mm(g8, w8, g.dtype), (None, None, None)
        layout = "both" if self.recipe.wgrad else "row"
        if from_history:  # delayed: the cast records grad_output's amax in its read
            g8, g8t = self._quantize(g, GRAD_OUTPUT, layout, scale=scales[GRAD_OUTPUT], record=record)
        else:
            g_amax = self._amaxes([(g, GRAD_OUTPUT, "dgrad")])[0]
            g8, g8t = self._quantize(g, GRAD_OUTPUT, layout, amax=g_amax)
            if record:
                self._record(g, GRAD_OUTPUT, g_amax)
            scales = scales[:GRAD_OUTPUT] + [g8.scale]
        w8, _ = self._weight_operands(weight, "dgrad", scales[WEIGHT])
        return self._mm(g8, w8, g.dtype), (scales, g8t, x8t)

    def wgrad(self, grad_output2d: torch.Tensor, x2d: Optional[torch.Tensor], saved: tuple,
              out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """grad_output^T @ input in fp32: returned (the caller adds it or casts it to the weight's dtype), or
        accumulated into ``out`` (main_grad) by the GEMM itself. ``saved``: what dgrad returned; ``x2d`` may
        be None where it holds fprop's input operand."""
        scales, g8t, x8t = saved
        if self._rowwise():
            g_amax, x_amax = self._amaxes([(grad_output2d, GRAD_OUTPUT, "wgrad"), (x2d, INPUT, "wgrad")])
            _, g8t = self._quantize(grad_output2d, GRAD_OUTPUT, "col", amax=g_amax)
            _, x8t = self._quantize(x2d, INPUT, "col", amax=x_amax)
        elif x8t is None:  # fprop's input scale, dgrad's grad_output operand
            _, x8t = self._quantize(x2d, INPUT, "col", scale=scales[INPUT])
        if out is None:
            return self._mm(g8t, x8t, torch.float32)
        scaled_mm_accumulate(g8t, x8t, out, emulate=self._emulated(g8t.data))
        return None

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


def _into(kept: Optional[Fp8Operand], fresh: Optional[Fp8Operand]) -> Optional[Fp8Operand]:
    """``fresh``'s values in ``kept``'s tensors (which a CUDA graph reads), or ``fresh`` where none is kept."""
    if kept is None or fresh is None:
        return fresh
    for dst, src in zip(kept, fresh):
        dst.copy_(src)
    return kept


@contextlib.contextmanager
def fp8_graph_capture(modules: Iterable[nn.Module]):
    """Around capturing ``modules`` as CUDA graphs: their weight caches are updated in place from then on (the
    graphs read the captured tensors); delayed scaling must have its history (the graphs hold the path that
    scales from it); and the capture's warm-up forwards and backwards, on made-up inputs, leave the step's
    pending amaxes as they were and the weights' amaxes to be recorded by the next training forward."""
    scalings = [m for module in modules for m in module.modules() if isinstance(m, Fp8Scaling)]
    delayed = [m for m in scalings if m.recipe.recipe == "delayed"]
    missing = [m for m in delayed if not m.has_history]
    if missing:
        raise RuntimeError(f"CUDA graph capture: {len(missing)} delayed-scaling FP8 linears have no amax history yet; "
                           "capture after at least one training step (--cuda-graph-warmup-steps >= 1)")
    pending = [m.amax_pending.clone() for m in delayed]
    for m in scalings:
        m.weight_cache_in_place = True
    try:
        yield
    finally:
        for m, saved in zip(delayed, pending):
            m.amax_pending.copy_(saved)
        for m in scalings:
            m._weight_cache.pop("recorded", None)


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
