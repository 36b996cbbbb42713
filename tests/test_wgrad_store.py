"""The B/W split inside the TP linear layers: deferral, recompute, DDP bucket readiness."""
import pytest
import torch
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d import tensor_parallel as tp
from parallel3d.distributed import DistributedDataParallel, DistributedDataParallelConfig
from parallel3d.tensor_parallel import wgrad_store
from parallel3d.testing import run_distributed


class Mlp(nn.Module):
    def __init__(self, recompute: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = tp.ColumnParallelLinear(6, 12)
        self.fc2 = tp.RowParallelLinear(12, 6)
        self.recompute = recompute

    def block(self, x):
        return self.fc2(torch.tanh(self.fc1(x)[0]))[0]

    def forward(self, x):
        return x + (tp.checkpoint(self.block, False, x) if self.recompute else self.block(x))


def _grads(model, x, deferred=None):
    x = x.detach().requires_grad_()
    if deferred is None:
        (model(x) ** 2).sum().backward()
    else:
        with wgrad_store.deferring(model.parameters(), deferred):
            (model(x) ** 2).sum().backward()
    return x.grad, {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_b_defers_weight_gemms_and_w_runs_them():
    for recompute in (False, True):
        x = torch.randn(4, 3, 6)
        ref_x, ref = _grads(Mlp(recompute), x)
        model, deferred = Mlp(recompute), []
        got_x, after_b = _grads(model, x, deferred)
        torch.testing.assert_close(got_x, ref_x)  # B: the input gradient, complete
        assert after_b["fc1.weight"] is None and after_b["fc2.weight"] is None, "weight GEMMs ran in B"
        torch.testing.assert_close(after_b["fc1.bias"], ref["fc1.bias"])  # biases stay in B
        assert len(deferred) == 2
        assert not any(hasattr(p, "defer_wgrad_into") for p in model.parameters()), "B left its mark"
        wgrad_store.run_deferred(deferred)  # W
        assert deferred == [] and model.fc1.weight.wgrad_pending == 0
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], msg=f"recompute={recompute} {name}")


def test_only_the_named_weights_defer_even_from_another_thread():
    """A B defers the GEMMs of the weights it names, wherever autograd runs the backward (CUDA runs it
    on device threads): another model's backward, running meanwhile, computes its weight gradients."""
    import threading

    x = torch.randn(4, 3, 6)
    ref_x, ref = _grads(Mlp(), x)
    deferring_model, other, deferred = Mlp(), Mlp(), []
    entered, done = threading.Event(), threading.Event()
    other_grads = {}

    def other_backward():  # a backward outside the B, while the B's deferral is open
        entered.wait(timeout=30)
        other_grads.update(_grads(other, x)[1])
        done.set()

    thread = threading.Thread(target=other_backward)
    thread.start()
    with wgrad_store.deferring(deferring_model.parameters(), deferred):
        entered.set()
        assert done.wait(timeout=30), "the other backward did not finish"
        # The B itself, on a thread that did not enter the context (as autograd's device threads).
        runner = threading.Thread(target=lambda: (deferring_model(x) ** 2).sum().backward())
        runner.start()
        runner.join(timeout=30)
    thread.join(timeout=30)
    for name in ("fc1.weight", "fc2.weight"):
        torch.testing.assert_close(other_grads[name], ref[name], msg=f"the other model's {name} was deferred")
        assert getattr(deferring_model, name.split(".")[0]).weight.grad is None
    assert [w for w, _ in deferred] == [deferring_model.fc2.weight, deferring_model.fc1.weight]
    wgrad_store.run_deferred(deferred)
    for name, p in deferring_model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], msg=name)


def test_nested_deferral_of_one_weight_is_refused():
    model = Mlp()
    with wgrad_store.deferring(model.parameters(), []):
        with pytest.raises(RuntimeError, match="cannot nest"):
            with wgrad_store.deferring([model.fc1.weight], []):
                pass
        assert model.fc2.weight.defer_wgrad_into == []  # the refusal left the outer marks alone
    assert not any(hasattr(p, "defer_wgrad_into") for p in model.parameters())


def _ddp_bucket_waits_for_w(rank, world_size):
    ps.initialize_model_parallel()  # DP = 2 of a TP = 1 model
    try:
        return [_bucket_waits_for_w(rank, fusion) for fusion in (False, True)]
    finally:
        ps.destroy_model_parallel()


def _bucket_waits_for_w(rank, fusion):
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=None)
    model = Mlp()
    for layer in (model.fc1, model.fc2):
        layer.gradient_accumulation_fusion = fusion
    ddp = DistributedDataParallel(model, ddp_config)
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(rank))
    deferred = []
    with wgrad_store.deferring(ddp.parameters(), deferred):
        (ddp(x) ** 2).sum().backward()
    assert not any(b.launched for b in ddp.buckets), "a bucket was reduced before its W"
    wgrad_store.run_deferred(deferred)
    assert all(b.launched for b in ddp.buckets), "W made every weight ready: the bucket must launch"
    ddp.finish_grad_sync()
    # Against the same step without the split.
    ref = Mlp()
    ref_ddp = DistributedDataParallel(ref, ddp_config)
    (ref_ddp(x) ** 2).sum().backward()
    ref_ddp.finish_grad_sync()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.main_grad, msg=f"fusion={fusion} {name}")
    return fusion


def test_ddp_bucket_is_ready_only_after_w():
    assert run_distributed(_ddp_bucket_waits_for_w, 2, timeout=120) == [[False, True]] * 2
