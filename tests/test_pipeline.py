"""The pipeline executor against a single-process model (fp32, ~1e-5).

One launch of 4 processes sweeps PP in {1, 2, 4}, V in {1, 2}, M in {1, 2, 3, 4, 8}
and every schedule that exists for the combination; each rank's chunks must
produce the reference's losses and the reference's gradients for the layers it
holds. Another launch of 8 mixes PP with TP=2 and DP=2.
"""
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d import tensor_parallel as tp
from parallel3d.pipeline import ScheduleError, build_schedule, get_forward_backward_func
from parallel3d.pipeline.registry import V_SHAPED
from parallel3d.pipeline.schedules import virtual_stage
from parallel3d.pipeline.forward_backward import forward_backward
from parallel3d.testing import run_distributed, single_process_layout

NUM_LAYERS, HIDDEN, SEQ, MBS = 8, 8, 4, 2
ATOL = 1e-5


class Block(nn.Module):
    """Residual MLP block from the TP layers: x + Row(tanh(Column(x)))."""

    def __init__(self, layer: int):
        super().__init__()
        torch.manual_seed(1000 + layer)  # layout-independent init: the seed is the global layer index
        self.fc1 = tp.ColumnParallelLinear(HIDDEN, 2 * HIDDEN, init_method=tp.init_method_normal(0.5))
        self.fc2 = tp.RowParallelLinear(2 * HIDDEN, HIDDEN, init_method=tp.init_method_normal(0.5))

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)[0]))[0]


class Chunk(nn.Module):
    """The layers of one virtual stage; takes its input from the pipeline unless first."""

    def __init__(self, layers: range, first: bool, last: bool):
        super().__init__()
        self.layers = nn.ModuleList(Block(i) for i in layers)
        self.layer_ids = list(layers)
        self.first, self.last = first, last
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = x if self.first else self.input_tensor
        for layer in self.layers:
            h = layer(h)
        return h


