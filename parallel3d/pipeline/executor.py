"""One executor for every schedule: walk this rank's action list and do what it says.

    F(m, c)       forward of microbatch m on local chunk c (its input was received,
                  or comes from the data on the first virtual stage)
    B(m, c)       backward of it (from the loss on the last virtual stage, else from
                  the received output gradient)
    SEND_*/RECV_* a run of them is one batch_isend_irecv (see p2p.exchange)

The model-facing contract is Megatron's, so forward-step functions port as they are:
``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`` and, on
the last stage, ``loss_func(output_tensor) -> (loss, reduced_dict)`` or
``(loss, num_tokens, reduced_dict)``. A forward step that declares a ``vp_stage``
parameter is also passed the local chunk index. Before each forward the executor calls
``model.set_input_tensor(received)`` (None on the first stage).

Memory: an activation is dropped as soon as its backward ran, so 1F1B holds at
most P microbatches' activations, not M; with ``deallocate_pipeline_outputs``
the data of an output is also freed once it was sent (Megatron's output
deallocation; its autograd graph stays).
"""
from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from parallel3d import parallel_state
from parallel3d.distributed_timeout import waiting_for
from parallel3d.model_chunk import set_input

from .p2p import TensorSpec, Transfer, exchange
from parallel3d.tensor_parallel import wgrad_store

from .schedules import Action, Schedule

Tensors = tuple[torch.Tensor, ...]


@dataclass
class PipelineGroup:
    """Who this rank talks to: the PP group, its global ranks in stage order, and this rank's stage."""

    group: Optional[dist.ProcessGroup]
    ranks: list[int]
    stage: int

    @staticmethod
    def from_state(state: Optional[parallel_state.ParallelState] = None) -> "PipelineGroup":
        state = parallel_state.resolve_parallel_state(state)
        return PipelineGroup(state.pipeline_model_parallel_group, list(state.group_ranks["pp"]),
                             state.pipeline_model_parallel_rank)


@dataclass
class ExecutorStats:
    """What the run held and, with ``time_actions``, how long each compute action took.

    ``action_times``: (action, start, end) in seconds from the step's start; on CUDA
    read from events after one synchronize at the end, so timing does not perturb the run.
    """

    inflight: int = 0
    peak_inflight: int = 0
    action_times: list[tuple[str, float, float]] = field(default_factory=list)


def _as_tuple(x: Union[torch.Tensor, Sequence[torch.Tensor], None]) -> Tensors:
    if x is None:
        return ()
    if torch.is_tensor(x):
        return (x,)
    return tuple(x)


