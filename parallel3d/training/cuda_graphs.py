"""Megatron's ``--enable-cuda-graph``: each transformer layer's forward and backward captured as CUDA graphs
after ``--cuda-graph-warmup-steps`` eager steps, then replayed.

Why: a replay is one launch where the eager layer makes a hundred or more. A TP=2 GPT-1.3B step at
micro-batch 4 is set by the host's launches, not by the GPU (BENCHMARKS.md, issue 26's third lease). So
graphs are the default of TP and FP8 runs on GPUs that a graph can hold (``arguments._cuda_graph_rules``);
``--cuda-graph-impl none`` keeps the layers eager.

How: ``torch.cuda.make_graphed_callables`` over a chunk's layers, each with its input's shape (a
micro-batch), a causal mask (None) and the rotary embedding fixed. One capture's layers share one memory
pool, which holds one micro-batch's activations until that micro-batch's backward. A pipeline schedule holds
several micro-batches in flight, so a block gets as many captures (slots) as it had forwards in flight at
once during the eager warm-up steps (``InFlight`` counts them). A forward takes a free slot, which its
backward frees; with none free, or for anything else (evaluation, another shape), the layers run eagerly.
What a graph cannot hold is refused before any work (``TransformerConfig._check_cuda_graph``, and the
zero-bubble schedules, whose W split runs outside a layer's backward, in the training arguments). Dropout
can be held: its kernels read their Philox seed and offset from generator states that each graph registers
(tensor_parallel/random.py), so a replay draws new numbers, the same ones as an eager layer.

FP8 (tensor_parallel/fp8.py): a weight's FP8 operands are cached for the step, and a graph reads the cached
tensors it captured; so under graphs a changed weight is quantized again into those same tensors, by the
replay's Python before the layer's graph (``Fp8Scaling.refresh_weight``), which also records a delayed-scaling
weight's amax once a step. The capture's warm-up on made-up inputs leaves the step's amaxes as they were
(``fp8_graph_capture``).

The fused weight gradient (``gradient_accumulation_fusion``) writes into ``main_grad`` inside the
backward graph. It also tells the DDP hook, in Python, not to add the placeholder gradient it returns
(``grad_added_to_main_grad``); Python does not run in a replay, so a hook on each layer's output sets
that flag again before the layer's backward replays.

NCCL keeps a communicator alive while a CUDA graph that captured its collectives exists: with the graphs
alive, ``destroy_process_group`` waited forever (TP=2, 2 x H200, 2026-11-27). So training releases them
when its loop ends (``release_cuda_graphs``), before anyone tears the process groups down.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Optional

import torch
from torch import nn

from parallel3d.pipeline.forward_backward import PipelineConfig
from parallel3d.tensor_parallel.fp8 import fp8_graph_capture
from parallel3d.tensor_parallel.random import get_cuda_rng_tracker
from parallel3d.training.training_guards import TrainingError


@contextlib.contextmanager
def _random_streams_registered_and_kept():
    """Around ``make_graphed_callables``, for dropout inside the layers:
    - every CUDAGraph it builds registers the RNG tracker's streams (the TP regions' dropout draws from them;
      the default generator registers itself), so each replay advances them as an eager layer would;
    - the generators' seeds and offsets are put back afterwards: the capture's warm-up draws nothing the run
      would have drawn, so a run with graphs draws the very numbers an eager run draws."""
    if not torch.cuda.is_available():  # a test's stand-in capture on CPU ranks: no CUDA generators to keep
        yield
        return
    tracker = get_cuda_rng_tracker()
    states, default, tracked = tracker.graph_states(), torch.cuda.get_rng_state(), tracker.get_states()
    base = torch.cuda.CUDAGraph

    class RegisteringGraph(base):
        # register in __init__: the pybind type's __new__ only allocates, and a method called on the graph
        # before its __init__ ran dereferences an unbuilt C++ object (a segfault, 2 x H200)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for state in states:
                self.register_generator_state(state)

    torch.cuda.CUDAGraph = RegisteringGraph  # make_graphed_callables builds its graphs as torch.cuda.CUDAGraph()
    try:
        yield
    finally:
        torch.cuda.CUDAGraph = base
        torch.cuda.set_rng_state(default)
        tracker.set_states(tracked)


class _FixedInputs(nn.Module):
    """A layer with its attention mask (None: causal) and rotary embedding fixed: a graph takes tensors only."""

    def __init__(self, layer: nn.Module, rotary_pos_emb: Optional[torch.Tensor]):
        super().__init__()
        self.layer = layer
        self.__dict__["rotary_pos_emb"] = rotary_pos_emb  # not a buffer: not part of any state dict

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden_states, None, self.rotary_pos_emb)


class Ticket:
    """One training forward of a block: the slot whose graphs it replays (None: eager)."""

    def __init__(self, slot: Optional[int]):
        self.slot = slot


class InFlight:
    """A block's training forwards whose backward has not reached the block yet: counted before the capture
    (``peak``: how many slots to capture), and tracked after it (which slots are free)."""

    def __init__(self):
        self.count = self.peak = 0

    def _take(self, hidden_states, attention_mask, rotary_pos_emb, inference_params) -> Optional[int]:
        return None  # before the capture: every forward runs eagerly

    def _free(self, slot: Optional[int]) -> None:
        pass

    def begin(self, hidden_states, attention_mask, rotary_pos_emb, inference_params) -> Optional[Ticket]:
        """A ticket for a training forward (grad on), None for anything else."""
        if not torch.is_grad_enabled() or inference_params is not None:
            return None
        self.count += 1
        self.peak = max(self.peak, self.count)
        return Ticket(self._take(hidden_states, attention_mask, rotary_pos_emb, inference_params))

    def end(self, ticket: Ticket, output: torch.Tensor) -> torch.Tensor:
        """The block's output: when its gradient arrives, the backward has reached the block (and replays the
        slot's backward graphs next, in the same backward call), so the forward is no longer in flight."""
        def landed(grad: Optional[torch.Tensor] = None) -> None:
            self.count -= 1
            self._free(ticket.slot)

        if output.requires_grad:
            output.register_hook(landed)
        else:
            landed()
        return output


