"""Behaviours a script ported from Megatron-LM relies on (each test failed before its fix).

- a loss_func returning (loss, num_tokens, dict) is divided by num_tokens and the microbatch count,
  unless calculate_per_token_loss;
- linear_with_grad_accumulation_and_async_allreduce(group=None) reduces over the default TP group;
- a nested fork() of the same RNG stream continues it instead of replaying it;
- forward-only evaluation accepts a plain number as the loss;
- model_parallel_cuda_manual_seed seeds only the device's generators (tests/gpu checks CUDA's).
"""
import pytest
import torch
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d import tensor_parallel as tp
from parallel3d.pipeline import get_forward_backward_func
from parallel3d.testing import run_distributed

M, S, H = 3, 4, 8


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(S, H, generator=g), torch.randn(S, H, generator=g), (torch.rand(S, generator=g) < 0.7).float())
            for _ in range(M)]


def _grads(loss_func, per_token=False, forward_only=False):
    torch.manual_seed(0)
    model = nn.Linear(H, H)
    it = iter(_batches())

    def forward_step(data_iterator, model):
        x, target, mask = next(data_iterator)
        return model(x), lambda out: loss_func(out, target, mask)

    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=it, model=[model],
                                         num_microbatches=M, calculate_per_token_loss=per_token,
                                         forward_only=forward_only)
    return losses, None if forward_only else model.weight.grad.clone()


def _token_losses(out, target, mask):
    return ((out - target) ** 2).mean(-1) * mask


def test_loss_with_num_tokens_is_averaged_like_megatron():
    def mean(out, target, mask):
        loss = _token_losses(out, target, mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach()}

    def summed(out, target, mask):
        loss = _token_losses(out, target, mask).sum()
        return loss, mask.sum().to(torch.int64), {"lm loss": torch.stack([loss.detach(), mask.sum()])}

    _, want = _grads(mean)  # the mean over each microbatch's tokens, averaged over microbatches
    _, got = _grads(summed)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # calculate_per_token_loss leaves the sums as they are (finalize_model_grads divides by the step's tokens)
    _, got = _grads(summed, per_token=True)
    torch.manual_seed(0)
    model = nn.Linear(H, H)
    sum(_token_losses(model(x), t, m).sum() for x, t, m in _batches()).backward()
    torch.testing.assert_close(got, model.weight.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="calculate_per_token_loss needs loss_func to return"):
        _grads(mean, per_token=True)


def test_forward_only_accepts_a_plain_number_as_loss():
    losses, _ = _grads(lambda out, target, mask: (float(_token_losses(out, target, mask).mean()), {"n": 1.0}),
                       forward_only=True)
    assert losses == [{"n": 1.0}] * M


def _dgrad_with_default_group(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # TP=2 x DP=2
    try:
        torch.manual_seed(ps.get_tensor_model_parallel_rank())  # different shards on the two TP ranks
        w = torch.randn(3, H)
        x = torch.randn(S, H, requires_grad=True)
        grads = []
        for group in (None, ps.get_tensor_model_parallel_group()):
            x.grad = None
            out = tp.linear_with_grad_accumulation_and_async_allreduce(x, w, None, allreduce_dgrad=True, group=group)
            out.sum().backward()
            grads.append(x.grad.clone())
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    finally:
        ps.destroy_model_parallel()
    return True


def test_default_group_is_the_tensor_parallel_group():
    assert run_distributed(_dgrad_with_default_group, 4, timeout=120) == [True] * 4


def test_nested_fork_of_the_same_stream_continues_it():
    tracker = tp.get_cuda_rng_tracker()
    tp.model_parallel_cuda_manual_seed(3, tp_rank=0)
    with tracker.fork():
        straight = torch.rand(8), torch.rand(8)
    tp.model_parallel_cuda_manual_seed(3, tp_rank=0)
    with tracker.fork():
        outer = torch.rand(8)
        with tracker.fork():
            inner = torch.rand(8)
        after = torch.rand(8)
    assert torch.equal(outer, straight[0]) and torch.equal(inner, straight[1])
    assert not torch.equal(after, inner)
    default_before = torch.get_rng_state()
    with tracker.fork():
        with tracker.fork():
            torch.rand(8)
    assert torch.equal(torch.get_rng_state(), default_before), "the default stream must be left as it was"


def test_nested_fork_of_a_stream_open_further_out_continues_it():
    """fork A, inside it fork B, inside that fork A again: Megatron draws A0, B0, A1, B1, A2."""
    tracker = tp.get_cuda_rng_tracker()

    def fresh():
        tracker.reset()
        tracker.add("A", 11)
        tracker.add("B", 22)

    fresh()
    with tracker.fork("A"):
        a = [torch.rand(4) for _ in range(4)]
    with tracker.fork("B"):
        b = [torch.rand(4) for _ in range(2)]
    fresh()
    default_before = torch.get_rng_state()
    with tracker.fork("A"):
        a0 = torch.rand(4)
        with tracker.fork("B"):
            b0 = torch.rand(4)
            with tracker.fork("A"):
                a1 = torch.rand(4)
            b1 = torch.rand(4)
        a2 = torch.rand(4)
    for got, want, name in ((a0, a[0], "A0"), (b0, b[0], "B0"), (a1, a[1], "A1"), (b1, b[1], "B1"), (a2, a[2], "A2")):
        assert torch.equal(got, want), name
    assert torch.equal(torch.get_rng_state(), default_before), "the default stream must be left as it was"
    with tracker.fork("A"):  # and the stream goes on from where the nest left it
        assert torch.equal(torch.rand(4), a[3])


def test_checkpoint_takes_megatrons_argument_order():
    block = nn.Linear(H, H)
    x = torch.randn(S, H, requires_grad=True)
    torch.testing.assert_close(tp.checkpoint(block, False, x), block(x))
    with pytest.raises(TypeError, match="Megatron's argument order"):
        tp.checkpoint(block, x)
    with pytest.raises(ValueError, match="distribute_saved_activations=True is not supported"):
        tp.checkpoint(block, True, x)


def _megatron_label_smoothing(logits, target, alpha):
    """Megatron-Core's vocab_parallel_cross_entropy at TP = 1, written out from its source."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    k = logits.size(-1)
    smoothing = alpha * k / (k - 1)
    return (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)


def test_label_smoothing_is_megatron_cores(monkeypatch):
    torch.manual_seed(0)
    logits, target = torch.randn(5, 2, 11) * 3, torch.randint(0, 11, (5, 2))
    try:  # megatron-core's own function at TP = 1 where installed (its collectives over one rank: no-ops)
        import megatron.core.tensor_parallel.cross_entropy as mcore_ce
        for name, value in (("get_tensor_model_parallel_group", lambda: None),
                            ("get_tensor_model_parallel_rank", lambda: 0),
                            ("get_tensor_model_parallel_world_size", lambda: 1)):
            monkeypatch.setattr(mcore_ce, name, value)
        monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)
    except ImportError:
        mcore_ce = None
    for alpha in (0.0, 0.1, 0.5):
        ours = logits.clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(ours, target, alpha)
        torch.testing.assert_close(loss, _megatron_label_smoothing(logits, target, alpha).float())
        if mcore_ce is not None:
            theirs = logits.clone().requires_grad_()
            want = mcore_ce.vocab_parallel_cross_entropy(theirs, target, alpha)
            torch.testing.assert_close(loss, want)
            w = torch.rand(5, 2)
            (loss * w).sum().backward()
            (want * w).sum().backward()
            torch.testing.assert_close(ours.grad, theirs.grad)
