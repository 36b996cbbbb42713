"""Column- and row-parallel linear layers and the vocab-parallel embedding (Megatron's).

Initialisation is layout-independent: each layer initialises the FULL weight on
the CPU with ``init_method`` (drawing from the global RNG, in a fixed order) and
keeps its own slice, so a TP=k layer holds exactly the slices that the TP=1
layer holds for the same seed.

Parameters carry Megatron's attributes, which the optimizer and the gradient
finalisation read:
- ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``: the
  parameter is split across TP (else it is replicated and counted once in norms);
- ``sequence_parallel``: a replicated parameter applied to a sequence shard,
  whose gradient must be summed across TP (see ``allreduce_sequence_parallel_gradients``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..device import default_device
from .fp8 import Fp8Recipe, Fp8Scaling
from .linear_functions import embedding, linear_with_grad_accumulation_and_async_allreduce
from .mappings import (
    all_reduce,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .utils import divide, eager, group_rank_and_size, resolve_tp_group, split_tensor_for_rank, vocab_range

InitMethod = Callable[[torch.Tensor], None]


def init_method_normal(sigma: float) -> InitMethod:
    """N(0, sigma) initialisation (Megatron's ``init_method_normal``)."""

    def init_(tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """N(0, sigma / sqrt(2 * num_layers)), for output projections (Megatron's)."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True for the one copy of each parameter that gradient norms should count."""
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


def _init_partition(weight: torch.Tensor, full_shape: tuple[int, int], partition_dim: int, init_method: InitMethod,
                    rank: int, world_size: int, stride: int = 1) -> None:
    """Initialise the full weight on the CPU in fp32 and copy this rank's slice into ``weight``
    (:func:`split_tensor_for_rank`'s layout: with ``stride`` s, this rank's slice of each of s blocks)."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        weight.copy_(split_tensor_for_rank(master, partition_dim, stride, rank, world_size).to(weight.dtype))


def _setting(explicit: Any, config: Any, name: str, default: Any) -> Any:
    """A keyword given to the layer, else the field of Megatron's ``config`` (which is how Megatron's
    layers take their settings), else the default."""
    if explicit is not None:
        return explicit
    value = getattr(config, name, None)
    return default if value is None else value


def _device(device: Optional[torch.device], config: Any) -> torch.device:
    """Megatron's ``config.use_cpu_initialization`` keeps the parameters on the CPU."""
    if device is not None:
        return device
    return torch.device("cpu") if getattr(config, "use_cpu_initialization", False) else default_device()


# Megatron's layer keywords with nothing to do here, accepted at these values only (any
# tp_comm_buffer_name: Megatron does not use it either).
_MEGATRON_LAYER_KEYWORDS = {"is_expert": False, "keep_master_weight_for_test": False,
                            "embedding_activation_buffer": None, "grad_output_buffer": None, "tp_comm_buffer_name": ...}


def _check_megatron_keywords(layer: str, given: dict[str, Any], config: Any) -> None:
    for name, value in given.items():
        if name not in _MEGATRON_LAYER_KEYWORDS:
            raise TypeError(f"{layer}() got an unexpected keyword argument {name!r}")
        default = _MEGATRON_LAYER_KEYWORDS[name]
        if default is not ... and (value is not None if default is None else value != default):
            raise ValueError(f"{layer}: {name}={value!r} is not supported; leave it at {default!r}")
    if getattr(config, "expert_model_parallel_size", 1) != 1:
        raise ValueError(f"{layer}: config.expert_model_parallel_size={config.expert_model_parallel_size} is not "
                         "supported (no expert parallelism); set it to 1")


class _ParallelLinear(nn.Module):
    """What Column- and RowParallelLinear share: their keywords, the group, the weight split along
    ``partition_dim`` and the bias (split with the output of a column layer, whole for a row layer).

    Settings come as keywords or, as Megatron's layers take them, from ``config`` (a
    ModelParallelConfig/TransformerConfig-like object: ``params_dtype``, ``sequence_parallel``,
    ``gradient_accumulation_fusion``, ``use_cpu_initialization``, ``perform_initialization``, and
    the FP8 fields ``fp8``, ``fp8_recipe``, ... that ``fp8`` takes from it: tensor_parallel/fp8.py); a
    keyword given wins over the config's field.

    ``sequence_parallel`` is taken as given (Megatron-Core's layers trust their config): the model
    config and the arguments are where it is turned off, with a warning, when TP is 1. A layer built
    directly with one TP rank and ``sequence_parallel=True`` computes the same as without it: a
    sequence shard of one rank is the whole sequence, so its gathers and reduce-scatters are identities.

    Their forward runs eagerly inside a torch.compile'd model (a graph break each side): the TP
    collectives with their async handles, the weight-gradient GEMM into ``main_grad`` and the
    zero-bubble W store are side effects Dynamo should not trace; the GEMMs gain nothing from it.
    """

    def __init__(self, input_size: int, output_size: int, partition_dim: int, *, config: Any = None,
                 bias: bool = True, init_method: Optional[InitMethod] = None, stride: int = 1,
                 skip_bias_add: bool = False, sequence_parallel: Optional[bool] = None,
                 gradient_accumulation_fusion: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 perform_initialization: Optional[bool] = None, device: Optional[torch.device] = None,
                 tp_group: Optional[dist.ProcessGroup] = None, allocate_weight: bool = True,
                 fp8: Union[Fp8Recipe, bool, None] = None, **megatron_keywords: Any) -> None:
        super().__init__()
        _check_megatron_keywords(type(self).__name__, megatron_keywords, config)
        self.config = config
        self.tp_group = resolve_tp_group(tp_group)
        rank, world = group_rank_and_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel = bool(_setting(sequence_parallel, config, "sequence_parallel", False))
        self.gradient_accumulation_fusion = bool(_setting(gradient_accumulation_fusion, config,
                                                          "gradient_accumulation_fusion", False))
        params_dtype = _setting(params_dtype, config, "params_dtype", torch.float32)
        self.skip_bias_add = skip_bias_add
        self.device = _device(device, config)
        shape = [output_size, input_size]
        what = f"{type(self).__name__} {'output' if partition_dim == 0 else 'input'}_size"
        shape[partition_dim] = divide(shape[partition_dim], world, what)
        self.output_size_per_partition, self.input_size_per_partition = shape
        self.weight = None  # supplied at forward time without allocation (e.g. a tied output layer)
        if allocate_weight:
            self.weight = nn.Parameter(torch.empty(shape, dtype=params_dtype, device=self.device))
            if _setting(perform_initialization, config, "perform_initialization", True):
                _init_partition(self.weight, (output_size, input_size), partition_dim,
                                init_method or init_method_normal(0.02), rank, world, stride)
            set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride)
        self._init_fp8(fp8, config, partition_dim)
        if not bias:
            self.register_parameter("bias", None)
            return
        # Megatron initialises biases to zero; zero slices are layout-independent.
        self.bias = nn.Parameter(torch.zeros(shape[0], dtype=params_dtype, device=self.device))
        if partition_dim == 0:
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:  # replicated; applied to a sequence shard under SP, so its gradient needs a TP sum
            self.bias.sequence_parallel = self.sequence_parallel

    def _init_fp8(self, fp8: Union[Fp8Recipe, bool, None], config: Any, partition_dim: int) -> None:
        """``fp8``: a recipe, False (never: the output layer), or None (``config``'s fp8 fields, as
        Megatron's layers read them)."""
        recipe = Fp8Recipe.from_config(config) if fp8 is None else (fp8 or None)
        self.fp8_scaling = None if recipe is None else Fp8Scaling(recipe, partition_dim, self.tp_group, self.device)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, weight={None if self.weight is None else tuple(self.weight.shape)}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A + b with A split along its output (column) dim across TP ranks.

    Input [s, b, in] (a sequence shard [s/tp, b, in] with ``sequence_parallel``);
    output [s, b, out/tp], or [s, b, out] with ``gather_output``.
    Returns ``(output, bias)``; bias is None unless ``skip_bias_add`` (then the
    caller adds it, typically fused with the next op).
    """

    def __init__(self, input_size: int, output_size: int, *, gather_output: bool = False,
                 skip_weight_param_allocation: bool = False, disable_grad_reduce: bool = False,
                 **common: Any) -> None:
        """``common``: the keywords both linear layers take (:class:`_ParallelLinear`: config, bias,
        init_method, stride, skip_bias_add, sequence_parallel, gradient_accumulation_fusion,
        params_dtype, perform_initialization, device, tp_group). ``disable_grad_reduce`` (Megatron's):
        leave the input gradient unreduced over TP."""
        super().__init__(input_size, output_size, 0, allocate_weight=not skip_weight_param_allocation, **common)
        if gather_output and self.sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True is incompatible with sequence_parallel=True")
        self.gather_output = gather_output
        # Without SP the input is replicated over TP: its gradient is summed over TP.
        self.allreduce_dgrad = (group_rank_and_size(self.tp_group)[1] > 1 and not self.sequence_parallel
                                and not disable_grad_reduce)

    @eager  # see _ParallelLinear
    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None, *, defer_bias_grad: bool = False):
        """``defer_bias_grad`` (ours): the bias is added in the GEMM as usual, but its gradient is left to the
        caller, which computes it from the output's gradient in a pass it makes anyway (fused.split_qkv)."""
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear built with skip_weight_param_allocation needs a weight in forward")
            weight = self.weight
        else:
            if weight.shape != (self.output_size_per_partition, self.input_size):
                raise ValueError(
                    f"supplied weight has shape {tuple(weight.shape)}, expected "
                    f"{(self.output_size_per_partition, self.input_size)}"
                )
        bias = self.bias if not self.skip_bias_add else None
        if defer_bias_grad and bias is not None:
            bias = bias.detach()
        out = linear_with_grad_accumulation_and_async_allreduce(
            x, weight, bias, self.gradient_accumulation_fusion, self.allreduce_dgrad,
            self.sequence_parallel, self.tp_group, self.fp8_scaling,
        )
        out_bias = self.bias if self.skip_bias_add else None
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)
            if out_bias is not None:  # the caller adds it to the gathered output: give the whole bias
                out_bias = gather_from_tensor_model_parallel_region(out_bias, self.tp_group)
        return out, out_bias


