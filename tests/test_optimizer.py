"""Optimizers across TP/PP/DP: tied embedding over two pipeline stages, fp16 overflow skipping,
ZeRO-1 memory, DP-size independent checkpoints; plus the scheduler and the loss scaler.

One launch of 4 gloo processes. Pipeline parallelism is emulated by hand (two stages
exchanging activations and their gradients with send/recv): the pipeline executor is
tested on its own; here the point is what finalize_model_grads and the optimizer do
with a word embedding tied between the first and the last stage.
"""
import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d import tensor_parallel as tp
from parallel3d.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    DynamicGradScaler,
    OptimizerConfig,
    OptimizerParamScheduler,
    finalize_model_grads,
    get_megatron_optimizer,
)
from parallel3d.testing import run_distributed
from blocks import CPU, H, DenseBlock, ParallelBlock

V, S, B_MICRO = 24, 8, 2


class DenseTiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(V, H)
        self.block0, self.block1 = DenseBlock(), DenseBlock()
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3 if p.dim() == 2 else 0.1)

    def forward(self, ids, labels):  # ids [b, s], labels [s, b]
        h = self.block1(self.block0(self.embedding(ids).transpose(0, 1)))
        logits = h @ self.embedding.weight.t()
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


class FirstStage(nn.Module):
    pre_process, post_process, share_embeddings_and_output_weights = True, False, True

    def __init__(self):
        super().__init__()
        self.embedding = tp.VocabParallelEmbedding(V, H, make_vocab_size_divisible_by=1, device=CPU)
        self.block0 = ParallelBlock()

    def shared_embedding_or_output_weight(self):
        return self.embedding.weight

    def forward(self, ids):
        return self.block0(self.embedding(ids).transpose(0, 1).contiguous())


class LastStage(nn.Module):
    pre_process, post_process, share_embeddings_and_output_weights = False, True, True

    def __init__(self):
        super().__init__()
        self.block1 = ParallelBlock()
        # The last stage's copy of the word embedding is the output layer's weight (Megatron's layout): it
        # comes last in parameter order here and first in the buffer, the embedding on stage 0 comes last.
        self.output_layer = tp.ColumnParallelLinear(H, V, bias=False, device=CPU)

    def shared_embedding_or_output_weight(self):
        return self.output_layer.weight

    def forward(self, h, labels):
        logits, _ = self.output_layer(self.block1(h))
        return tp.vocab_parallel_cross_entropy(logits, labels).mean()


_STAGE_NAMES = {  # parallel name -> dense name
    "embedding.weight": "embedding.weight", "output_layer.weight": "embedding.weight",
    **{f"{b}.{n}": f"{b}.{n}" for b in ("block0", "block1") for n in
       ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")},
}


def tp_slice(full, p):
    if getattr(p, "tensor_model_parallel", False):
        return full.chunk(ps.get_tensor_model_parallel_world_size(), dim=p.partition_dim)[
            ps.get_tensor_model_parallel_rank()]
    return full


def _lm_data(step, global_batch):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, V, (global_batch, S), generator=g), torch.randint(0, V, (S, global_batch), generator=g)