class LayerGraphs(InFlight):
    """One block's captured layers, ``slots`` captures of them, for the input shape they were captured with."""

    def __init__(self, layers: nn.ModuleList, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 rotary_pos_emb: Optional[torch.Tensor], slots: int = 1):
        super().__init__()
        self.shape, self.rotary = tuple(shape), rotary_pos_emb
        # The warm-up's inputs, from a generator of their own: the training's random streams stay untouched.
        # They become the graphs' static inputs, which a replay overwrites and its backward reads: each slot
        # gets its own, as it gets wrappers of its own (make_graphed_callables points a module's forward at its
        # graph, so a second capture of the same wrappers would replay the first inside its own capture).
        noise = torch.Generator(device=device).manual_seed(0)

        def capture():
            samples = tuple((torch.randn(shape, dtype=dtype, device=device, generator=noise, requires_grad=True),)
                            for _ in layers)
            wrapped = tuple(_FixedInputs(layer, rotary_pos_emb) for layer in layers)
            with _random_streams_registered_and_kept():
                return torch.cuda.make_graphed_callables(wrapped, samples, allow_unused_input=True)

        # The capture's warm-up asks autograd for the weights' gradients on a side stream; their AccumulateGrad
        # nodes, made by the eager steps on the default stream, then warn of a stream mismatch that costs
        # nothing here (autograd.grad accumulates nothing). The replays run on the training stream.
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        try:  # one capture per slot, each with a memory pool of its own
            with fp8_graph_capture(layers):
                self.graphed = [capture() for _ in range(slots)]
        finally:
            torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(True)
        # FP8 linears: the graphs read each weight's cached FP8 operands, which the replay's Python refreshes first
        self.fp8 = [[(m.fp8_scaling, m) for m in layer.modules()
                     if getattr(m, "fp8_scaling", None) is not None and getattr(m, "weight", None) is not None]
                    for layer in layers]
        self.free = list(range(slots))
        self.replayed = 0  # training forwards that replayed a slot (the rest ran eagerly)
        # The capture ran each layer's Python: the weights whose fused wgrad wrote into main_grad are those it
        # marked. Their flags go back to False: the DDP hooks saw none of the capture's gradients.
        self.fused = []
        for layer in layers:
            marked = [p for p in layer.parameters() if getattr(p, "grad_added_to_main_grad", False)]
            for p in marked:
                p.grad_added_to_main_grad = False
            self.fused.append(marked)

    def replays(self, hidden_states: torch.Tensor, attention_mask, rotary_pos_emb, inference_params) -> bool:
        """Whether this forward is the captured one (a training micro-batch of the captured shape)."""
        return (attention_mask is None and inference_params is None and torch.is_grad_enabled()
                and tuple(hidden_states.shape) == self.shape and (rotary_pos_emb is None) == (self.rotary is None)
                and (rotary_pos_emb is None or rotary_pos_emb.shape == self.rotary.shape))

    def _take(self, hidden_states, attention_mask, rotary_pos_emb, inference_params) -> Optional[int]:
        if not self.free or not self.replays(hidden_states, attention_mask, rotary_pos_emb, inference_params):
            return None
        self.replayed += 1
        return self.free.pop()

    def _free(self, slot: Optional[int]) -> None:
        if slot is not None:
            self.free.append(slot)

    def layer(self, slot: int, index: int, hidden_states: torch.Tensor) -> torch.Tensor:
        for scaling, linear in self.fp8[index]:  # a changed weight quantized again, where its graph reads it
            scaling.refresh_weight(linear.weight)
        out = self.graphed[slot][index](hidden_states)
        fused = self.fused[index]
        if fused and out.requires_grad:
            def mark(grad: torch.Tensor) -> None:  # runs before the layer's backward graph replays
                for p in fused:
                    p.grad_added_to_main_grad = True

            out.register_hook(mark)
        return out