class RowParallelLinear(_ParallelLinear):
    """Y = X A + b with A split along its input (row) dim across TP ranks.

    Input [s, b, in/tp] (``input_is_parallel``, the usual case after a
    ColumnParallelLinear) or [s, b, in]; output [s, b, out] summed over TP, or a
    sequence shard [s/tp, b, out] with ``sequence_parallel`` (reduce-scatter).
    """

    def __init__(self, input_size: int, output_size: int, *, input_is_parallel: bool = True, **common: Any) -> None:
        """``common``: the keywords both linear layers take (see :class:`ColumnParallelLinear`)."""
        super().__init__(input_size, output_size, 1, **common)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.input_is_parallel = input_is_parallel

    @eager  # see _ParallelLinear
    def forward(self, x: torch.Tensor):
        x_parallel = x if self.input_is_parallel else scatter_to_tensor_model_parallel_region(x, self.tp_group)
        # under SP the reduce-scatter is the linear's own, split beside its GEMM (linear_functions.py)
        out = linear_with_grad_accumulation_and_async_allreduce(
            x_parallel, self.weight, None, self.gradient_accumulation_fusion, False, False, self.tp_group,
            self.fp8_scaling, reduce_scatter_output=self.sequence_parallel,
        )
        if not self.sequence_parallel:
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return out, (self.bias if self.skip_bias_add else None)
        return out + self.bias, None