def _tied_pipeline_case(zero):
    """PP=2 with the word embedding on both stages: grads summed, norm counted once, copies stay equal."""
    state = ps.get_parallel_state()
    pp_rank, dp, dp_rank = state.pipeline_model_parallel_rank, state.data_parallel_size, state.data_parallel_rank
    peer = state.pipeline_rank_to_global(1 - pp_rank)
    steps, m_micro = 2, 2
    torch.manual_seed(3)
    dense = DenseTiedLM()
    ref_opt = torch.optim.AdamW(
        [{"params": [p for n, p in dense.named_parameters() if p.dim() == 2], "weight_decay": 0.1},
         {"params": [p for n, p in dense.named_parameters() if p.dim() == 1], "weight_decay": 0.0}], lr=1e-2)
    stage = FirstStage() if pp_rank == 0 else LastStage()
    full = dict(dense.named_parameters())
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(tp_slice(full[_STAGE_NAMES[name]], p))
    ddp = DistributedDataParallel(stage, DistributedDataParallelConfig(bucket_size=None,
                                                                      use_distributed_optimizer=zero))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5,
                                                 use_distributed_optimizer=zero), [ddp])
    for step in range(steps):
        ids, labels = _lm_data(step, dp * m_micro * B_MICRO)
        ref_opt.zero_grad()
        dense(ids, labels).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5).item()
        ref_opt.step()

        opt.zero_grad()
        for m in range(m_micro):
            cols = slice((dp_rank * m_micro + m) * B_MICRO, (dp_rank * m_micro + m + 1) * B_MICRO)
            ctx = ddp.no_sync() if m < m_micro - 1 else contextlib.nullcontext()
            with ctx:
                if pp_rank == 0:
                    h = ddp(ids[cols])
                    dist.send(h.detach(), peer)
                    grad = torch.empty_like(h)
                    dist.recv(grad, peer)
                    h.backward(grad)
                else:
                    h = torch.empty(S, B_MICRO, H)
                    dist.recv(h, peer)
                    h.requires_grad_()
                    (ddp(h, labels[:, cols]) / m_micro).backward()
                    dist.send(h.grad, peer)
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
        assert ok and abs(norm - ref_norm) <= 1e-5 * ref_norm, (
            f"step {step}: grad norm {norm} vs single process {ref_norm}")
    masters = opt.state_dict()["params"][0]
    for name, p in stage.named_parameters():
        want = tp_slice(full[_STAGE_NAMES[name]].detach(), p)
        err = max((masters[name]["main_param"] - want).abs().max().item(), (p.detach() - want).abs().max().item())
        assert err <= 1e-5, f"stage {pp_rank} {name} differs from single-process training by {err:.3g}"
    return True


def _fp16_overflow_case(zero):
    """An Inf on one rank skips the step everywhere; the scale halves after `hysteresis` overflows."""
    torch.manual_seed(11)
    model = nn.Sequential(ParallelBlock(dtype=torch.float16), ParallelBlock(dtype=torch.float16))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=500,
                                                                      use_distributed_optimizer=zero))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, fp16=True, params_dtype=torch.float16,
                                                 initial_loss_scale=2.0 ** 12, hysteresis=2,
                                                 use_distributed_optimizer=zero), [ddp])
    x = torch.randn(S, B_MICRO, H).half()
    log = []
    for inject in (False, True, True, False):
        before = [p.detach().clone() for p in model.parameters()]
        masters_before = opt.state_dict()["params"][0]
        opt.zero_grad()
        opt.scale_loss(ddp(x).float().pow(2).mean()).backward()
        finalize_model_grads([ddp])
        if inject and dist.get_rank() == 0:
            ddp.buckets[0].grad_data[0] = float("inf")  # rank 0 only, after the DP reduction
        scale = opt.get_loss_scale().item()
        ok, norm, _ = opt.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        if not ok:
            masters = opt.state_dict()["params"][0]
            assert all(torch.equal(masters[n]["main_param"], masters_before[n]["main_param"]) for n in masters), \
                "a skipped step changed the fp32 masters"
            assert norm is None
        log.append((ok, changed, scale, opt.get_loss_scale().item(), opt.num_steps))
    s = 2.0 ** 12
    assert log == [(True, True, s, s, 1), (False, False, s, s, 1), (False, False, s, s / 2, 1),
                   (True, True, s / 2, s / 2, 2)], log
    return log


def _bytes(t):
    return t.numel() * t.element_size()


