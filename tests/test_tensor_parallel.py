"""Tensor-parallel layers against their dense single-process versions (fp32, ~1e-5).

One launch of 4 processes sweeps TP in {1, 2, 4} (the remaining ranks form DP
replicas that must agree too), with and without sequence parallelism.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d import tensor_parallel as tp
from parallel3d.testing import run_distributed

ATOL = 2e-5


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item()
    assert err <= ATOL, f"{what}: max abs diff {err:.3g}"


def _shard(t, dim, rank, world):
    return t.chunk(world, dim=dim)[rank]


def _dense_linear(in_f, out_f, seed, bias=True):
    """nn.Linear holding the weight that the parallel layers draw for ``seed``."""
    lin = nn.Linear(in_f, out_f, bias=bias)
    torch.manual_seed(seed)
    weight = torch.empty(out_f, in_f)
    nn.init.normal_(weight, std=0.02)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias:
            lin.bias.normal_(std=0.1)  # non-zero so bias handling is tested
    return lin


def _parallel_from_seed(cls, seed, *args, **kw):
    torch.manual_seed(seed)
    return cls(*args, **kw)


def _column_row_cases(rank, tp_size, sp):
    s, b, h, out_f = 8, 2, 12, 16
    r = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(100)
    x_full = torch.randn(s, b, h)
    gy_full = torch.randn(s, b, out_f)

    # ColumnParallelLinear
    for gather_output in ([False] if sp else [False, True]):
        for skip_bias_add in (False, True):
            dense = _dense_linear(h, out_f, 1)
            layer = _parallel_from_seed(tp.ColumnParallelLinear, 1, h, out_f, gather_output=gather_output,
                                        skip_bias_add=skip_bias_add, sequence_parallel=sp,
                                        init_method=tp.init_method_normal(0.02))
            _close(layer.weight, _shard(dense.weight, 0, r, tp_size), "column init slice")
            with torch.no_grad():
                layer.bias.copy_(_shard(dense.bias, 0, r, tp_size))
            x = (_shard(x_full, 0, r, tp_size) if sp else x_full).clone().requires_grad_()
            xd = x_full.clone().requires_grad_()
            out, bias = layer(x)
            if skip_bias_add:
                assert bias is layer.bias or gather_output
                out = out + bias
            else:
                assert bias is None
            ref = dense(xd)
            gy = gy_full if gather_output else _shard(gy_full, 2, r, tp_size)
            _close(out, ref if gather_output else _shard(ref, 2, r, tp_size), "column forward")
            out.backward(gy)
            ref.backward(gy_full)
            _close(x.grad, _shard(xd.grad, 0, r, tp_size) if sp else xd.grad, "column input grad")
            _close(layer.weight.grad, _shard(dense.weight.grad, 0, r, tp_size), "column weight grad")
            _close(layer.bias.grad, _shard(dense.bias.grad, 0, r, tp_size), "column bias grad")

    # RowParallelLinear
    for input_is_parallel in ([True] if sp else [True, False]):
        for skip_bias_add in (False, True):
            dense = _dense_linear(out_f, h, 2)
            layer = _parallel_from_seed(tp.RowParallelLinear, 2, out_f, h, input_is_parallel=input_is_parallel,
                                        skip_bias_add=skip_bias_add, sequence_parallel=sp,
                                        init_method=tp.init_method_normal(0.02))
            _close(layer.weight, _shard(dense.weight, 1, r, tp_size), "row init slice")
            with torch.no_grad():
                layer.bias.copy_(dense.bias)
            y_full = gy_full  # reuse as an input of width out_f
            x = (_shard(y_full, 2, r, tp_size) if input_is_parallel else y_full).clone().requires_grad_()
            xd = y_full.clone().requires_grad_()
            out, bias = layer(x)
            if skip_bias_add:
                out = out + bias
            ref = dense(xd)
            g_full = x_full
            _close(out, _shard(ref, 0, r, tp_size) if sp else ref, "row forward")
            out.backward(_shard(g_full, 0, r, tp_size) if sp else g_full)
            ref.backward(g_full)
            tp.allreduce_sequence_parallel_gradients(layer.parameters())
            _close(x.grad, _shard(xd.grad, 2, r, tp_size) if input_is_parallel else xd.grad, "row input grad")
            _close(layer.weight.grad, _shard(dense.weight.grad, 1, r, tp_size), "row weight grad")
            # under SP the bias saw a shard: allreduce_sequence_parallel_gradients summed it
            assert getattr(layer.bias, "sequence_parallel", False) == (sp and tp_size > 1)
            _close(layer.bias.grad, dense.bias.grad, "row bias grad")


def _embedding_and_loss_cases(rank, tp_size, sp):
    r = ps.get_tensor_model_parallel_rank()
    vocab, h, s, b = 50, 8, 8, 2  # 50 is not divisible by 4: the vocab gets padded
    dense = nn.Embedding(vocab, h)
    torch.manual_seed(5)
    with torch.no_grad():
        nn.init.normal_(dense.weight, std=0.02)
    torch.manual_seed(5)
    emb = tp.VocabParallelEmbedding(vocab, h, make_vocab_size_divisible_by=1, reduce_scatter_embeddings=sp,
                                    init_method=tp.init_method_normal(0.02))
    assert emb.padded_num_embeddings == tp.vocab_size_with_padding(vocab, 1, tp_size)
    assert emb.padded_num_embeddings % tp_size == 0 and emb.padded_num_embeddings >= vocab
    torch.manual_seed(6)
    ids = torch.randint(0, vocab, (b, s))
    out = emb(ids)
    ref = dense(ids)
    ref_cmp = _shard(ref.transpose(0, 1), 0, r, tp_size) if sp else ref
    _close(out, ref_cmp, "embedding forward")
    g = torch.randn_like(ref)
    out.backward(_shard(g.transpose(0, 1), 0, r, tp_size) if sp else g)
    ref.backward(g)
    start, end = emb.vocab_start_index, emb.vocab_end_index
    padded_grad = torch.zeros(emb.padded_num_embeddings, h)
    padded_grad[:vocab] = dense.weight.grad
    _close(emb.weight.grad, padded_grad[start:end], "embedding weight grad")
    # gradient_accumulation_fusion: two micro-batches' rows go into the fp32 main_grad (ids repeat, and
    # under TP some fall outside this rank's range); the DDP hook is told so and gets a gradient to fire on
    emb.gradient_accumulation_fusion = True
    emb.weight.grad, emb.weight.main_grad, emb.weight.grad_added_to_main_grad = None, torch.zeros(end - start, h), False
    for _ in range(2):
        emb(ids).backward(_shard(g.transpose(0, 1), 0, r, tp_size) if sp else g)
    _close(emb.weight.main_grad, 2 * padded_grad[start:end], "embedding gradient in main_grad")
    assert emb.weight.grad_added_to_main_grad and emb.weight.grad.shape == emb.weight.shape
    emb.weight.zero_out_wgrad = True  # a tied weight: its gradient stays with autograd for the hook to add
    emb.weight.grad = None
    emb(ids).backward(_shard(g.transpose(0, 1), 0, r, tp_size) if sp else g)
    _close(emb.weight.grad, padded_grad[start:end], "tied embedding weight grad")

    # cross entropy on padded, TP-split logits
    padded = emb.padded_num_embeddings
    for smoothing in (0.0, 0.1):
        torch.manual_seed(7)
        logits_full = torch.randn(s, b, padded) * 3
        target = torch.randint(0, vocab, (s, b))
        lp = _shard(logits_full, 2, r, tp_size).clone().requires_grad_()
        ld = logits_full[..., :vocab].clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(lp, target, label_smoothing=smoothing, vocab_size=vocab)
        ref_loss = F.cross_entropy(ld.reshape(-1, vocab), target.reshape(-1), reduction="none",  # Megatron's alpha
                                   label_smoothing=smoothing * vocab / (vocab - 1)).reshape(s, b)
        _close(loss, ref_loss, f"cross entropy (smoothing={smoothing})")
        w = torch.rand(s, b)
        (loss * w).sum().backward(retain_graph=True)
        (ref_loss * w).sum().backward()
        # the loss works in place on its own copy: the caller's (fp32) logits are left as they were, and the
        # softmax it held became the gradient, so a second backward raises instead of reusing it
        assert torch.equal(lp.detach(), _shard(logits_full, 2, r, tp_size)), "the loss changed its input"
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (loss * w).sum().backward()
        full_grad = torch.zeros(s, b, padded)
        full_grad[..., :vocab] = ld.grad
        _close(lp.grad, _shard(full_grad, 2, r, tp_size), f"cross entropy grad (smoothing={smoothing})")
    # without vocab_size, every column counts (Megatron's behaviour)
    torch.manual_seed(8)
    logits_full = torch.randn(s, b, padded)
    target = torch.randint(0, padded, (s, b))
    loss = tp.vocab_parallel_cross_entropy(_shard(logits_full, 2, r, tp_size), target)
    _close(loss, F.cross_entropy(logits_full.reshape(-1, padded), target.reshape(-1), reduction="none").reshape(s, b),
           "cross entropy, no padding mask")


class _DenseMLP(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _ParallelMLP(nn.Module):
    def __init__(self, h, f, sp):
        super().__init__()
        self.fc1 = tp.ColumnParallelLinear(h, f, sequence_parallel=sp)
        self.fc2 = tp.RowParallelLinear(f, h, sequence_parallel=sp)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)[0]))[0]


class _DenseAttention(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):  # [s, b, h]
        s, b, h = x.shape
        split = lambda t: t.view(s, b, self.heads, h // self.heads).permute(1, 2, 0, 3)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.o(y.permute(2, 0, 1, 3).reshape(s, b, h))


class _ParallelAttention(nn.Module):
    def __init__(self, h, heads, sp):
        super().__init__()
        self.heads_per_rank = heads // ps.get_tensor_model_parallel_world_size()
        self.head_dim = h // heads
        self.q, self.k, self.v = (tp.ColumnParallelLinear(h, h, sequence_parallel=sp) for _ in range(3))
        self.o = tp.RowParallelLinear(h, h, sequence_parallel=sp)

    def forward(self, x):
        q, k, v = (m(x)[0] for m in (self.q, self.k, self.v))
        s, b, _ = q.shape
        split = lambda t: t.view(s, b, self.heads_per_rank, self.head_dim).permute(1, 2, 0, 3)  # noqa: E731
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return self.o(y.permute(2, 0, 1, 3).reshape(s, b, -1))[0]


def _copy_dense_into_parallel(dense: nn.Module, par: nn.Module, r, tp_size):
    """Load the dense weights into the parallel module's slices (by parameter name)."""
    dense_params = dict(dense.named_parameters())
    with torch.no_grad():
        for name, p in par.named_parameters():
            full = dense_params[name]
            if getattr(p, "tensor_model_parallel", False):
                p.copy_(_shard(full, p.partition_dim, r, tp_size))
            else:
                p.copy_(full)