def vocab_size_with_padding(
    orig_vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Pad the vocabulary to a multiple of divisor x TP (Megatron's ``_vocab_size_with_padding``)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((orig_vocab_size + multiple - 1) // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split across TP ranks.

    Each rank looks up the ids in its range and zeroes the rest; the partial
    results are summed over TP (or reduce-scattered into sequence shards with
    ``reduce_scatter_embeddings``, which also turns [b, s, h] into [s/tp, b, h]).
    Rows past ``num_embeddings`` are padding: initialised to zero, so the real
    rows do not depend on TP. ``make_vocab_size_divisible_by`` defaults to 128, or to 1 with a
    Megatron ``config`` (Megatron's embedding takes the vocabulary already padded). ``config``:
    as for the linear layers (``params_dtype``, ``use_cpu_initialization``, ``perform_initialization``,
    ``gradient_accumulation_fusion``: here the looked-up rows' gradients go into ``main_grad``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Optional[InitMethod] = None,
        make_vocab_size_divisible_by: Optional[int] = None,
        reduce_scatter_embeddings: bool = False,
        config: Any = None,
        params_dtype: Optional[torch.dtype] = None,
        perform_initialization: Optional[bool] = None,
        device: Optional[torch.device] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        gradient_accumulation_fusion: Optional[bool] = None,
    ):
        super().__init__()
        _check_megatron_keywords("VocabParallelEmbedding", {}, config)
        if getattr(config, "deterministic_mode", False):
            raise ValueError("VocabParallelEmbedding: config.deterministic_mode=True is not supported; set it to False")
        self.config = config
        self.tp_group = resolve_tp_group(tp_group)
        rank, world = group_rank_and_size(self.tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        if make_vocab_size_divisible_by is None:
            make_vocab_size_divisible_by = 128 if config is None else 1
        self.padded_num_embeddings = vocab_size_with_padding(num_embeddings, make_vocab_size_divisible_by, world)
        self.vocab_start_index, self.vocab_end_index = vocab_range(self.padded_num_embeddings, rank, world)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and world > 1
        self.gradient_accumulation_fusion = bool(_setting(gradient_accumulation_fusion, config,
                                                          "gradient_accumulation_fusion", False))
        params_dtype = _setting(params_dtype, config, "params_dtype", torch.float32)
        init_method = init_method or init_method_normal(0.02)

        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype,
                                               device=_device(device, config)))
        if _setting(perform_initialization, config, "perform_initialization", True):
            master = torch.zeros(self.padded_num_embeddings, embedding_dim, dtype=torch.float32)
            init_method(master[:num_embeddings])
            with torch.no_grad():
                self.weight.copy_(master[self.vocab_start_index:self.vocab_end_index].to(params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        _, world = group_rank_and_size(self.tp_group)
        if world > 1:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local_ids = input_ids
        out = embedding(local_ids, self.weight, self.gradient_accumulation_fusion)
        if world > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, padded={self.padded_num_embeddings}, "
                f"per_partition={self.num_embeddings_per_partition}, dim={self.embedding_dim}")


def allreduce_sequence_parallel_gradients(
    params: Iterable[torch.nn.Parameter], group: Optional[dist.ProcessGroup] = None
) -> None:
    """Sum over TP the gradients of replicated parameters applied to sequence shards.

    Under sequence parallelism each TP rank sees only its slice of the sequence,
    so LayerNorm weights and row-parallel biases get partial gradients. The
    gradient lives in ``main_grad`` when the DDP wrapper is used, else in ``grad``.
    All of them travel in one flat buffer: one collective instead of one per tensor.
    """
    group = resolve_tp_group(group)
    _, world = group_rank_and_size(group)
    if world == 1:
        return
    grads = []
    for p in params:
        if getattr(p, "sequence_parallel", False):
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(g)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(same)
        all_reduce(flat, group)
        for g, synced in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
            g.copy_(synced)
