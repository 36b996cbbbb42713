"""RNG streams for tensor parallelism, and activation checkpointing that replays them.

Dropout on activations that are split across TP ranks (attention probabilities
of a head shard, sequence-parallel shards) must differ between ranks, while
dropout on replicated activations must be identical on every TP rank. Megatron
keeps named generator states in a tracker: ``model_parallel_cuda_manual_seed``
seeds the default generator identically on all TP ranks and adds a
"model-parallel-rng" stream seeded per TP rank; ``with get_cuda_rng_tracker().fork():``
runs a region on that stream.

The tracker works on the generator of the device that parallel3d computes on
(``parallel3d.device``: CUDA's on a GPU rank, the CPU's on a CPU rank), so the same
code and tests run on both.

``checkpoint`` (activation recomputation) saves the default and tracked
generator states before the forward and restores them for the recompute, so
recomputed dropout masks are identical to the original ones.

On CUDA each tracked stream is a generator state object of its own, swapped in with
``graphsafe_set_state`` (as Megatron-Core's graph-safe tracker): a CUDA graph that registers
those objects (training/cuda_graphs.py) advances them on every replay as the eager run would,
so dropout inside a captured layer draws new numbers each step. On the CPU, where generators
have no such states, a stream is a snapshot of the generator's state, swapped in and out.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from ..device import uses_cuda as _use_cuda

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


# Generator state objects a CUDA graph can register (torch >= 2.5): dropout can then run inside graphs
GRAPH_SAFE_RNG = hasattr(torch.Generator, "graphsafe_set_state")


def _live_states() -> bool:
    """Whether tracked streams are generator state objects (CUDA, where torch has them) rather than snapshots
    (the CPU, or an older torch)."""
    return _use_cuda() and GRAPH_SAFE_RNG


def _cuda_generator() -> torch.Generator:
    return torch.cuda.default_generators[torch.cuda.current_device()]


@contextlib.contextmanager
def _running(state):
    """The device generator running on the live state ``state`` for the block (CUDA)."""
    generator = _cuda_generator()
    outer = generator.graphsafe_get_state()
    generator.graphsafe_set_state(state)
    try:
        yield generator
    finally:
        generator.graphsafe_set_state(outer)


class RNGStatesTracker:
    """Named generator states that can be swapped in for a region (Megatron's CudaRNGStatesTracker)."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}  # live state objects on CUDA, snapshot tensors on the CPU
        self.seeds: set[int] = set()
        self.current: Optional[str] = None  # the stream the generator runs now (None: the default one)

    def reset(self) -> None:
        self.states, self.seeds, self.current = {}, set(), None

    def get_states(self) -> dict[str, torch.Tensor]:
        """Each stream's state as a tensor (what a checkpoint saves)."""
        if not _live_states():
            return {k: v.clone() for k, v in self.states.items()}
        snapshots = {}
        for name, state in self.states.items():
            with _running(state) as generator:
                snapshots[name] = generator.get_state()
        return snapshots

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Set each stream from a tensor of get_states. On CUDA a known stream keeps its state object (a
        captured graph holds it) and takes the new seed and offset in place."""
        if not _live_states():
            self.states = {k: v.clone() for k, v in states.items()}
            return
        for name in list(self.states):
            if name not in states:
                del self.states[name]
        for name, snapshot in states.items():
            state = self.states.get(name)
            if state is None:
                state = self.states[name] = _cuda_generator().clone_state()
            with _running(state) as generator:
                generator.set_state(snapshot)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds.add(seed)
        if _live_states():
            state = self.states[name] = _cuda_generator().clone_state()
            with _running(state) as generator:
                generator.manual_seed(seed)
            return
        saved = _get_rng_state()
        _manual_seed(seed)
        self.states[name] = _get_rng_state()
        _set_rng_state(saved)

    def graph_states(self) -> list:
        """The live state objects a CUDA graph must register to draw from the tracked streams."""
        return list(self.states.values()) if _live_states() else []

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the region on stream ``name``; the stream that ran before goes on after it.

        As Megatron's: a stream forked again further in (A, then B, then A) continues where it stood:
        A0, B0, A1, B1, A2, never a replay of numbers already drawn. On CUDA the streams are live state
        objects, which advance in place; on the CPU, entering stores the live state of the stream that was
        running (unless it is the default one) before switching, and leaving stores ``name``'s state and
        switches back to the outer stream's stored state.
        """
        if name not in self.states:
            raise KeyError(
                f"RNG state {name!r} is not in the tracker: call model_parallel_cuda_manual_seed(seed) first"
            )
        outer = self.current
        if _live_states():
            self.current = name
            try:
                with _running(self.states[name]):
                    yield
            finally:
                self.current = outer
            return
        outer_state = _get_rng_state()
        if outer is not None:
            self.states[outer] = outer_state
        _set_rng_state(self.states[name])
        self.current = name
        try:
            yield
        finally:
            self.states[name] = _get_rng_state()
            _set_rng_state(self.states[outer] if outer is not None else outer_state)
            self.current = outer


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron's name; it tracks CPU generators on a CPU-only machine)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None) -> None:
    """Seed the device's default stream with ``seed`` (same on all TP ranks) and the TP stream per rank.

    The model-parallel stream uses seed + 2718 + tp_rank, as in Megatron. On a GPU rank only
    CUDA's generators are seeded, as in Megatron: the CPU generator (which initialises the
    weights) belongs to the training script's seeding (``torch.manual_seed``), and reseeding it
    here would change weights initialised afterwards. On a CPU rank the device generator is the
    CPU's, so there it is seeded.
    """
    if tp_rank is None:  # a job of several processes without groups: refused, not every rank "TP rank 0"
        from .utils import group_rank_and_size, resolve_tp_group

        group = resolve_tp_group(None, "model_parallel_cuda_manual_seed", "pass tp_rank=")
        tp_rank = group_rank_and_size(group)[0]
    _manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping its activations; recompute them in backward with the same RNG."""

    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.cuda_rng_state = torch.cuda.get_rng_state() if _use_cuda() else None
        ctx.tracker_states = _TRACKER.get_states()
        with torch.no_grad():
            outputs = function(*args)
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_indices])
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_indices, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(t.requires_grad)

        # Replay the RNG as it was in forward, then put the current states back.
        cpu_now = torch.get_rng_state()
        cuda_now = torch.cuda.get_rng_state() if _use_cuda() else None
        tracker_now = _TRACKER.get_states()
        torch.set_rng_state(ctx.cpu_rng_state)
        if ctx.cuda_rng_state is not None:
            torch.cuda.set_rng_state(ctx.cuda_rng_state)
        _TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            torch.set_rng_state(cpu_now)
            if cuda_now is not None:
                torch.cuda.set_rng_state(cuda_now)
            _TRACKER.set_states(tracker_now)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(a.grad if torch.is_tensor(a) else None for a in args)


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Activation recomputation that reproduces dropout masks (Megatron's ``tensor_parallel.checkpoint``,
    in its argument order). ``distribute_saved_activations=True`` (saving the input split over TP
    ranks) is not supported: pass False."""
    if not isinstance(distribute_saved_activations, bool):
        raise TypeError("checkpoint(function, distribute_saved_activations, *args) takes Megatron's argument order: "
                        f"got a {type(distribute_saved_activations).__name__} for distribute_saved_activations")
    if distribute_saved_activations:
        raise ValueError("checkpoint: distribute_saved_activations=True is not supported; pass False "
                         "(config.distribute_saved_activations=False)")
    return CheckpointFunction.apply(function, *args)