def _check_grads(dense, par, r, tp_size, what):
    dense_params = dict(dense.named_parameters())
    for name, p in par.named_parameters():
        ref = dense_params[name].grad
        if getattr(p, "tensor_model_parallel", False):
            ref = _shard(ref, p.partition_dim, r, tp_size)
        _close(p.grad, ref, f"{what} grad {name}")


def _block_cases(rank, tp_size, sp):
    r = ps.get_tensor_model_parallel_rank()
    s, b, h, f, heads = 8, 2, 16, 32, 4
    for name, dense_cls, par_cls in (("mlp", lambda: _DenseMLP(h, f), lambda: _ParallelMLP(h, f, sp)),
                                     ("attention", lambda: _DenseAttention(h, heads),
                                      lambda: _ParallelAttention(h, heads, sp))):
        torch.manual_seed(11)
        dense = dense_cls()
        par = par_cls()
        _copy_dense_into_parallel(dense, par, r, tp_size)
        torch.manual_seed(12)
        x_full = torch.randn(s, b, h)
        x = (_shard(x_full, 0, r, tp_size) if sp else x_full).clone().requires_grad_()
        xd = x_full.clone().requires_grad_()
        out, ref = par(x), dense(xd)
        _close(out, _shard(ref, 0, r, tp_size) if sp else ref, f"{name} forward")
        g = torch.randn_like(ref)
        out.backward(_shard(g, 0, r, tp_size) if sp else g)
        ref.backward(g)
        tp.allreduce_sequence_parallel_gradients(par.parameters())
        _close(x.grad, _shard(xd.grad, 0, r, tp_size) if sp else xd.grad, f"{name} input grad")
        _check_grads(dense, par, r, tp_size, name)


