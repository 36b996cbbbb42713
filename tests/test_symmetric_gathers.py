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
# interleaved with DP overlap, and TP=4 (the row-parallel reduce-scatter as an all-to-all, not an all-gather)
LAYOUTS = [
    ("gpt2", 2, 1, 1, True, []),
    ("gpt2", 2, 2, 1, True, ["--pipeline-schedule", "zb-h1", "--use-distributed-optimizer"]),
    ("llama", 2, 2, 2, True, ["--overlap-grad-reduce"]),
    ("gpt2", 4, 1, 1, True, []),
]


class ReusedBuffers:
    """SymmetricBuffers without NCCL: one tensor per (shape, dtype), reused by every gather of that shape."""

    def __init__(self):
        self.buffers, self.gets = {}, 0

    def get(self, shape, dtype, device, tag=""):
        self.gets += 1
        key = (tuple(shape), dtype, device, tag)
        if key not in self.buffers:
            self.buffers[key] = torch.full(shape, float("nan"), dtype=dtype, device=device)
        return self.buffers[key]

    def release(self):
        self.buffers.clear()


def _sweep(rank, world_size, refs):
    from parallel3d.tensor_parallel import linear_functions as lf

    done, calls = [], {}

    def counting(name, fn):
        def wrapped(*a, **k):
            result = fn(*a, **k)
            if name == "reduce_scatter_beside_gemm":  # forward's (untagged) or the input gradient's ("dgrad")
                name_ = f"{name}:{a[4] if len(a) > 4 else k.get('tag', '')}"
                calls[name_] = calls.get(name_, 0) + 1
            elif result[1] is not None:  # a gradient gather with its dgrad beside
                calls[name] = calls.get(name, 0) + 1
            return result
        return wrapped

    originals = {name: getattr(lf, "_" + name) for name in ("reduce_scatter_beside_gemm", "gather_output_grad")}
    for name, fn in originals.items():
        setattr(lf, "_" + name, counting(name, fn))
    try:
        for family, tp, pp, vp, sp, extra in LAYOUTS:
            args = layout_args(family, tp, pp, vp, sp, extra, world=world_size)
            state = ps.initialize_model_parallel(tp, pp, args.virtual_pipeline_model_parallel_size)
            state.tp_symmetric_buffers = buffers = ReusedBuffers()
            where = f"[{family} TP={tp} PP={pp} V={vp} SP={sp} {' '.join(extra)}]"
            calls.clear()
            try:
                result = train(args)
                assert buffers.gets > 0, f"{where}: no all-gather took a reused buffer"
                assert calls.get("reduce_scatter_beside_gemm:"), f"{where}: no row-parallel reduce-scatter beside its GEMM"
                assert calls.get("reduce_scatter_beside_gemm:dgrad"), \
                    f"{where}: no input-gradient reduce-scatter beside its GEMMs"
                if "zb-h1" not in extra:  # a deferred W reads the gathered gradient later: a tensor of its own
                    assert calls.get("gather_output_grad"), f"{where}: no gradient gather beside its dgrad"
                assert (tp > 2) == any(key[3].endswith("send") for key in buffers.buffers), \
                    f"{where}: the reduce-scatter's exchange is an all-to-all exactly above TP=2"
                assert_trains_like(result, refs[family], where)
            finally:
                ps.destroy_model_parallel()
            done.append(where)
    finally:
        for name, fn in originals.items():
            setattr(lf, "_" + name, fn)
    return done


def test_gathers_into_reused_buffers_train_like_a_single_process():
    refs = {}
    for family in ("gpt2", "llama"):
        result = train(layout_args(family))
        refs[family] = (result["losses"], result["grad_norms"], full_weights(result))
    results = run_distributed(_sweep, 4, args=(refs,), timeout=400)
    assert all(len(r) == len(LAYOUTS) for r in results)


def _gloo_choices(rank, world_size):
    """What initialize_model_parallel does with each tp_symmetric_gathers on gloo ranks ("default": none given)."""
    seen = {}
    for choice in ("default", None, False, True):
        try:
            state = ps.initialize_model_parallel(2, **({} if choice == "default" else {"tp_symmetric_gathers": choice}))
        except ValueError as e:
            assert not ps.model_parallel_is_initialized(), "a refused layout was left as the default"
            seen[choice] = ("refused", str(e))
            continue
        seen[choice] = (state.tp_symmetric_buffers, state.tp_symmetric_off_reason)
        ps.destroy_model_parallel()
    return seen