def _memory_case(dp_group, zero):
    """Bytes held by params + grad buffer + fp32 masters + Adam state vs Megatron's 6 + 12/d (bf16, fp32 grads)."""
    d = dist.get_world_size(dp_group)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, dtype=torch.bfloat16), nn.Linear(256, 256, dtype=torch.bfloat16))
    n = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=None,
                                                                      use_distributed_optimizer=zero), dp_group)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=zero), [ddp])
    opt.zero_grad()
    ddp(torch.randn(4, 256, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    finalize_model_grads([ddp])
    assert opt.step()[0]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    params = sum(storages.values())
    grads = sum(_bytes(buf.grad_data) for buf in ddp.param_and_grad_buffers)
    if zero:
        masters = sum(_bytes(s.main_shard) for s in opt.shards if s.main_shard is not s.param_shard)
    else:
        masters = sum(_bytes(m) for p, m in opt._half_pairs)
    state = sum(_bytes(t) for st in opt.optimizer.state.values() for k, t in st.items() if k != "step")
    per_param = (params + grads + masters + state) / n
    expected = 6 + 12 / d if zero else 18
    assert abs(per_param - expected) <= 0.005 * expected, (
        f"ZeRO-1={zero} d={d}: {per_param:.3f} bytes/param (params {params}, grads {grads}, masters {masters}, "
        f"state {state}), expected {expected:.3f}")
    return per_param


def _train_steps(ddp, opt, dp_group, steps):
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    dtype = next(ddp.module.parameters()).dtype
    for step in steps:
        g = torch.Generator().manual_seed(900 + step)
        x = torch.randn(S, 8, H, generator=g)
        cols = slice(dp_rank * 8 // dp, (dp_rank + 1) * 8 // dp)
        opt.zero_grad()
        ddp(x[:, cols].to(dtype)).float().pow(2).mean().backward()
        finalize_model_grads([ddp])
        assert opt.step()[0]


def _make(dp_group, zero, seed, dtype):
    torch.manual_seed(seed)
    model = nn.Sequential(ParallelBlock(dtype=dtype), ParallelBlock(dtype=dtype))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=300,
                                                                      use_distributed_optimizer=zero), dp_group)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                                                 use_distributed_optimizer=zero), [ddp])
    sched = OptimizerParamScheduler(opt, 0.0, 1e-2, 1e-3, 2, 10, "cosine", 0.1, 0.1, 10, "constant")
    return ddp, opt, sched


def _assert_same_state(a, b, what):
    assert a["step"] == b["step"] and a["optimizer"] == b["optimizer"], what
    assert a["param_groups"] == b["param_groups"], f"{what}: param groups differ"
    for name in a["params"][0]:
        for k, t in a["params"][0][name].items():
            assert torch.equal(t, b["params"][0][name][k]), f"{what}: {name} {k} differs"


def _checkpoint_case(pairs, dtype):
    """Save with ZeRO-1 at DP=2, load without ZeRO-1 and with ZeRO-1 at DP=4: same state, same next step.

    The next step is compared within 1e-6 in fp32 (only the reduction order differs). In bf16
    each rank's weight gradient is rounded to bf16 before the fp32 reduction, and DP=2 and DP=4
    round different partial sums (~2^-8 relative); through Adam (lr 1e-2) that moves weights by
    ~1e-5, so 2e-4 there; a wrong state or step count moves them by O(lr).
    """
    atol = 1e-6 if dtype == torch.float32 else 2e-4
    ddp, opt, sched = _make(pairs, True, 1, dtype)
    _train_steps(ddp, opt, pairs, range(2))
    for _ in range(2):
        sched.step()
    saved = opt.state_dict()
    saved_model = {k: v.clone() for k, v in ddp.state_dict().items()}
    saved_sched = sched.state_dict()
    assert saved["step"] == 2 and set(saved["params"][0]) == {n for n, _ in ddp.module.named_parameters()}
    _train_steps(ddp, opt, pairs, [2])
    after = opt.state_dict()["params"][0]

    world_dp = ps.get_data_parallel_group()
    for zero in (False, True):
        what = f"{dtype} DP=2 ZeRO-1 checkpoint loaded at DP=4 zero1={zero}"
        ddp2, opt2, sched2 = _make(world_dp, zero, 2, dtype)  # another init: all must come from the checkpoint
        ddp2.load_state_dict(saved_model)
        opt2.load_state_dict(saved)
        sched2.load_state_dict(saved_sched)
        assert sched2.num_steps == 2 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"], what
        _assert_same_state(saved, opt2.state_dict(), what)
        _train_steps(ddp2, opt2, world_dp, [2])
        got = opt2.state_dict()["params"][0]
        for name in after:
            for k in after[name]:
                err = (after[name][k] - got[name][k]).abs().max().item()
                assert err <= atol * max(1.0, after[name][k].abs().max().item()), (
                    f"{what}: after one more step {name} {k} differs by {err:.3g}")
    return True