def _dropout_recompute_case(rank, tp_size):
    """Dropout in a TP region: per-rank masks, identical again under recomputation."""
    tp.model_parallel_cuda_manual_seed(1234)
    layer = tp.ColumnParallelLinear(16, 32)
    x = torch.randn(4, 2, 16, requires_grad=True)

    def block(inp):
        out = layer(inp)[0]
        with tp.get_cuda_rng_tracker().fork():
            return F.dropout(out, p=0.5, training=True)

    state = tp.get_cuda_rng_tracker().get_states()
    cpu_state = torch.get_rng_state()
    plain = block(x)
    plain.sum().backward()
    grad_plain = [p.grad.clone() for p in (x, layer.weight, layer.bias)]
    for p in (x, layer.weight, layer.bias):
        p.grad = None
    tp.get_cuda_rng_tracker().set_states(state)
    torch.set_rng_state(cpu_state)
    recomputed = tp.checkpoint(block, False, x)
    assert torch.equal(recomputed, plain), "checkpointed forward differs"
    # something else consumes the tracked stream before backward: recompute must not see it
    with tp.get_cuda_rng_tracker().fork():
        torch.rand(100)
    recomputed.sum().backward()
    for got, ref, what in zip((x.grad, layer.weight.grad, layer.bias.grad), grad_plain, ("x", "w", "b")):
        assert torch.equal(got, ref), f"recomputed dropout mask differs ({what} grad)"
    # TP ranks draw different masks, DP replicas of the same TP rank draw the same
    mask = (plain == 0).float()
    masks = [torch.zeros_like(mask) for _ in range(dist.get_world_size())]
    dist.all_gather(masks, mask)
    r = ps.get_tensor_model_parallel_rank()
    for other, m in enumerate(masks):
        same_tp_rank = (other % tp_size) == r
        assert torch.equal(m, mask) == same_tp_rank or tp_size == 1, "dropout stream layout is wrong"