def test_symmetric_gathers_off_by_default_where_available_or_required():
    for seen in run_distributed(_gloo_choices, 2, timeout=60):
        # off unless asked: an embedding user's eager layers are faster with NCCL's own buffers
        assert seen["default"] == (None, "off") and seen[False] == (None, "off"), seen
        # where available: gloo ranks gather into their own buffers and say why
        assert seen[None][0] is None and "gloo" in seen[None][1], seen
        kind, message = seen[True]
        assert kind == "refused" and "tp_symmetric_gathers=True" in message and "gloo" in message, seen


def test_the_training_application_sets_the_copy_engine_policy_unless_the_user_did(monkeypatch):
    monkeypatch.delenv("NCCL_CTA_POLICY", raising=False)
    assert symmetric_memory.nccl_environment_defaults() == {"NCCL_CTA_POLICY": "2"}
    monkeypatch.setenv("NCCL_CTA_POLICY", "0")
    assert symmetric_memory.nccl_environment_defaults() == {}
    assert "symmetric kernels" in symmetric_memory.describe(ReusedBuffers(), None)


@pytest.mark.parametrize("extra, expected", [
    ([], None),  # TP + SP on NCCL: the layers replay as graphs, the gathers go into symmetric windows
    (["--no-tp-symmetric-gathers"], "--no-tp-symmetric-gathers"),
    (["--cuda-graph-impl", "none"], "eager layers"),  # NCCL's own buffers measured faster there
    (["--cuda-graph-impl", "none", "--no-tp-symmetric-gathers"], "--no-tp-symmetric-gathers; eager layers"),
])
def test_the_training_layout_takes_symmetric_gathers_only_with_graphs(extra, expected, monkeypatch):
    """The layout's decision, and the reason the training log gives where they are off: the one that applies."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the arguments of a GPU machine
    from parallel3d.training.arguments import parse_args, validate_args
    from parallel3d.training.training_config import TrainingConfig

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "1",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--distributed-backend", "nccl"]
    layout = TrainingConfig.from_args(validate_args(parse_args(argv + extra), 2)).layout
    off = layout.tp_symmetric_gathers_off
    assert layout.tp_symmetric_gathers is (off is None)
    assert off is None if expected is None else off.startswith(expected), off


def test_release_sees_a_window_still_viewed_elsewhere():
    """release() waits for, and names, a buffer that a view still holds: freed later, its window would be
    deregistered through a destroyed communicator."""
    from parallel3d.symmetric_memory import viewed_elsewhere

    buffers = {((4, 2), torch.float32, "cpu"): torch.zeros(4, 2), ((8,), torch.float32, "cpu"): torch.zeros(8)}
    assert viewed_elsewhere(buffers) == []
    shard = buffers[((4, 2), torch.float32, "cpu")][2:]
    assert viewed_elsewhere(buffers) == [(4, 2)]
    del shard
    assert viewed_elsewhere(buffers) == []


def test_windows_create_the_group_communicator_before_any_rendezvous(monkeypatch):
    """SymmetricBuffers issues a collective on its group when built, before any window is registered: NCCL
    creates a group's communicator lazily, at its first collective, and torch's rendezvous registers the
    window on whatever communicator the group has (a null one segfaulted the last pipeline stage, whose first
    TP collective was a gather into a window)."""
    import types

    events = []
    fake = types.SimpleNamespace(set_backend=lambda name: events.append(("set_backend", name)),
                                 get_backend=lambda device: "NCCL")
    monkeypatch.setitem(__import__("sys").modules, "torch.distributed._symmetric_memory", fake)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: ("tensor", k.get("device")))
    group = object()
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, group=None: events.append(("all_reduce", t[1], group)))
    symmetric_memory.SymmetricBuffers(group)
    assert ("all_reduce", torch.device("cuda", 0), group) in events, f"no collective on the group: {events}"
