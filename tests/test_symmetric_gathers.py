"""The sequence-parallel all-gathers into reused buffers (parallel3d/symmetric_memory.py) train like one process.

On GPUs the buffers are NCCL symmetric windows; here a stand-in hands out the same kind of thing, one
persistent tensor per shape that every later gather of that shape overwrites, so a caller that kept a
gathered tensor too long (a zero-bubble W reading its input after later layers gathered theirs) would
train differently from one process. The refusal where windows cannot serve (gloo) is checked too.
"""
import pytest
import torch

from gpt_harness import assert_trains_like, full_weights, layout_args, train
from parallel3d import parallel_state as ps
from parallel3d import symmetric_memory
from parallel3d.testing import run_distributed

# (family, TP, PP, V, SP, extra flags) on 4 ranks: TP+SP alone, with a deferred W (ZB-H1) and ZeRO-1,
# interleaved with DP overlap
LAYOUTS = [
    ("gpt2", 2, 1, 1, True, []),
    ("gpt2", 2, 2, 1, True, ["--pipeline-schedule", "zb-h1", "--use-distributed-optimizer"]),
    ("llama", 2, 2, 2, True, ["--overlap-grad-reduce"]),
]


class ReusedBuffers:
    """SymmetricBuffers without NCCL: one tensor per (shape, dtype), reused by every gather of that shape."""

    def __init__(self):
        self.buffers, self.gets = {}, 0

    def get(self, shape, dtype, device):
        self.gets += 1
        key = (tuple(shape), dtype, device)
        if key not in self.buffers:
            self.buffers[key] = torch.full(shape, float("nan"), dtype=dtype, device=device)
        return self.buffers[key]

    def release(self):
        self.buffers.clear()


def _sweep(rank, world_size, refs):
    done = []
    for family, tp, pp, vp, sp, extra in LAYOUTS:
        args = layout_args(family, tp, pp, vp, sp, extra, world=world_size)
        state = ps.initialize_model_parallel(tp, pp, args.virtual_pipeline_model_parallel_size)
        state.tp_symmetric_buffers = buffers = ReusedBuffers()
        where = f"[{family} TP={tp} PP={pp} V={vp} SP={sp} {' '.join(extra)}]"
        try:
            result = train(args)
            assert buffers.gets > 0, f"{where}: no all-gather took a reused buffer"
            assert_trains_like(result, refs[family], where)
        finally:
            ps.destroy_model_parallel()
        done.append(where)
    return done


def test_gathers_into_reused_buffers_train_like_a_single_process():
    refs = {}
    for family in ("gpt2", "llama"):
        result = train(layout_args(family))
        refs[family] = (result["losses"], result["grad_norms"], full_weights(result))
    results = run_distributed(_sweep, 4, args=(refs,), timeout=400)
    assert all(len(r) == len(LAYOUTS) for r in results)


def _refused_on_gloo(rank, world_size):
    try:
        ps.initialize_model_parallel(2)
    except ValueError as e:
        assert not ps.model_parallel_is_initialized(), "a refused layout was left as the default"
        return str(e)
    ps.destroy_model_parallel()
    return None


def test_asking_for_symmetric_gathers_on_gloo_is_refused_by_name():
    messages = run_distributed(_refused_on_gloo, 2, timeout=60, env={symmetric_memory.ENV: "1"})
    for message in messages:
        assert message is not None and symmetric_memory.ENV in message and "gloo" in message, message


@pytest.mark.parametrize("value", ["0", ""])
def test_symmetric_gathers_are_off_unless_asked(value, monkeypatch):
    monkeypatch.setenv(symmetric_memory.ENV, value)
    assert not symmetric_memory.requested()
    monkeypatch.setenv(symmetric_memory.ENV, "1")
    assert symmetric_memory.requested()