def _reduce_case(rank, tp_size):
    """The row-parallel sum: the caller's tensor keeps its value (the all-reduce runs on a copy), and one TP rank
    returns it as it is, with no copy (a clone of every row-parallel output at TP=1 was a GPU step's waste)."""
    r = ps.get_tensor_model_parallel_rank()
    x = torch.full((3, 4), float(r + 1), requires_grad=True)
    y = tp.reduce_from_tensor_model_parallel_region(x)
    assert torch.equal(x.detach(), torch.full((3, 4), float(r + 1))), "the all-reduce changed its input"
    assert torch.equal(y.detach(), torch.full((3, 4), tp_size * (tp_size + 1) / 2))
    assert (y.data_ptr() == x.data_ptr()) is (tp_size == 1), "one TP rank must not copy; more must"
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 4))


def _sweep(rank, world_size):
    done = []
    for tp_size in (1, 2, 4):
        for sp in ((False, True) if tp_size > 1 else (False,)):
            ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
            try:
                _column_row_cases(rank, tp_size, sp)
                _reduce_case(rank, tp_size)
                _embedding_and_loss_cases(rank, tp_size, sp)
                _block_cases(rank, tp_size, sp)
                if not sp:
                    _dropout_recompute_case(rank, tp_size)
            except AssertionError as e:
                raise AssertionError(f"[TP={tp_size}, SP={sp}] {e}") from e
            finally:
                ps.destroy_model_parallel()
            done.append((tp_size, sp))
    return done


def test_tensor_parallel_layers_match_dense():
    results = run_distributed(_sweep, 4, timeout=240)
    assert all(r == [(1, False), (2, False), (2, True), (4, False), (4, True)] for r in results)


# ---------------------------------------------------------------- single process


def test_layers_without_process_group_are_dense():
    torch.manual_seed(3)
    layer = tp.ColumnParallelLinear(6, 10, init_method=tp.init_method_normal(0.02))
    torch.manual_seed(3)
    ref = torch.empty(10, 6)
    nn.init.normal_(ref, std=0.02)
    assert torch.equal(layer.weight.data, ref)
    x = torch.randn(3, 2, 6)
    torch.testing.assert_close(layer(x)[0], x @ ref.t())