def make_batches(num_microbatches, seq=SEQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in range(num_microbatches):
        s = seq(m) if callable(seq) else seq
        out.append((torch.randn(s, MBS, HIDDEN, generator=g), torch.randn(s, MBS, HIDDEN, generator=g)))
    return out


def assert_close(got, want, what):
    """Within 1e-5, relative for values above 1 (fp32 sums taken in another order)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= ATOL * scale, f"{what}: off by {err:.3g} (scale {scale:.3g})"


def loss_of(output, target):
    return ((output - target) ** 2).mean()


def forward_step(data_iterator, model):
    x, target = next(data_iterator)
    out = model(x)
    return out, (lambda output: (loss_of(output, target), {"loss": loss_of(output, target).detach()}))


def reference(batches):
    full = Chunk(range(NUM_LAYERS), True, True)
    losses = []
    for x, target in batches:
        loss = loss_of(full(x), target) / len(batches)
        loss.backward()
        losses.append(loss.detach() * len(batches))
    grads = {}
    for i, layer in zip(full.layer_ids, full.layers):
        for name, p in layer.named_parameters():
            grads[(i, name)] = p.grad
    return losses, grads


def build_chunks(pp_rank, P, V, placement="loop"):
    per = NUM_LAYERS // (P * V)
    chunks = []
    for c in range(V):
        v = virtual_stage(pp_rank, c, P, placement)
        chunks.append(Chunk(range(v * per, (v + 1) * per), v == 0, v == P * V - 1))
    return chunks


def check_layout(P, V, M, schedule, batches, ref):
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    placement = "v" if schedule in V_SHAPED else "loop"
    chunks = build_chunks(pp_rank, P, V, placement)
    ref_losses, ref_grads = ref
    losses = forward_backward(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=M, schedule=schedule, tensor_shape=(SEQ, MBS, HIDDEN),
        deallocate_pipeline_outputs=True,  # a Block's output is a residual add: nothing saves it
    )
    where = f"P={P} V={V} M={M} {schedule} pp_rank={pp_rank}"
    if virtual_stage(pp_rank, V - 1, P, placement) == P * V - 1:  # this rank computes the loss
        assert len(losses) == M, where
        for got, want in zip(losses, ref_losses):
            assert_close(got["loss"], want, f"{where}: loss")
    else:
        assert losses == [], where
    for chunk in chunks:
        for i, layer in zip(chunk.layer_ids, chunk.layers):
            for name, p in layer.named_parameters():
                want = ref_grads[(i, name)]
                if getattr(p, "tensor_model_parallel", False):
                    want = want.chunk(tp_size, dim=p.partition_dim)[tp_rank]
                assert_close(p.grad, want, f"{where}: grad of layer {i} {name}")


def schedules_for(P, V, M):
    if P == 1:
        return ["no-pipelining"] if V == 1 else []
    if V == 1:
        return ["gpipe", "1f1b", "zb-h1", "zb-h2"]
    return (["interleaved-1f1b"] if M >= P else []) + ["zb-v"] + (["dualpipev"] if M >= 2 * P else [])


def _sweep(rank, world_size):
    refs = {M: None for M in (1, 2, 3, 4, 8)}
    with single_process_layout():
        for M in refs:
            torch.manual_seed(0)
            refs[M] = reference(make_batches(M))
    count = 0
    for P, V in itertools.product((1, 2, 4), (1, 2)):
        if P == 1 and V == 2:
            continue  # virtual stages need PP > 1
        ps.initialize_model_parallel(pipeline_model_parallel_size=P,
                                     virtual_pipeline_model_parallel_size=V if V > 1 else None)
        try:
            for M in refs:
                for schedule in schedules_for(P, V, M):
                    check_layout(P, V, M, schedule, make_batches(M), refs[M])
                    count += 1
        finally:
            ps.destroy_model_parallel()
    return count


def test_every_schedule_matches_single_process():
    counts = run_distributed(_sweep, 4, timeout=300)
    # P=1: 5 M values; P=2: 4 schedules x 5 + interleaved for M>=2 (4) + zb-v x 5 + dualpipev M in {4, 8};
    # P=4: 20 + interleaved M in {4, 8} + zb-v x 5 + dualpipev M=8
    assert counts == [5 + 31 + 28] * 4


def _mixed_tp_dp(rank, world_size):
    refs = {}
    with single_process_layout():
        for M in (2, 4):
            torch.manual_seed(0)
            refs[M] = reference(make_batches(M))
    done = 0
    for order, V in itertools.product(("tp-dp-pp", "tp-pp-dp"), (1, 2)):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                     virtual_pipeline_model_parallel_size=V if V > 1 else None, order=order)
        try:
            for M in (2, 4):
                check_layout(2, V, M, "1f1b" if V == 1 else "interleaved-1f1b", make_batches(M), refs[M])
                done += 1
        finally:
            ps.destroy_model_parallel()
    return done


def test_pipeline_with_tp2_dp2_on_8_processes():
    assert run_distributed(_mixed_tp_dp, 8, timeout=300) == [8] * 8


# ---------------------------------------------------------------- variable shapes, tuples, forward-only, memory


class TupleChunk(Chunk):
    """Passes (hidden, running sum of squares) between stages: a tuple message."""

    def forward(self, x):
        if self.first:
            h, acc = x, torch.zeros(x.shape[1])
        else:
            h, acc = self.input_tensor
        for layer in self.layers:
            h = layer(h)
            acc = acc + (h ** 2).mean(dim=(0, 2))
        return (h, acc) if not self.last else h + acc.view(1, -1, 1)


def _tuple_forward_step(data_iterator, model):
    x, target = next(data_iterator)
    out = model(x)
    return out, (lambda output: (loss_of(output, target), {"loss": loss_of(output, target).detach()}))


def _variable_and_tuple(rank, world_size):
    seq_of = lambda m: 2 + m % 3  # noqa: E731 - microbatches of lengths 2, 3, 4, 2, ...
    M = 5
    ref = []
    with single_process_layout():
        full = TupleChunk(range(NUM_LAYERS), True, True)
        for x, target in make_batches(M, seq_of):
            loss = loss_of(full(x), target) / M
            loss.backward()
            ref.append(loss.item() * M)
    ref_grads = {(i, n): p.grad for i, l in zip(full.layer_ids, full.layers) for n, p in l.named_parameters()}
    results = []
    for P, V, schedule in ((4, 1, None), (2, 2, None), (4, 2, None), (4, 1, "zb-h1"), (2, 2, "zb-v"),
                           (2, 2, "dualpipev")):  # zb-h1 runs with its receives hoisted over W
        ps.initialize_model_parallel(pipeline_model_parallel_size=P, virtual_pipeline_model_parallel_size=V
                                     if V > 1 else None)
        try:
            pp_rank = ps.get_pipeline_model_parallel_rank()
            per, placement = NUM_LAYERS // (P * V), "v" if schedule in V_SHAPED else "loop"
            stages = [virtual_stage(pp_rank, c, P, placement) for c in range(V)]
            chunks = [TupleChunk(range(v * per, (v + 1) * per), v == 0, v == P * V - 1) for v in stages]
            losses = forward_backward(forward_step_func=_tuple_forward_step,
                                      data_iterator=[iter(make_batches(M, seq_of)) for _ in chunks],
                                      model=chunks, num_microbatches=M, variable_seq_lengths=True, schedule=schedule)
            holds_loss = stages[-1] == P * V - 1
            if holds_loss:
                assert_close([d["loss"].item() for d in losses], ref, f"P={P} V={V} losses")
            for chunk in chunks:
                for i, layer in zip(chunk.layer_ids, chunk.layers):
                    for n, p in layer.named_parameters():
                        assert_close(p.grad, ref_grads[(i, n)], f"P={P} V={V} grad of layer {i} {n}")
            # forward-only (evaluation): same losses, no gradients touched
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            for m in (M, 1):  # forward-only takes any microbatch count, even fewer than P
                evals = forward_backward(forward_step_func=_tuple_forward_step,
                                         data_iterator=[iter(make_batches(M, seq_of)) for _ in chunks],
                                         model=chunks, num_microbatches=m, variable_seq_lengths=True,
                                         forward_only=True, schedule=schedule)
                if holds_loss:
                    assert_close([d["loss"].item() for d in evals], ref[:m], f"forward-only P={P} V={V} M={m}")
            assert all(p.grad is None for c in chunks for p in c.parameters()), "forward-only made gradients"
            results.append((P, V))
        finally:
            ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:  # an order that cannot negotiate shapes says so before any transfer
        with pytest.raises(ValueError, match="cannot negotiate variable sequence lengths"):
            forward_backward(forward_step_func=_tuple_forward_step, data_iterator=iter([]), model=[TupleChunk(
                range(0), True, False)], num_microbatches=4, variable_seq_lengths=True, schedule="zb-h2")
    finally:
        ps.destroy_model_parallel()
    return results


def test_variable_seq_lengths_tuples_and_forward_only():
    want = [(4, 1), (2, 2), (4, 2), (4, 1), (2, 2), (2, 2)]  # the last three: zb-h1, zb-v, dualpipev
    assert run_distributed(_variable_and_tuple, 4, timeout=120) == [want] * 4


class _SavedCounter:
    """Counts tensors held by autograd for backward (saved activations), and the peak."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def pack(self, t):
        self.live += 1
        self.peak = max(self.peak, self.live)
        return _Held(t, self)

    @staticmethod
    def unpack(held):
        return held.t


class _Held:
    def __init__(self, t, counter):
        self.t, self.counter = t, counter

    def __del__(self):
        self.counter.live -= 1


def _activation_memory(rank, world_size):
    P, M = 4, 8
    ps.initialize_model_parallel(pipeline_model_parallel_size=P)
    out = {}
    try:
        for schedule in ("gpipe", "1f1b"):
            chunks = build_chunks(ps.get_pipeline_model_parallel_rank(), P, 1)
            per_microbatch = None
            counter = _SavedCounter()
            # saved tensors of one microbatch's forward on this stage
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                x = torch.randn(SEQ, MBS, HIDDEN, requires_grad=True)
                chunks[0].set_input_tensor(x)
                y = chunks[0](x)
            per_microbatch = counter.peak
            del y, x
            counter = _SavedCounter()
            stats = []
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                forward_backward(forward_step_func=forward_step, data_iterator=iter(make_batches(M)),
                                 model=chunks, num_microbatches=M, schedule=schedule,
                                 tensor_shape=(SEQ, MBS, HIDDEN), stats=stats, deallocate_pipeline_outputs=True)
            assert counter.live == 0, f"{schedule}: {counter.live} saved tensors outlived their backward"
            out[schedule] = (counter.peak / per_microbatch, stats[0].peak_inflight)
    finally:
        ps.destroy_model_parallel()
    return out


def test_1f1b_activation_memory_is_bounded_by_stages():
    P, M = 4, 8
    results = run_distributed(_activation_memory, 4, timeout=120)
    for pp_rank, res in enumerate(results):
        # Saved tensors, in units of one microbatch's forward through the stage (the last
        # stage's loss adds a fraction of one): GPipe keeps all M, 1F1B at most P - rank.
        (gpipe_mem, gpipe_inflight), (f1b_mem, f1b_inflight) = res["gpipe"], res["1f1b"]
        bound = min(P - pp_rank, M)
        assert gpipe_inflight == M and M <= gpipe_mem < M + 1, (pp_rank, res)
        assert f1b_inflight == bound and bound <= f1b_mem < bound + 1, (pp_rank, res)


# ---------------------------------------------------------------- single process and bad configurations


def test_world_size_one_needs_no_communication():
    torch.manual_seed(0)
    batches = make_batches(3)
    ref_losses, ref_grads = reference(batches)
    chunks = build_chunks(0, 1, 1)
    func = get_forward_backward_func()  # no process group at all: PP=1
    losses = func(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks, num_microbatches=3)
    assert_close([d["loss"].item() for d in losses], [x.item() for x in ref_losses], "losses")
    for i, layer in zip(chunks[0].layer_ids, chunks[0].layers):
        for n, p in layer.named_parameters():
            assert_close(p.grad, ref_grads[(i, n)], f"grad of layer {i} {n}")


def _bad_configs(rank, world_size):
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    chunks = build_chunks(ps.get_pipeline_model_parallel_rank(), 2, 2)
    errors = []
    for kwargs in (
        dict(num_microbatches=1),  # interleaved needs M >= P
        dict(num_microbatches=4, model=chunks[:1]),  # wrong chunk count for V=2
        dict(num_microbatches=4, seq_length=None),  # no shapes to receive with
        dict(num_microbatches=4, schedule="no-pipelining"),
    ):
        args = dict(forward_step_func=forward_step, data_iterator=iter(make_batches(4)), model=chunks)
        args.update(kwargs)
        try:
            forward_backward(**args)
        except (ValueError, ScheduleError) as e:
            errors.append(str(e))
        else:
            errors.append(None)
    ps.destroy_model_parallel()
    return errors


def test_wrong_configuration_fails_fast_with_a_message():
    errors = run_distributed(_bad_configs, 2, timeout=60)[0]
    assert errors[0] is not None and "num_microbatches >= num_stages" in errors[0], errors[0]
    assert errors[1] is not None and "virtual_pipeline_model_parallel_size is 2 but the model has 1" in errors[1]
    assert errors[2] is not None and "tensor_shape" in errors[2], errors[2]
    assert errors[3] is not None and "num_stages must be 1" in errors[3], errors[3]


def test_get_forward_backward_func_picks_the_schedule():
    from parallel3d.pipeline.forward_backward import default_schedule_name

    assert default_schedule_name(1, None) == "no-pipelining"
    assert default_schedule_name(4, None) == "1f1b"
    assert default_schedule_name(4, 2) == "interleaved-1f1b"
    assert str(build_schedule("1f1b", 2, 2)).startswith("1f1b: 2 stages")