def deallocate_output_tensor(out: torch.Tensor) -> None:
    """Free an output's data once it was sent, keeping its grad_fn (Megatron's trick).

    Backward then runs through :func:`custom_backward`, since autograd's own
    entry point insists that output and gradient shapes agree. Only valid when
    no backward function saved ``out`` itself (true of a residual add, false of
    e.g. ``tanh`` or ``x ** 2`` as the last op): hence opt-in.
    """
    if out is None or out._base is not None:
        return  # a view shares storage with its base: nothing to free safely
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(outputs: Tensors, grads: Tensors) -> None:
    """Backward from outputs whose data may have been deallocated (Megatron's custom_backward)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and o.requires_grad]
    if not pairs:
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=tuple(o for o, _ in pairs),
        grad_tensors=tuple(g for _, g in pairs),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class ScheduleExecutor:
    """Runs one schedule on this rank's model chunks."""

    def __init__(
        self,
        schedule: Schedule,
        forward_step_func: Callable,
        data_iterator: Union[Iterator, Sequence[Iterator], None],
        model: Sequence[torch.nn.Module],
        *,
        pipeline: PipelineGroup,
        recv_spec: Optional[TensorSpec],
        variable_seq_lengths: bool = False,
        forward_only: bool = False,
        grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        calculate_per_token_loss: bool = False,
        deallocate_pipeline_outputs: bool = False,
        device: Optional[torch.device] = None,
        time_actions: bool = False,
        collect_non_loss_data: bool = False,
    ):
        if len(model) != schedule.num_model_chunks:
            raise ValueError(f"schedule {schedule.name!r} expects {schedule.num_model_chunks} model chunk(s) "
                             f"per rank, got {len(model)}")
        if pipeline.stage >= schedule.num_stages or len(pipeline.ranks) != schedule.num_stages:
            raise ValueError(f"schedule has {schedule.num_stages} stages but the pipeline group has "
                             f"{len(pipeline.ranks)} ranks (this is stage {pipeline.stage})")
        self.schedule, self.model, self.pipeline = schedule, list(model), pipeline
        self.forward_step_func = forward_step_func
        # The chunk reaches the forward step as an argument where it asks for one (no global state).
        self.pass_vp_stage = "vp_stage" in inspect.signature(forward_step_func).parameters
        self.data_iterators = (list(data_iterator) if isinstance(data_iterator, (list, tuple))
                               else [data_iterator] * len(self.model))
        self.recv_spec = recv_spec
        self.variable = variable_seq_lengths
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data  # forward only: loss_func(out, non_loss_data=True)
        self.grad_scale_func = grad_scale_func
        self.per_token = calculate_per_token_loss
        self.deallocate = deallocate_pipeline_outputs and not forward_only
        self.device = device or _model_device(self.model[0])
        P, V = schedule.num_stages, schedule.num_model_chunks
        self.num_virtual = P * V
        # per (microbatch, chunk): received input, produced output, received/produced gradients
        self.inputs: dict[tuple[int, int], Tensors] = {}
        self.outputs: dict[tuple[int, int], Tensors] = {}
        self.output_specs: dict[tuple[int, int], TensorSpec] = {}
        self.output_grads: dict[tuple[int, int], Tensors] = {}
        self.input_grads: dict[tuple[int, int], Tensors] = {}
        self.losses: list[Any] = []
        self.num_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        self.stats = ExecutorStats()
        self.time_actions = time_actions
        # the microbatch of each chunk's last backward (and last W): only those reduce gradients over DP
        self.last_backward = {a.chunk: a.microbatch for a in schedule.actions[pipeline.stage] if a.kind == "B"}
        self.last_weight = {a.chunk: a.microbatch for a in schedule.actions[pipeline.stage] if a.kind == "W"}
        # Zero-bubble schedules: B defers the weight-gradient GEMMs here, W runs them.
        self.split_backward = schedule.splits_backward and not forward_only
        # each chunk's weights, listed once: every B of a split backward marks them for deferral
        self.chunk_weights = [list(m.parameters()) for m in self.model] if self.split_backward else []
        self.deferred: dict[tuple[int, int], wgrad_store.Deferred] = {}

    # ------------------------------------------------------------------ helpers
    def _is_first(self, chunk: int) -> bool:
        return self.schedule.virtual_stage(self.pipeline.stage, chunk) == 0

    def _is_last(self, chunk: int) -> bool:
        return self.schedule.virtual_stage(self.pipeline.stage, chunk) == self.num_virtual - 1

    def _local_neighbour(self, chunk: int, step: int) -> Optional[int]:
        """The local chunk holding the virtual stage ``step`` away from ``chunk``'s, if on this rank."""
        v = self.schedule.virtual_stage(self.pipeline.stage, chunk) + step
        if not 0 <= v < self.num_virtual:
            return None
        rank, other = self.schedule.stage_location(v)
        return other if rank == self.pipeline.stage else None

    # ------------------------------------------------------------------ compute
    def _forward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        model = self.model[chunk]
        inputs = self.inputs.get(key)
        prev = self._local_neighbour(chunk, -1)
        if prev is not None:  # the V's turn: the previous stage ran on this rank, no message
            inputs = self.inputs[key] = tuple(t.detach().requires_grad_(t.is_floating_point())
                                             for t in self.outputs[(mb, prev)])
        if inputs is None and not self._is_first(chunk):
            raise RuntimeError(f"F{mb}.{chunk} on stage {self.pipeline.stage}: no input was received")
        set_input(model, None if inputs is None else (inputs[0] if len(inputs) == 1 else inputs))

        grad_ctx = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with grad_ctx:
            output, loss_func = self.forward_step_func(self.data_iterators[chunk], model, **(
                {"vp_stage": chunk} if self.pass_vp_stage else {}))
            if self._is_last(chunk) and self.collect_non_loss_data:
                self.losses.append(loss_func(output, non_loss_data=True))
            elif self._is_last(chunk):
                output = self._loss(loss_func(output))
        outputs = _as_tuple(output)
        if self.forward_only:
            self.inputs.pop(key, None)
        else:
            self.stats.inflight += 1
            self.stats.peak_inflight = max(self.stats.peak_inflight, self.stats.inflight)
        self.outputs[key] = outputs
        self.output_specs[key] = TensorSpec.of(outputs)

    def _loss(self, result: Sequence[Any]) -> Any:
        """The loss to backpropagate, scaled as Megatron's forward_step scales it.

        ``(loss, num_tokens, dict)``: the loss is a sum over ``num_tokens`` tokens; it is divided by
        them and by the microbatch count, unless ``calculate_per_token_loss`` (then the gradients
        are divided by the tokens of the whole step in finalize_model_grads).
        ``(loss, dict)``: a mean over the microbatch; divided by the microbatch count.
        """
        M = self.schedule.num_microbatches
        if len(result) == 3:
            loss, num_tokens, reduced = result
            num_tokens = torch.as_tensor(num_tokens, device=self.device)
            self.num_tokens += num_tokens.detach().to(torch.int64)
            if not self.per_token:
                loss = loss / num_tokens.clamp(min=1) / M  # clamp: a microbatch without loss tokens adds 0, not NaN
        elif len(result) == 2:
            if self.per_token:
                raise ValueError("calculate_per_token_loss needs loss_func to return (loss, num_tokens, dict): "
                                 "the gradients are divided by the step's token count")
            loss, reduced = result
            loss = loss / M
        else:
            raise ValueError("loss_func must return (loss, dict) or (loss, num_tokens, dict)")
        self.losses.append(reduced)
        if not torch.is_tensor(loss):  # a plain number (forward-only evaluation), as Megatron accepts
            loss = torch.as_tensor(loss, dtype=torch.float32, device=self.device)
        return loss

    def _backward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        outputs = self.outputs.pop(key)
        inputs = self.inputs.pop(key, ())
        if self._is_last(chunk):
            loss = outputs[0]
            if self.grad_scale_func is not None:
                loss = self.grad_scale_func(loss)
            grads: Tensors = (torch.ones_like(loss),)
            outputs = (loss,)
        else:
            nxt = self._local_neighbour(chunk, +1)
            grads = self.output_grads.pop(key) if nxt is None else self.input_grads.pop((mb, nxt))
        defer = (wgrad_store.deferring(self.chunk_weights[chunk], self.deferred.setdefault(key, []))
                 if self.split_backward else contextlib.nullcontext())
        with self._sync_if(chunk, mb == self.last_backward[chunk]), defer:
            custom_backward(outputs, grads)
        if not self._is_first(chunk):
            self.input_grads[key] = tuple(x.grad for x in inputs)
        if not self.split_backward:
            self.stats.inflight -= 1

    def _sync_if(self, chunk: int, last: bool):
        """Gradients are only reduced across data-parallel replicas with a chunk's last B (the
        weights B finishes) and its last W (the weights whose GEMMs W ran)."""
        sync = getattr(self.model[chunk], "no_sync", None)
        return contextlib.nullcontext() if sync is None or last else sync()

    def _weight(self, mb: int, chunk: int) -> None:
        """W: the weight-gradient GEMMs that B{mb}.{chunk} deferred; its activations go with them."""
        with self._sync_if(chunk, mb == self.last_weight[chunk]):
            wgrad_store.run_deferred(self.deferred.pop((mb, chunk), []))
        self.stats.inflight -= 1

    # ------------------------------------------------------------------ communication
    def _communicate(self, batch: list[Action]) -> None:
        transfers: list[tuple[Action, Transfer]] = []
        for a in batch:
            peer = self.pipeline.ranks[a.peer]
            key = (a.microbatch, a.chunk)
            if a.kind == "SEND_F":
                transfers.append((a, Transfer("send", peer, tensors=tuple(t.detach() for t in self.outputs[key]),
                                              negotiate=self.variable)))
            elif a.kind == "SEND_B":
                transfers.append((a, Transfer("send", peer, tensors=self.input_grads.pop(key))))
            elif a.kind == "RECV_F":
                transfers.append((a, Transfer("recv", peer, spec=None if self.variable else self.recv_spec,
                                              requires_grad=not self.forward_only, negotiate=self.variable)))
            elif a.kind == "RECV_B":
                # The gradient of what we sent: we know its shapes, no negotiation needed.
                transfers.append((a, Transfer("recv", peer, spec=self.output_specs[key])))
        # A peer that never answers shows up here: name each transfer and its peer in the error.
        def what() -> str:
            return "pipeline transfer (" + ", ".join(
                f"{a.kind} {a.microbatch}.{a.chunk} {'from' if t.op == 'recv' else 'to'} rank {t.peer}"
                for a, t in transfers) + f") on stage {self.pipeline.stage}"

        with waiting_for(what, [t.peer for _, t in transfers]):
            exchange([t for _, t in transfers], self.pipeline.group, self.device)
        for a, t in transfers:
            key = (a.microbatch, a.chunk)
            if a.kind == "RECV_F":
                self.inputs[key] = t.tensors
            elif a.kind == "RECV_B":
                self.output_grads[key] = t.tensors
            elif a.kind == "SEND_F":
                if self.forward_only:
                    self.outputs.pop(key, None)
                elif self.deallocate:
                    for out in self.outputs[key]:
                        deallocate_output_tensor(out)

    # ------------------------------------------------------------------ main loop
    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _collect_times(self, origin, marks: list) -> None:
        """Times relative to the start of run(), which every stage enters together."""
        if not marks:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            elapsed = lambda e: origin.elapsed_time(e) / 1e3  # noqa: E731 - ms between events
        else:
            elapsed = lambda t: t - origin  # noqa: E731
        self.stats.action_times = [(name, elapsed(a), elapsed(b)) for name, a, b in marks]

    def run(self) -> list[Any]:
        marks = []
        origin = self._mark() if self.time_actions else None
        for step in self.schedule.steps(self.pipeline.stage):
            if isinstance(step, list):
                if self.forward_only:
                    # The forward-only chain is not lockstep (a rank's send and its next receive
                    # pair with different steps of its neighbours): one transfer at a time keeps
                    # shape negotiation (headers first, then data) free of cycles.
                    for action in step:
                        self._communicate([action])
                else:
                    self._communicate(step)
                continue
            start = self._mark() if self.time_actions else None
            if step.kind == "F":
                self._forward(step.microbatch, step.chunk)
            elif step.kind == "W":
                if not self.forward_only:
                    self._weight(step.microbatch, step.chunk)
            elif not self.forward_only:
                self._backward(step.microbatch, step.chunk)
            if self.time_actions:
                marks.append((str(step), start, self._mark()))
        self._collect_times(origin, marks)
        return self.losses if self._is_last(self.schedule.num_model_chunks - 1) else []


def _model_device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))
