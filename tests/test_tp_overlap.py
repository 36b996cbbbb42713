"""--tp-comm-overlap: each layer runs its micro-batch as batch pieces whose TP collectives are started
before the other pieces' GEMMs and awaited after them. It must compute what the whole batch computes:
one layer's pieces against its whole forward and backward, and GPT training under TP (with and without
sequence parallelism), PP, V, a zero-bubble schedule, recompute, DP overlap and ZeRO-1 against one
process (losses, gradient norms and every weight after 3 Adam steps)."""
import dataclasses

import pytest
import torch

from gpt_harness import FAMILIES, pretrain_gpt
from parallel3d.models import TransformerConfig
from parallel3d.models.block import TransformerLayer, overlap_pieces
from parallel3d.testing import run_distributed
from test_gpt_training import _reference, _sweep

_ON = ["--tp-comm-overlap"]
OVERLAP_LAYOUTS = [
    ("gpt2", 2, 2, 1, True, _ON + ["--recompute-granularity", "full", "--overlap-grad-reduce",
                                   "--use-distributed-optimizer"]),
    ("llama", 2, 2, 2, False, _ON),
    ("gpt2", 4, 2, 1, True, _ON + ["--pipeline-schedule", "zb-h1"]),
    ("llama", 2, 1, 1, True, _ON + ["--recompute-granularity", "selective", "--overlap-grad-reduce"]),
    ("gpt2", 2, 1, 1, False, _ON + ["--recompute-granularity", "full", "--recompute-method", "block",
                                    "--recompute-num-layers", "1"]),
]


def _config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


@pytest.mark.parametrize("llama", [False, True])
def test_a_layer_in_pieces_equals_the_whole_layer(llama):
    extra = dict(normalization="RMSNorm", gated_linear_unit=True, activation="silu", add_bias_linear=False,
                 num_query_groups=2) if llama else {}
    torch.manual_seed(0)
    layer = TransformerLayer(_config(**extra), 1, None)
    x = torch.randn(8, 4, 32, requires_grad=True)
    whole = layer(x, None, None)
    whole.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    x_grad = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    pieces = layer.forward_pieces([p.contiguous() for p in x.chunk(2, dim=1)], [None, None], None)
    torch.cat(pieces, dim=1).square().sum().backward()
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, x_grad, rtol=0, atol=1e-5)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=1e-5, msg=n)


def _layer_pieces_against_whole(rank, world_size):
    from parallel3d import parallel_state as ps

    ps.initialize_model_parallel(2)
    worst = {}
    try:
        for sp in (True, False):
            torch.manual_seed(0)
            layer = TransformerLayer(_config(tensor_model_parallel_size=2, sequence_parallel=sp), 1,
                                     ps.get_tensor_model_parallel_group())
            torch.manual_seed(1)
            x = torch.randn(8, 4, 32)
            x = (x.chunk(2, dim=0)[rank] if sp else x).clone().requires_grad_(True)
            whole = layer(x, None, None)
            (whole.square().sum() * (1 + rank)).backward()
            grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
            x_grad, x.grad = x.grad.clone(), None
            layer.zero_grad()
            out = torch.cat(layer.forward_pieces([p.contiguous() for p in x.chunk(2, dim=1)], [None] * 2, None), 1)
            (out.square().sum() * (1 + rank)).backward()
            diffs = [(out - whole).abs().max(), (x.grad - x_grad).abs().max()]
            diffs += [(p.grad - grads[n]).abs().max() for n, p in layer.named_parameters()]
            worst[sp] = max(d.item() for d in diffs)
    finally:
        ps.destroy_model_parallel()
    return worst


def test_a_tensor_parallel_layer_in_pieces_equals_the_whole_layer():
    """TP=2 on gloo, with and without sequence parallelism: outputs, input and weight gradients."""
    for worst in run_distributed(_layer_pieces_against_whole, 2, timeout=120):
        assert worst[True] < 1e-5 and worst[False] < 1e-5, worst


def test_the_rule_says_when_pieces_run():
    on = _config(tensor_model_parallel_size=2, tp_comm_overlap=True)
    assert overlap_pieces(on, 4, training=True) == (2, "TP communication overlap: on, 2 batch pieces per layer")
    assert overlap_pieces(on, 3, training=True)[0] == 1  # 3 sequences do not split in 2
    assert overlap_pieces(on, 4, training=False)[0] == 1
    assert "dropout" in overlap_pieces(dataclasses.replace(on, hidden_dropout=0.1), 4, training=True)[1]
    assert overlap_pieces(dataclasses.replace(on, tp_comm_overlap=False), 4, training=True)[0] == 1
    assert overlap_pieces(dataclasses.replace(on, tensor_model_parallel_size=1), 4, training=True)[0] == 1


def _sweep_in_pieces(rank, world_size, refs):
    from gpt_harness import layout_args

    for family, tp, pp, vp, sp, extra in OVERLAP_LAYOUTS:  # the layouts do run in pieces, not whole
        args = layout_args(family, tp, pp, vp, sp, extra, world=world_size)
        config = pretrain_gpt.transformer_config_from_args(args)
        assert overlap_pieces(config, args.micro_batch_size, training=True)[0] == 2, (family, tp, pp, extra)
    return _sweep(rank, world_size, refs, OVERLAP_LAYOUTS)


def test_tp_comm_overlap_trains_like_a_single_process():
    refs = {family: _reference(family) for family in FAMILIES}
    results = run_distributed(_sweep_in_pieces, 8, args=(refs,), timeout=600)
    assert all(len(r) == len(OVERLAP_LAYOUTS) for r in results)