def _sweep(rank, world_size):
    out = {}
    for zero in (False, True):
        for tp_size in (1, 2):  # TP1 x PP2 x DP2 and TP2 x PP2 x DP1
            ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=2)
            try:
                out[f"tied TP{tp_size} zero1={zero}"] = _tied_pipeline_case(zero)
            except AssertionError as e:
                raise AssertionError(f"[tied embedding, TP={tp_size}, PP=2, ZeRO-1={zero}] {e}") from e
            finally:
                ps.destroy_model_parallel()
    pairs = dist.new_group([0, 1]), dist.new_group([2, 3])
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        for zero in (False, True):
            out[f"fp16 zero1={zero}"] = _fp16_overflow_case(zero)
    finally:
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        mine = pairs[rank // 2]
        out["memory"] = [_memory_case(g, z) for g, z in ((mine, True), (ps.get_data_parallel_group(), True),
                                                          (mine, False))]
        out["checkpoint"] = [_checkpoint_case(mine, dtype) for dtype in (torch.float32, torch.bfloat16)]
    finally:
        ps.destroy_model_parallel()
    return out


def test_optimizer_across_layouts():
    results = run_distributed(_sweep, 4, timeout=300)
    for r in results:
        assert all(r[f"tied TP{t} zero1={z}"] for t in (1, 2) for z in (False, True))
        assert r["checkpoint"] == [True, True] and len(r["memory"]) == 3
    assert all(r["fp16 zero1=True"] == results[0]["fp16 zero1=True"] for r in results)


# ---------------------------------------------------------------- single process


class _FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0, "lr_mult": 1.0, "wd_mult": 1.0},
                             {"lr": 0.0, "weight_decay": 0.0, "lr_mult": 1.0, "wd_mult": 0.0}]


def test_lr_schedules():
    def lrs(style, **kw):
        opt = _FakeOptimizer()
        s = OptimizerParamScheduler(opt, 0.0, 1.0, 0.1, 10, 110, style, 0.0, 0.1, 100, "linear", **kw)
        out = [opt.param_groups[0]["lr"]]
        for _ in range(120):
            s.step()
            out.append(opt.param_groups[0]["lr"])
        return out, opt, s

    lin, opt, s = lrs("linear")
    assert lin[0] == 0.0 and lin[5] == pytest.approx(0.5) and lin[10] == pytest.approx(1.0)
    assert lin[60] == pytest.approx(0.1 + 0.9 * 0.5) and lin[110] == pytest.approx(0.1) and lin[120] == 0.1
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1) and opt.param_groups[1]["weight_decay"] == 0.0
    cos, _, _ = lrs("cosine")
    assert cos[60] == pytest.approx(0.1 + 0.9 * 0.5) and cos[35] == pytest.approx(0.1 + 0.45 * (1 + math.cos(
        math.pi * 0.25)))
    isr, _, _ = lrs("inverse-square-root")
    assert isr[40] == pytest.approx(math.sqrt(10 / 40))
    const, _, _ = lrs("constant")
    assert const[100] == 1.0
    wsd, _, _ = lrs("WSD", wsd_decay_steps=20, lr_wsd_decay_style="linear")
    assert wsd[90] == 1.0 and wsd[100] == pytest.approx(0.1 + 0.9 * 0.5) and wsd[110] == pytest.approx(0.1)
    # a restored scheduler continues where the saved one stopped
    opt2 = _FakeOptimizer()
    s2 = OptimizerParamScheduler(opt2, 0.0, 5.0, 0.0, 1, 2, "linear", 0.0, 0.0, 1, "constant")
    s2.load_state_dict(s.state_dict())
    assert s2.num_steps == 120 and opt2.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="lr_warmup_steps \\(10\\) must be < lr_decay_steps \\(5\\)"):
        OptimizerParamScheduler(_FakeOptimizer(), 0.0, 1.0, 0.0, 10, 5, "linear", 0.0, 0.0, 1, "constant")