def test_layers_take_sequence_parallel_as_given_and_it_is_an_identity_with_one_tp_rank():
    # The config turns SP off when TP is 1; a layer built directly keeps what it is given, and with one
    # TP rank a sequence shard is the whole sequence: the same numbers as without SP.
    x = torch.randn(5, 2, 6)
    outs = []
    for sp in (False, True):
        torch.manual_seed(4)
        col = tp.ColumnParallelLinear(6, 8, sequence_parallel=sp)
        row = tp.RowParallelLinear(8, 6, sequence_parallel=sp)
        assert col.sequence_parallel is sp and row.sequence_parallel is sp and row.bias.sequence_parallel is sp
        xi = x.clone().requires_grad_()
        out = row(col(xi)[0])[0]
        out.sum().backward()
        outs.append((out.detach(), xi.grad, col.weight.grad, row.weight.grad, row.bias.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="sequence_parallel=True requires input_is_parallel=True"):
        tp.RowParallelLinear(4, 4, sequence_parallel=True, input_is_parallel=False)


def test_bad_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"ColumnParallelLinear output_size \(10\) is not divisible by 4"):
        tp.divide(10, 4, "ColumnParallelLinear output_size")
    with pytest.raises(ValueError, match="gather_output=True is incompatible with sequence_parallel"):
        tp.ColumnParallelLinear(4, 4, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="label_smoothing"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), label_smoothing=1.0)
    with pytest.raises(ValueError, match="disagree"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with tp.random.RNGStatesTracker().fork():
            pass
    assert tp.vocab_size_with_padding(50257, 128, 1) == 50304
    assert tp.vocab_size_with_padding(50257, 128, 8) == 51200
    assert math.isclose(tp.vocab_size_with_padding(8, 1, 4), 8)


def _bad_tp_split(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tp.ColumnParallelLinear(4, 7)
    except ValueError as e:
        assert "ColumnParallelLinear output_size (7) is not divisible by 2" in str(e), str(e)
    else:
        raise AssertionError("no error for 7 columns on TP=2")
    try:
        tp.RowParallelLinear(5, 4)
    except ValueError as e:
        assert "RowParallelLinear input_size (5) is not divisible by 2" in str(e), str(e)
    else:
        raise AssertionError("no error for 5 rows on TP=2")
    return True


def test_bad_tp_split_errors():
    assert run_distributed(_bad_tp_split, 2, timeout=60) == [True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_without_tp_equals_the_vocab_parallel_one(dtype):
    """TP=1 takes a shorter road (one log_softmax); loss and gradient agree with the TP algorithm's."""
    from parallel3d.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

    torch.manual_seed(3)
    vocab, padded = 1000, 1024
    for smoothing in (0.0, 0.1):
        logits = (torch.randn(16, 4, padded) * 3).to(dtype)
        target = torch.randint(0, vocab, (16, 4))
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(a, target, label_smoothing=smoothing, vocab_size=vocab)
        ref = _VocabParallelCrossEntropy.apply(b, target, smoothing * vocab / (vocab - 1), vocab, None)
        w = torch.rand(16, 4)
        (loss * w).sum().backward()
        (ref * w).sum().backward()
        assert loss.dtype == torch.float32 and a.grad.dtype == dtype
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=1e-5, atol=1e-6)
        assert a.grad[..., vocab:].abs().max() == 0  # padding columns get no gradient
    x = torch.randn(4, 10, requires_grad=True)
    loss = tp.vocab_parallel_cross_entropy(x, torch.zeros(4, dtype=torch.long)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the saved log-probabilities became the gradient: a second pass must not reuse them


def test_tied_output_weight_returns_no_gradient_beside_the_embeddings():
    """A fused wgrad goes into main_grad. The tied output weight (zero_out_wgrad: the embedding in the same
    backward gives the weight its other gradient, which fires the DDP hook) returns none, not a [vocab, h]
    tensor of zeros held through the backward; a weight with no other use returns one for the hook to skip."""
    from parallel3d.tensor_parallel.linear_functions import weight_gradient

    torch.manual_seed(0)
    x, g = torch.randn(8, 4), torch.randn(8, 6)
    for tied in (True, False):
        w = nn.Parameter(torch.randn(6, 4))
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(6, 4), False
        if tied:
            w.zero_out_wgrad = True
        out = weight_gradient(w, x, g, fused=True)
        torch.testing.assert_close(w.main_grad, g.t() @ x)
        assert w.grad_added_to_main_grad, "the DDP hook must be told the wgrad is in main_grad"
        assert (out is None) == tied, f"tied={tied}: returned {None if out is None else tuple(out.shape)}"
