"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism.

The rank layout is a :class:`Grid` over the named dimensions of ``DIMENSIONS``, a
mixed-radix number: with the default order "tp-dp-pp", ``rank = tp + TP * (dp + DP * pp)``,
so TP ranks are adjacent (one node, NVLink) and pipeline stages are the slowest-varying
coordinate (they span nodes). Each group of ``GROUPS`` is the set of ranks that differ only
in its dimensions (as Megatron's RankGenerator builds them).
``build_group_ranks`` computes every group as a pure function, so the tables
can be checked for any world size without starting a process;
``initialize_model_parallel`` creates the torch.distributed groups from it.

Two ways to use the groups:
- explicit: ``state = initialize_model_parallel(...)`` returns a
  :class:`ParallelState`; every parallel layer accepts explicit groups;
- Megatron style: the module-level getters (``get_tensor_model_parallel_group()``
  and friends) read the default state set by the last ``initialize_model_parallel``;
  they raise while there is none.

Library code that also builds the one-process model (the layers, the models, the
training loop; a test's single-process reference) asks :func:`resolve_parallel_state`:
the state it was given, else the default, else the one-process layout (every size 1,
no groups). A layout is never guessed in a job of several processes: without model-parallel groups,
DDP under torch.distributed needs its ``dp_group`` passed (distributed/ddp.py) and a TP layer its
group (tensor_parallel/utils.py ``resolve_tp_group``).
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from parallel3d import symmetric_memory

# The layout's dimensions, fastest- to slowest-varying in the default order, each with the Megatron
# argument of its size. A new one (cp, ep) is one entry here, its keyword (and place in the default
# order) in initialize_model_parallel and build_group_ranks, its groups in GROUPS and its getters.
DIMENSIONS = {"tp": "tensor_model_parallel_size", "dp": "data_parallel_size", "pp": "pipeline_model_parallel_size"}
# The sizes a layout is given (DP's is derived: data_parallel_size) and the virtual pipeline size:
# initialize_model_parallel's and TransformerConfig's keywords, read off the arguments as one record.
_GIVEN_SIZES = tuple(name for dim, name in DIMENSIONS.items() if dim != "dp")
MODEL_PARALLEL_SIZES = (*_GIVEN_SIZES, "virtual_pipeline_model_parallel_size")
# Megatron's other dimensions: an order string may name them, at size 1 (see parse_order).
_SIZE_ONE_DIMENSIONS = ("cp", "ep")
# The groups every rank joins, by the dimensions that vary inside each (TP x PP: one model replica).
GROUPS = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "mp": ("tp", "pp")}


def parse_order(order: str) -> tuple[str, ...]:
    """Megatron's ``order`` string as the dimensions from fastest- to slowest-varying.

    As Megatron's RankGenerator: case-insensitive, names joined by '-', a dimension left out is
    appended (Megatron then needs its size to be 1: :class:`Grid` checks). ``cp`` and ``ep`` may
    appear (they have size 1 here, so where they stand changes nothing) and are dropped.
    """
    names = order.lower().split("-")
    if len(set(names)) != len(names) or not set(names) <= {*DIMENSIONS, *_SIZE_ONE_DIMENSIONS}:
        raise ValueError(f"order must name each of {'-'.join(DIMENSIONS)} (and optionally cp, ep) at most once, "
                         f"joined by '-', e.g. 'tp-dp-pp' or 'tp-pp-dp'; got {order!r}")
    given = tuple(n for n in names if n in DIMENSIONS)
    return given + tuple(d for d in DIMENSIONS if d not in given)


@dataclass(frozen=True)
class Grid:
    """Global ranks as mixed-radix numbers over named dimensions, the first one varying fastest:
    with dims ("tp", "dp", "pp"), ``rank = tp + TP * (dp + DP * pp)``."""

    dims: tuple[str, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def of(order: str, sizes: dict[str, int]) -> "Grid":
        dims = parse_order(order)
        missing = [d for d in dims if d not in order.lower().split("-") and sizes[d] != 1]
        if missing:
            raise ValueError(f"order {order!r} leaves out {missing[0]}, whose size is {sizes[missing[0]]}: name it")
        return Grid(dims, tuple(sizes[d] for d in dims))

    def coords(self, rank: int) -> dict[str, int]:
        coords = {}
        for dim, size in zip(self.dims, self.sizes):
            coords[dim], rank = rank % size, rank // size
        return coords

    def groups(self, varying: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks that differ only in the ``varying`` dimensions: each group's ranks
        ascending, the groups ordered by their first rank (as Megatron's RankGenerator.get_ranks)."""
        world = 1
        for size in self.sizes:
            world *= size
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(world):
            c = self.coords(rank)
            by_key.setdefault(tuple(c[d] for d in self.dims if d not in varying), []).append(rank)
        return sorted(by_key.values())


def model_parallel_sizes(args: Any) -> dict[str, Optional[int]]:
    """The layout's sizes (MODEL_PARALLEL_SIZES) read off ``args``, by name."""
    return {name: getattr(args, name) for name in MODEL_PARALLEL_SIZES}


# A layout rule's message names a size by its keyword; validate_args passes `flag` to name its flag
# instead, so one rule (and one message) serves the API and the command line.
def data_parallel_size(world_size: int, sizes: dict[str, Any], flag: Callable[[str], str] = str) -> int:
    """World / the product of the given sizes (``sizes`` by Megatron's names), or a ValueError naming
    them: the one rule of the process layout."""
    given = [f"{flag(name)} ({sizes[name]})" for name in _GIVEN_SIZES]
    if any(sizes[name] < 1 for name in _GIVEN_SIZES):
        raise ValueError(" and ".join(given) + " must be >= 1")
    product = math.prod(sizes[name] for name in _GIVEN_SIZES)
    if world_size % product != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by {' x '.join(given)} = {product}")
    return world_size // product


def check_virtual_pipeline_size(pp: int, vp: Optional[int], flag: Callable[[str], str] = str) -> None:
    """Virtual stages (None: none) interleave several pipeline ranks: a positive size, with PP > 1."""
    if vp is None:
        return
    vp_name, pp_name = flag("virtual_pipeline_model_parallel_size"), flag("pipeline_model_parallel_size")
    if pp == 1:
        raise ValueError(f"{vp_name}={vp} needs {pp_name} > 1 (virtual stages interleave several pipeline "
                         "ranks); leave it unset with one pipeline stage")
    if not isinstance(vp, int) or vp < 1:
        raise ValueError(f"{vp_name} must be a positive integer, got {vp!r}")


def build_group_ranks(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    order: str = "tp-dp-pp",
) -> dict[str, list[list[int]]]:
    """Every group of the layout, as lists of global ranks (a pure function).

    Keys: ``tp``, ``pp``, ``dp``, ``mp`` (TP x PP: one model replica) and
    ``embedding`` (first and last stage of each pipeline, for tied embeddings).
    Each group's ranks are ordered by the coordinate that varies inside it.
    """
    given = {"tensor_model_parallel_size": tensor_model_parallel_size,
             "pipeline_model_parallel_size": pipeline_model_parallel_size}
    parse_order(order)  # a bad order string is named before the sizes are checked
    dp = data_parallel_size(world_size, given)
    grid = Grid.of(order, {dim: dp if dim == "dp" else given[name] for dim, name in DIMENSIONS.items()})
    tables = {kind: grid.groups(dims) for kind, dims in GROUPS.items()}
    tables["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in tables["pp"]]
    return tables


@dataclass
class ParallelState:
    """The groups this rank belongs to, plus its coordinates in the layout."""

    sizes: dict[str, int]  # each dimension's size (DIMENSIONS)
    virtual_pipeline_model_parallel_size: Optional[int]
    order: str  # the dimensions fastest- to slowest-varying, e.g. "tp-dp-pp"
    rank: int
    group_ranks: dict[str, list[int]]  # this rank's group of each kind (GROUPS, and "embedding")
    groups: dict[str, Optional[dist.ProcessGroup]] = field(repr=False)
    # the TP all-gathers' buffers in NCCL symmetric windows (symmetric_memory.py); None where unavailable or off,
    # and why
    tp_symmetric_buffers: Optional[Any] = field(default=None, repr=False)
    tp_symmetric_off_reason: Optional[str] = field(default=None, repr=False)

    @staticmethod
    def one_process() -> "ParallelState":
        """The layout of a single process without torch.distributed: every size 1, no groups."""
        kinds = (*GROUPS, "embedding")
        return ParallelState({d: 1 for d in DIMENSIONS}, None, "-".join(DIMENSIONS), 0,
                             {k: [0] for k in kinds}, {k: None for k in kinds})

    # Names follow Megatron so that porting scripts is mechanical.
    tensor_model_parallel_size = property(lambda self: self.sizes["tp"])
    pipeline_model_parallel_size = property(lambda self: self.sizes["pp"])
    data_parallel_size = property(lambda self: self.sizes["dp"])
    tensor_model_parallel_group = property(lambda self: self.groups["tp"])
    pipeline_model_parallel_group = property(lambda self: self.groups["pp"])
    data_parallel_group = property(lambda self: self.groups["dp"])
    model_parallel_group = property(lambda self: self.groups["mp"])
    embedding_group = property(lambda self: self.groups.get("embedding"))
    tensor_model_parallel_rank = property(lambda self: self.group_ranks["tp"].index(self.rank))
    pipeline_model_parallel_rank = property(lambda self: self.group_ranks["pp"].index(self.rank))
    data_parallel_rank = property(lambda self: self.group_ranks["dp"].index(self.rank))

    def pipeline_rank_to_global(self, pp_rank: int) -> int:
        """Global rank of pipeline stage ``pp_rank`` in this rank's pipeline."""
        return self.group_ranks["pp"][pp_rank]

    def _in_virtual_stage(self, which: int, ignore_virtual: bool, vp_stage: Optional[int]) -> bool:
        """Whether a chunk is local chunk ``which`` (0 or V-1) as far as virtual stages matter."""
        if ignore_virtual or self.virtual_pipeline_model_parallel_size is None:
            return True
        if vp_stage is None:
            raise ValueError("with virtual pipeline stages, pass vp_stage (the local chunk) or ignore_virtual=True")
        return vp_stage == which % self.virtual_pipeline_model_parallel_size

    # Megatron-Core's defaults: ignore_virtual=True asks about the pipeline rank only.
    def is_pipeline_first_stage(self, ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
        return self._in_virtual_stage(0, ignore_virtual, vp_stage) and self.pipeline_model_parallel_rank == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
        last = self.pipeline_model_parallel_rank == self.pipeline_model_parallel_size - 1
        return self._in_virtual_stage(-1, ignore_virtual, vp_stage) and last

    def is_rank_in_embedding_group(self, ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
        """In the group of the tied embedding; with ``ignore_virtual=False``, only for the chunk
        ``vp_stage`` that holds the embedding (first stage) or the output layer (last stage)."""
        if self.rank not in self.group_ranks["embedding"]:
            return False
        if ignore_virtual:
            return True
        if self.rank == self.group_ranks["embedding"][0]:
            return self.is_pipeline_first_stage(False, vp_stage)
        return self.is_pipeline_last_stage(False, vp_stage)


_STATE: Optional[ParallelState] = None


# Megatron's other initialize_model_parallel keywords, each at the value that means "tensor, pipeline
# and data parallelism only"; any other value is refused by name. expert_tensor_parallel_size may
# also equal the TP size; create_gloo_process_groups is accepted either way (no gloo group is made,
# and no getter here returns one).
_MEGATRON_KEYWORDS = {
    "pipeline_model_parallel_comm_backend": None, "use_sharp": False, "context_parallel_size": 1,
    "hierarchical_context_parallel_sizes": None, "hybrid_context_parallel": False, "expert_model_parallel_size": 1,
    "num_distributed_optimizer_instances": 1, "expert_tensor_parallel_size": None,
    "nccl_communicator_config_path": None, "get_embedding_ranks": None, "get_position_embedding_ranks": None,
    "create_gloo_process_groups": True, "high_priority_stream_groups": None, "sharp_enabled_group": None,
    "create_all_gather_group": False,
}


def _check_megatron_keywords(options: dict[str, Any], tp: int) -> None:
    for name, value in options.items():
        if name not in _MEGATRON_KEYWORDS:
            raise TypeError(f"initialize_model_parallel() got an unexpected keyword argument {name!r}")
        default = _MEGATRON_KEYWORDS[name]
        if (name == "create_gloo_process_groups" or (value is None if default is None else value == default)
                or (name == "expert_tensor_parallel_size" and value == tp)
                or (name == "high_priority_stream_groups" and not value)):
            continue
        raise ValueError(f"initialize_model_parallel: {name}={value!r} is not supported (parallel3d has tensor, "
                         f"pipeline and data parallelism); leave it at {default!r}")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    *,
    order: str = "tp-dp-pp",
    distributed_timeout_minutes: Optional[float] = None,
    timeout: Optional[datetime.timedelta] = None,
    tp_symmetric_gathers: Optional[bool] = False,
    **megatron_keywords: Any,
) -> ParallelState:
    """Create the TP/PP/DP/model-parallel/embedding groups and make them the default.

    Every rank must call this with the same arguments (torch.distributed.new_group
    is collective over the whole world). ``timeout`` (or Megatron's ``distributed_timeout_minutes``)
    bounds every operation of the new groups; None: torch's default (Megatron's default is 30
    minutes). ``order``: Megatron's order string (:func:`parse_order`). ``tp_symmetric_gathers``: the
    sequence-parallel all-gathers into NCCL symmetric windows (symmetric_memory.py): False (default) off,
    None where available, True required (refused where unavailable); they pay where the layers replay as
    CUDA graphs, and measured slower with eager layers. Megatron's other keywords
    are accepted where they mean this layout (``context_parallel_size=1``, ...) and refused by name
    otherwise.
    """
    global _STATE
    _check_megatron_keywords(megatron_keywords, tensor_model_parallel_size)
    if distributed_timeout_minutes is not None:
        if timeout is not None:
            raise ValueError("initialize_model_parallel: pass timeout or distributed_timeout_minutes, not both")
        timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "(torchrun sets the environment for it) before initialize_model_parallel()"
        )
    if _STATE is not None:
        raise RuntimeError(
            "model parallel groups are already initialised "
            f"(TP={_STATE.tensor_model_parallel_size}, PP={_STATE.pipeline_model_parallel_size}); "
            "call destroy_model_parallel() first"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    # build_group_ranks checks the sizes and the order; the virtual size only matters for the stage queries.
    tables = build_group_ranks(world_size, tensor_model_parallel_size, pipeline_model_parallel_size, order)
    check_virtual_pipeline_size(pipeline_model_parallel_size, virtual_pipeline_model_parallel_size)
    groups: dict[str, dist.ProcessGroup] = {}
    mine: dict[str, list[int]] = {}
    for kind, table in tables.items():
        for ranks in table:
            # new_group is collective: every rank creates every group, keeps its own.
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[kind], mine[kind] = group, ranks
    mine.setdefault("embedding", [])
    sizes = {dim: len(tables[dim][0]) for dim in DIMENSIONS}  # each dimension's size: its own group's
    symmetric, reason = None, "off"
    if tp_symmetric_gathers is not False:
        reason = symmetric_memory.unavailable_reason(groups.get("tp"))
        if reason is not None and tp_symmetric_gathers:
            raise ValueError(f"initialize_model_parallel: tp_symmetric_gathers=True, but the TP all-gathers cannot "
                             f"use NCCL symmetric windows here ({reason}); pass None (where available) or False")
        if reason is None:
            symmetric = symmetric_memory.SymmetricBuffers(groups["tp"])
    _STATE = ParallelState(sizes, virtual_pipeline_model_parallel_size,
                           "-".join(parse_order(order)), rank, mine, groups, symmetric, reason)
    return _STATE


def tp_symmetric_buffers(group: Optional[dist.ProcessGroup]):
    """The symmetric-window buffers of ``group`` when it is the default state's TP group and they are on
    (symmetric_memory.py), else None: the TP all-gathers then allocate their outputs."""
    if _STATE is None or group is None or group is not _STATE.groups.get("tp"):
        return None
    return _STATE.tp_symmetric_buffers


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialised: call initialize_model_parallel() "
                           "(or pass the groups / state explicitly)")
    return _STATE


def resolve_parallel_state(state: Optional[ParallelState] = None) -> ParallelState:
    """``state`` if given, else the default, else the one-process layout."""
    if state is not None:
        return state
    return _STATE if _STATE is not None else ParallelState.one_process()


def destroy_model_parallel() -> None:
    """Destroy the default groups and forget them.

    Every rank destroys its own groups kind by kind (tp, pp, dp, mp, embedding: the order in which
    initialize_model_parallel created them, the same on every rank). Tearing down an NCCL
    communicator waits for its peers to tear it down too, so ranks that destroy two shared
    groups in opposite orders wait on each other forever: a set of groups (ordered by object
    id, which differs between processes) made every TP or PP job hang after its last step.
    """
    global _STATE
    if _STATE is not None:
        if _STATE.tp_symmetric_buffers is not None:
            _STATE.tp_symmetric_buffers.release()
        for group in _STATE.groups.values():  # dict order = creation order, the same on every rank
            if group is not None and group != dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
    _STATE = None


# Megatron-style module-level getters: each reads one attribute of the default state, and
# raises while there is none.
def _getter(attribute: str, name: str):
    def get():
        return getattr(get_parallel_state(), attribute)

    get.__name__ = get.__qualname__ = name
    get.__doc__ = f"``ParallelState.{attribute}`` of the default state (set by initialize_model_parallel)."
    return get


get_tensor_model_parallel_group = _getter("tensor_model_parallel_group", "get_tensor_model_parallel_group")
get_pipeline_model_parallel_group = _getter("pipeline_model_parallel_group", "get_pipeline_model_parallel_group")
get_model_parallel_group = _getter("model_parallel_group", "get_model_parallel_group")
get_embedding_group = _getter("embedding_group", "get_embedding_group")
get_tensor_model_parallel_rank = _getter("tensor_model_parallel_rank", "get_tensor_model_parallel_rank")
get_tensor_model_parallel_world_size = _getter("tensor_model_parallel_size", "get_tensor_model_parallel_world_size")
get_pipeline_model_parallel_rank = _getter("pipeline_model_parallel_rank", "get_pipeline_model_parallel_rank")
get_pipeline_model_parallel_world_size = _getter("pipeline_model_parallel_size",
                                                 "get_pipeline_model_parallel_world_size")
get_virtual_pipeline_model_parallel_world_size = _getter("virtual_pipeline_model_parallel_size",
                                                         "get_virtual_pipeline_model_parallel_world_size")


# Megatron's data-parallel getters take with_context_parallel and partial_data_parallel: without
# context parallelism and with one distributed-optimizer instance, every variant is the DP group.
def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    return get_parallel_state().data_parallel_group


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return get_parallel_state().data_parallel_rank


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    return get_parallel_state().data_parallel_size


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    return get_parallel_state().is_pipeline_first_stage(ignore_virtual, vp_stage)


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    return get_parallel_state().is_pipeline_last_stage(ignore_virtual, vp_stage)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    return get_parallel_state().is_rank_in_embedding_group(ignore_virtual, vp_stage)