def test_dynamic_grad_scaler():
    s = DynamicGradScaler(2.0 ** 10, 1.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0 ** 10  # hysteresis absorbs the first overflow
    s.update(True)
    assert s.scale == 2.0 ** 9
    s.update(True)
    assert s.scale == 2.0 ** 8  # budget is refilled only by growth
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0 ** 9
    s.update(True)
    assert s.scale == 2.0 ** 9
    restored = DynamicGradScaler(1.0, 1.0)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()
    floor = DynamicGradScaler(2.0, 1.0, hysteresis=1)
    for _ in range(4):
        floor.update(True)
    assert floor.scale == 1.0


def test_clip_grad_norm_fp32_matches_torch_single_process():
    from parallel3d.distributed import clip_grad_norm_fp32, get_grad_norm_fp32

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for p, c in zip(params, copies):
        p.grad = torch.randn_like(p)
        c.grad = p.grad.clone()
    assert get_grad_norm_fp32([p.grad for p in params], float("inf")) == pytest.approx(
        max(p.grad.abs().max().item() for p in params))
    norm = clip_grad_norm_fp32(params, 0.5)
    ref = torch.nn.utils.clip_grad_norm_(copies, 0.5).item()
    assert norm == pytest.approx(ref, rel=1e-6)
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.grad, c.grad)
    shared = nn.Parameter(torch.ones(2))
    shared.grad, shared.shared = torch.full((2,), 100.0), True  # a tied copy: clipped but not counted
    assert clip_grad_norm_fp32(params + [shared], 1e9) == pytest.approx(0.5, rel=1e-5)


def test_num_zeros_in_grad():
    model = nn.Linear(4, 3, bias=False)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig())
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, log_num_zeros_in_grad=True), [ddp])
    x = torch.randn(6, 4)
    x[:, 0] = 0.0  # the weight gradient's first column is exactly zero
    ddp(x).pow(2).sum().backward()
    finalize_model_grads([ddp])
    ok, norm, zeros = opt.step()
    assert ok and zeros == 3 and norm > 0


def _clipped_bf16_run(fused_path, monkeypatch, steps=3):
    """A bf16 model (a decayed and a not-decayed group) trained with clipping active: masters, model copies,
    moments and steps after ``steps`` steps, with the one-pass step (fused.adamw_master_step) or without."""
    import parallel3d.distributed.optimizer as optimizer_module

    calls = []
    real = optimizer_module.adamw_master_step
    monkeypatch.setattr(optimizer_module, "adam_kernel_applies", lambda *a: fused_path)
    monkeypatch.setattr(optimizer_module, "adamw_master_step", lambda *a, **k: (calls.append(a), real(*a, **k)))
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(torch.bfloat16)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=True, params_dtype=torch.bfloat16,
                                                 clip_grad=0.05), [ddp])
    versions = [p._version for p in model.parameters()]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        ddp(torch.randn(5, 6, generator=g).to(torch.bfloat16)).float().pow(2).sum().backward()
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
        assert ok and norm > 0.05  # clipping is active
    assert all(p._version > v for p, v in zip(model.parameters(), versions)), "model versions not bumped"
    state = opt.state_dict()
    return calls, [p.detach().clone() for p in model.parameters()], state


def test_one_pass_adam_step_equals_clip_step_and_copy(monkeypatch):
    """MixedPrecisionOptimizer's fused path (what runs on GPUs with the kernels; here the kernel's PyTorch
    reference) against the clip, torch's AdamW and the copy: the same masters, model weights and moments,
    in the torch optimizer's own state (checkpoints unchanged), with the clip passed as the gradient scale."""
    calls, fused_weights, fused_state = _clipped_bf16_run(True, monkeypatch)
    plain_calls, plain_weights, plain_state = _clipped_bf16_run(False, monkeypatch)
    assert len(calls) == 3 * 2 and not plain_calls  # a call per param group per step
    assert all(0 < c[-1] < 1 for c in calls), "the clip coefficient is the gradient scale"
    assert {c[9] for c in calls} == {0.1, 0.0}, "each group's weight decay"
    assert fused_state["step"] == plain_state["step"] == 3
    for a, b in zip(fused_weights, plain_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the bf16 model copies round to the same weights
    for name, entry in plain_state["params"][0].items():
        for k, t in entry.items():
            torch.testing.assert_close(fused_state["params"][0][name][k], t, rtol=1e-6, atol=1e-7)