def count_in_flight(model: list) -> None:
    """Before the warm-up steps: every block counts its forwards in flight (the slots its capture needs)."""
    for _, block in _blocks(model):
        block.__dict__["cuda_graphs"] = InFlight()


def describe(config) -> Optional[str]:
    """The training log's line on how a TP or FP8 run's layers are launched (None without TP, FP8 or graphs)."""
    graphs = getattr(config, "enable_cuda_graph", False)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if tp == 1 and getattr(config, "fp8", None) is None and not graphs:
        return None
    tp_part = f"TP={tp}{' + SP' if getattr(config, 'sequence_parallel', False) else ''}, " if tp > 1 else ""
    if graphs:
        return (f"{tp_part}layers launched as CUDA graphs: captured after {config.cuda_graph_warmup_steps} eager "
                "steps, then replayed (--enable-cuda-graph)")
    blockers = config.cuda_graph_blocked_by()
    why = "; ".join(blockers) if blockers else "--cuda-graph-impl none, a zero-bubble schedule, or CPU ranks"
    return f"{tp_part}layers launched eagerly (CUDA graphs, the default for TP and FP8 on GPUs, are off: {why})"


def _blocks(model: list):
    """(module, its TransformerBlock) of every chunk of ``model`` that has layers."""
    from parallel3d.models.block import TransformerBlock

    for chunk in model:
        for module in chunk.modules():
            block = getattr(module, "decoder", None)
            if isinstance(block, TransformerBlock) and len(block.layers):
                yield module, block


def capture_cuda_graphs(model: list, micro_batch_size: int) -> int:
    """Capture the layers of every chunk of ``model`` (between two training steps: the capture's warm-up runs
    forward and backward, and its fused weight gradients land in main_grad, which the next step zeroes), as
    many times as the block had forwards in flight since ``count_in_flight`` (one without it). Every rank of a
    TP group calls it at the same step. Returns the number of layers captured (once each)."""
    captured = 0
    for module, block in _blocks(model):
        cfg = block.config
        shape = PipelineConfig.of(cfg).tensor_shape(cfg.seq_length, micro_batch_size)  # [s (/ TP under SP), b, h]
        device = next(block.parameters()).device
        rotary = None
        if getattr(module, "rotary_pos_emb", None) is not None:
            rotary = module.rotary_pos_emb(cfg.seq_length, device)
        seen = block.cuda_graphs.peak if isinstance(block.cuda_graphs, InFlight) else 1
        block.__dict__["cuda_graphs"] = LayerGraphs(block.layers, shape, cfg.params_dtype, device, rotary,
                                                    slots=max(1, seen))
        captured += len(block.layers)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return captured


def release_cuda_graphs(model: list, wait: bool = True) -> int:
    """Drop every chunk's captured graphs (the layers run eagerly again) and free them, so the process groups
    can be destroyed. ``wait``: first let the GPU finish their last replay (not after a failure, where the
    GPU may never finish). Returns how many of the blocks' training forwards replayed their graphs (a run's
    proof that its graphs ran, not only that they were captured)."""
    blocks = [block for _, block in _blocks(model) if block.cuda_graphs is not None]
    held = sum(isinstance(block.cuda_graphs, LayerGraphs) for block in blocks)
    replayed = sum(block.cuda_graphs.replayed for block in blocks if isinstance(block.cuda_graphs, LayerGraphs))
    if held and wait and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    for block in blocks:  # the counters of a run that never reached its capture go too
        block.__dict__["cuda_graphs"] = None
    if held:
        gc.collect()  # the graphed autograd functions sit in reference cycles: free the graphs now, not later
    return replayed


def out_of_memory(error: torch.cuda.OutOfMemoryError, where: str) -> TrainingError:
    """A CUDA out-of-memory error of a run with graphs, with the flag that gives their memory back: each
    captured graph keeps its layers' inputs, outputs and activations in a pool of its own, beside what the
    eager steps allocate (on by default in TP and FP8 runs, so the user may not know the graphs are there)."""
    return TrainingError(f"{where}: out of GPU memory with CUDA graphs on (their memory pools hold each "
                         f"captured layer's activations); --cuda-graph-impl none keeps the layers eager and needs "
                         f"less memory. {error}")
