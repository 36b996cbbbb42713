"""forward_backward reads what Megatron-Core's schedules read from ``model.config``.

A script ported from Megatron sets ``calculate_per_token_loss``, ``finalize_model_grads_func``,
``grad_scale_func``, ``variable_seq_lengths``, ``pipeline_dtype`` and ``deallocate_pipeline_outputs``
on the model's config and calls ``get_forward_backward_func()(...)`` without keywords; a config
missing a field gets Megatron's default. Each case is compared with the same model in one process.
"""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from parallel3d.pipeline import get_forward_backward_func
from parallel3d.testing import run_distributed

H, S, MBS, M = 4, 3, 2, 3


class Layer(nn.Linear):
    def __init__(self, seed, config=None):
        torch.manual_seed(seed)
        super().__init__(H, H)
        self.config = config

    def forward(self, x):
        return x + torch.tanh(super().forward(x))


class Stage(nn.Module):
    """One pipeline stage of a two-layer model; ``cast``: the dtype its output leaves in."""

    def __init__(self, stage, config, cast=None):
        super().__init__()
        self.layer, self.config, self.stage, self.cast = Layer(stage), config, stage, cast
        self.input_tensor, self.sent = None, []

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = self.layer((x if self.stage == 0 else self.input_tensor).float())
        if self.stage == 0:
            h = h.to(self.cast) if self.cast is not None else h
            self.sent.append(h)
        return h


def batches(seq_lengths=(S,) * M, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, MBS, H, generator=g), torch.randn(s, MBS, H, generator=g)) for s in seq_lengths]


def mse_step(data_iterator, model):
    x, target = next(data_iterator)

    def loss_func(out, non_loss_data=False):
        if non_loss_data:
            return {"mean": out.detach().mean()}
        loss = ((out - target) ** 2).mean()
        return loss, {"loss": loss.detach()}
    return model(x), loss_func


def reference(data, cast=None, scale=1.0):
    """Losses and each layer's gradient of the two-layer model in one process."""
    layers = [Layer(0), Layer(1)]
    losses = []
    for x, target in data:
        h = layers[0](x)
        h = h.to(cast).float() if cast is not None else h
        loss = ((layers[1](h) - target) ** 2).mean()
        (loss * scale / len(data)).backward()
        losses.append(loss.detach())
    return losses, [layer.weight.grad for layer in layers]


def _pipeline_case(config, data, cast=None, scale=1.0, **kwargs):
    stage = ps.get_pipeline_model_parallel_rank()
    chunk = Stage(stage, config, cast)
    losses = get_forward_backward_func()(forward_step_func=mse_step, data_iterator=iter(data), model=[chunk],
                                         num_microbatches=len(data), seq_length=S, micro_batch_size=MBS, **kwargs)
    want_losses, want_grads = reference(data, cast, scale)
    torch.testing.assert_close(chunk.layer.weight.grad, want_grads[stage], rtol=1e-5, atol=1e-6)
    if stage == 1:
        torch.testing.assert_close(torch.stack([d["loss"] for d in losses]), torch.stack(want_losses))
    return chunk


def _pp2_worker(rank, world_size, case):
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        if case == "missing_fields":  # only hidden_size: every other field takes Megatron's default
            _pipeline_case(SimpleNamespace(hidden_size=H), batches())
        elif case == "variable_seq_lengths":
            _pipeline_case(SimpleNamespace(hidden_size=H, variable_seq_lengths=True), batches((3, 5, 2)))
        elif case == "pipeline_dtype":  # stages send float64 although the parameters are float32
            config = SimpleNamespace(hidden_size=H, params_dtype=torch.float32, pipeline_dtype=torch.float64)
            _pipeline_case(config, batches(), cast=torch.float64)
        elif case == "deallocate_pipeline_outputs":
            chunk = _pipeline_case(SimpleNamespace(hidden_size=H, deallocate_pipeline_outputs=True), batches())
            if rank == 0:  # what stage 0 sent was freed (its autograd graph stayed: the gradients matched)
                assert [t.numel() for t in chunk.sent] == [1] * M
        elif case == "grad_scale_func":
            _pipeline_case(SimpleNamespace(hidden_size=H, grad_scale_func=lambda loss: 4.0 * loss), batches(),
                           scale=4.0)
        elif case == "finalize_model_grads_func":
            calls = []
            config = SimpleNamespace(hidden_size=H, calculate_per_token_loss=True,
                                     finalize_model_grads_func=lambda *a, **k: calls.append((a, k)))
            chunk = Stage(rank, config)

            def token_step(data_iterator, model):
                x, target = next(data_iterator)
                return model(x), lambda out: (((out - target) ** 2).sum(), torch.tensor(7), {})
            get_forward_backward_func()(forward_step_func=token_step, data_iterator=iter(batches()), model=[chunk],
                                        num_microbatches=M, seq_length=S, micro_batch_size=MBS)
            (models, num_tokens), kwargs = calls[0]
            assert len(calls) == 1 and models == [chunk] and kwargs == {}
            assert int(num_tokens) == (7 * M if rank == 1 else 0)  # Megatron: the last stage counts the tokens
            calls.clear()
            get_forward_backward_func()(forward_step_func=token_step, data_iterator=iter(batches()), model=[chunk],
                                        num_microbatches=M, seq_length=S, micro_batch_size=MBS, forward_only=True)
            assert calls == []
        elif case == "collect_non_loss_data":
            data = batches()
            chunk = Stage(rank, SimpleNamespace(hidden_size=H))
            got = get_forward_backward_func()(forward_step_func=mse_step, data_iterator=iter(data), model=[chunk],
                                              num_microbatches=M, seq_length=S, micro_batch_size=MBS,
                                              forward_only=True, collect_non_loss_data=True)
            if rank == 1:
                layers = [Layer(0), Layer(1)]
                with torch.no_grad():
                    want = [layers[1](layers[0](x)).mean() for x, _ in data]
                torch.testing.assert_close(torch.stack([d["mean"] for d in got]), torch.stack(want))
            with pytest.raises(ValueError, match="collect_non_loss_data=True needs forward_only=True"):
                get_forward_backward_func()(forward_step_func=mse_step, data_iterator=iter(data), model=[chunk],
                                            num_microbatches=M, seq_length=S, micro_batch_size=MBS,
                                            collect_non_loss_data=True)
    finally:
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("case", ["missing_fields", "variable_seq_lengths", "pipeline_dtype",
                                  "deallocate_pipeline_outputs", "grad_scale_func", "finalize_model_grads_func",
                                  "collect_non_loss_data"])
