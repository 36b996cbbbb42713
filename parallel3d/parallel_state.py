"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism.

The rank layout is a mixed-radix number: with the default order "tp-dp-pp",
``rank = tp + TP * (dp + DP * pp)``, so TP ranks are adjacent (one node, NVLink)
and pipeline stages are the slowest-varying coordinate (they span nodes).
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
no groups). Data parallelism is never guessed: DDP under torch.distributed without
model-parallel groups needs its ``dp_group`` passed (see distributed/ddp.py).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

_ORDERS = ("tp-dp-pp", "tp-pp-dp")


def _coords(rank: int, sizes: dict[str, int], order: str) -> dict[str, int]:
    """Coordinates of ``rank`` when the dims of ``order`` vary fastest to slowest."""
    coords = {}
    for dim in order.split("-"):
        coords[dim] = rank % sizes[dim]
        rank //= sizes[dim]
    return coords


# The layout's own names; validate_args passes its flags' names instead, so one rule (and one message)
# serves the API and the command line.
LAYOUT_NAMES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")


def data_parallel_size(world_size: int, tp: int, pp: int, names: tuple[str, ...] = LAYOUT_NAMES) -> int:
    """World / (TP x PP), or a ValueError naming the sizes: the one rule of the process layout."""
    if tp < 1 or pp < 1:
        raise ValueError(f"{names[0]} ({tp}) and {names[1]} ({pp}) must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world size ({world_size}) is not divisible by {names[0]} ({tp}) x {names[1]} ({pp}) "
                         f"= {tp * pp}")
    return world_size // (tp * pp)


def check_virtual_pipeline_size(pp: int, vp: Optional[int], names: tuple[str, ...] = LAYOUT_NAMES) -> None:
    """Virtual stages (None: none) interleave several pipeline ranks: a positive size, with PP > 1."""
    if vp is None:
        return
    if pp == 1:
        raise ValueError(f"{names[2]}={vp} needs {names[1]} > 1 (virtual stages interleave several pipeline "
                         "ranks); leave it unset with one pipeline stage")
    if not isinstance(vp, int) or vp < 1:
        raise ValueError(f"{names[2]} must be a positive integer, got {vp!r}")


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
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    dp = data_parallel_size(world_size, tp, pp)
    sizes = {"tp": tp, "dp": dp, "pp": pp}
    coords = [_coords(r, sizes, order) for r in range(world_size)]

    def groups_varying(dims: tuple[str, ...]) -> list[list[int]]:
        fixed = [d for d in sizes if d not in dims]
        by_key: dict[tuple[int, ...], list[int]] = {}
        for r, c in enumerate(coords):  # ranks ascend, and so does each group's inner coordinate
            by_key.setdefault(tuple(c[d] for d in fixed), []).append(r)
        return sorted(by_key.values())

    pp_groups = groups_varying(("pp",))
    pp_groups = [sorted(g, key=lambda r: coords[r]["pp"]) for g in pp_groups]
    embedding = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups]
    return {
        "tp": groups_varying(("tp",)),
        "pp": pp_groups,
        "dp": groups_varying(("dp",)),
        "mp": groups_varying(("tp", "pp")),
        "embedding": embedding,
    }


@dataclass
class ParallelState:
    """The groups this rank belongs to, plus its coordinates in the layout."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    order: str
    rank: int
    group_ranks: dict[str, list[int]]  # this rank's group of each kind
    groups: dict[str, Optional[dist.ProcessGroup]] = field(repr=False)

    @staticmethod
    def one_process() -> "ParallelState":
        """The layout of a single process without torch.distributed: every size 1, no groups."""
        kinds = ("tp", "pp", "dp", "mp", "embedding")
        return ParallelState(1, 1, 1, None, "tp-dp-pp", 0, {k: [0] for k in kinds}, {k: None for k in kinds})

    # Names follow Megatron so that porting scripts is mechanical.
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

    def is_pipeline_first_stage(self, ignore_virtual: bool = False, vp_stage: Optional[int] = None) -> bool:
        return self._in_virtual_stage(0, ignore_virtual, vp_stage) and self.pipeline_model_parallel_rank == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = False, vp_stage: Optional[int] = None) -> bool:
        last = self.pipeline_model_parallel_rank == self.pipeline_model_parallel_size - 1
        return self._in_virtual_stage(-1, ignore_virtual, vp_stage) and last

    def is_rank_in_embedding_group(self) -> bool:
        return self.rank in self.group_ranks["embedding"]


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    order: str = "tp-dp-pp",
    *,
    timeout: Optional[datetime.timedelta] = None,
) -> ParallelState:
    """Create the TP/PP/DP/model-parallel/embedding groups and make them the default.

    Every rank must call this with the same arguments (torch.distributed.new_group
    is collective over the whole world). ``timeout`` bounds every operation of the
    new groups (Megatron's ``--distributed-timeout-minutes``); None: torch's default.
    """
    global _STATE
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
    dp = world_size // (tensor_model_parallel_size * pipeline_model_parallel_size)
    groups: dict[str, dist.ProcessGroup] = {}
    mine: dict[str, list[int]] = {}
    for kind, table in tables.items():
        for ranks in table:
            # new_group is collective: every rank creates every group, keeps its own.
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[kind], mine[kind] = group, ranks
    mine.setdefault("embedding", [])
    _STATE = ParallelState(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        data_parallel_size=dp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        order=order,
        rank=rank,
        group_ranks=mine,
        groups=groups,
    )
    return _STATE


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
get_data_parallel_group = _getter("data_parallel_group", "get_data_parallel_group")
get_model_parallel_group = _getter("model_parallel_group", "get_model_parallel_group")
get_embedding_group = _getter("embedding_group", "get_embedding_group")
get_tensor_model_parallel_rank = _getter("tensor_model_parallel_rank", "get_tensor_model_parallel_rank")
get_tensor_model_parallel_world_size = _getter("tensor_model_parallel_size", "get_tensor_model_parallel_world_size")
get_pipeline_model_parallel_rank = _getter("pipeline_model_parallel_rank", "get_pipeline_model_parallel_rank")
get_pipeline_model_parallel_world_size = _getter("pipeline_model_parallel_size",
                                                 "get_pipeline_model_parallel_world_size")
get_data_parallel_rank = _getter("data_parallel_rank", "get_data_parallel_rank")
get_data_parallel_world_size = _getter("data_parallel_size", "get_data_parallel_world_size")
get_virtual_pipeline_model_parallel_world_size = _getter("virtual_pipeline_model_parallel_size",
                                                         "get_virtual_pipeline_model_parallel_world_size")


def is_pipeline_first_stage(ignore_virtual: bool = False, vp_stage: Optional[int] = None) -> bool:
    return get_parallel_state().is_pipeline_first_stage(ignore_virtual, vp_stage)


def is_pipeline_last_stage(ignore_virtual: bool = False, vp_stage: Optional[int] = None) -> bool:
    return get_parallel_state().is_pipeline_last_stage(ignore_virtual, vp_stage)


def is_rank_in_embedding_group() -> bool:
    return get_parallel_state().is_rank_in_embedding_group()