def test_pipeline_reads_model_config(case):
    assert run_distributed(_pp2_worker, 2, args=(case,), timeout=60) == [True, True]


def _token_batches(rank):
    """Rank ``rank``'s microbatches: inputs, targets and loss masks with a different token count each."""
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(S, H, generator=g), torch.randn(S, H, generator=g),
             (torch.arange(S) <= (rank + m) % S).float()) for m in range(M)]


def _token_step(data_iterator, model):
    x, target, mask = next(data_iterator)

    def loss_func(out):
        loss = (((out - target) ** 2).mean(-1) * mask).sum()
        return loss, mask.sum().to(torch.int64), {"loss": loss.detach()}
    return model(x), loss_func


def _per_token_dp2_worker(rank, world_size):
    ps.initialize_model_parallel()  # DP=2
    try:
        config = SimpleNamespace(calculate_per_token_loss=True, finalize_model_grads_func=finalize_model_grads)
        layer = Layer(0, config)
        model = DistributedDataParallel(layer, DistributedDataParallelConfig())
        model.zero_grad_buffer()
        get_forward_backward_func()(forward_step_func=_token_step, data_iterator=iter(_token_batches(rank)),
                                    model=[model], num_microbatches=M, seq_length=S, micro_batch_size=1)
        # one process: the sum of every token's loss over both ranks, divided by all their tokens
        ref = Layer(0)
        data = _token_batches(0) + _token_batches(1)
        total = sum((((ref(x) - t) ** 2).mean(-1) * mask).sum() for x, t, mask in data)
        (total / sum(mask.sum() for _, _, mask in data)).backward()
        torch.testing.assert_close(layer.weight.main_grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    finally:
        ps.destroy_model_parallel()
    return True


def test_calculate_per_token_loss_from_model_config_at_dp2():
    assert run_distributed(_per_token_dp2_worker, 2, timeout=60) == [True, True]


def test_per_token_setting_that_disagrees_with_ddp_is_refused():
    layer = Layer(0, SimpleNamespace(calculate_per_token_loss=True))
    model = DistributedDataParallel(layer, DistributedDataParallelConfig())
    with pytest.raises(ValueError, match="calculate_per_token_loss=False but model chunk 0 was wrapped"):
        get_forward_backward_func()(forward_step_func=_token_step, data_iterator=iter(_token_batches(0)),
                                    model=[model], num_microbatches=M, calculate_per_token_loss=False)


def test_unsupported_megatron_arguments_are_refused_by_name():
    layer = Layer(0)
    for kwargs, name in (({"adjust_tensor_shapes_fn": lambda *a: a}, "adjust_tensor_shapes_fn"),
                         ({"force_all_reduce": True}, "force_all_reduce")):
        with pytest.raises(ValueError, match=name):
            get_forward_backward_func()(forward_step_func=_token_step, data_iterator=iter(_token_batches(0)),
                                        model=[layer], num_microbatches=M, **kwargs)
    layer.config = SimpleNamespace(enable_autocast=True)
    with pytest.raises(ValueError, match="enable_autocast"):
        get_forward_backward_func()(forward_step_func=_token_step, data_iterator=iter(_token_batches(0)),
                                    model=[layer], num_microbatches=M)
