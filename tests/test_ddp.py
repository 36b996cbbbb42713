"""DistributedDataParallel + finalize_model_grads + optimizers against single-process training.

One launch of 4 gloo processes sweeps the layouts
    TP1 x DP4, TP1 x DP2 (two replicas of DP2 built from subgroups), TP2 x DP2, TP2 x DP2 + SP
and in each trains a stack of LayerNorm -> ColumnParallelLinear -> GeLU -> RowParallelLinear
blocks for 3 optimizer steps, every DP rank on a different slice of the global batch,
with 2 microbatches accumulated under no_sync(). Every run is checked against a plain
torch model trained on the whole global batch in the same process:
- fp32 (Adam, SGD; overlap on/off; average_in_collective; ZeRO-1; per-token loss):
  weights within 1e-5 and the clipped global grad norm within 1e-5 relative;
- bf16 params with fp32 master weights and fp32 gradient reduction (SGD): the
  reference starts from the same bf16-rounded weights and trains in fp32; the
  weight *update* must match within 2% relative (L2). bf16 rounds activations and
  gradients at ~2^-9 relative per op, a handful of ops deep, giving about 0.5%
  error in the gradients; an all-reduce or optimizer bug gives O(1). ZeRO-1 and
  plain bf16 runs must agree within 1e-6 (only reduction order differs).
Also: the overlap event log, the missing-gradient error, the grad_added_to_main_grad
protocol and broadcast_params.
"""
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    finalize_model_grads,
    get_megatron_optimizer,
)
from parallel3d.testing import run_distributed
from blocks import H, DenseBlock, ParallelBlock

S, B_MICRO, STEPS = 8, 2, 3


class Config:
    def __init__(self, calculate_per_token_loss=False):
        self.calculate_per_token_loss = calculate_per_token_loss


class Net(nn.Module):
    def __init__(self, make_block, n, config=None):
        super().__init__()
        self.blocks = nn.ModuleList(make_block() for _ in range(n))
        self.config = config or Config()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def dense_init(n_blocks, seed, round_bf16=False):
    torch.manual_seed(seed)
    net = Net(DenseBlock, n_blocks)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3 if p.dim() == 2 else 0.1)  # non-trivial norms and biases too
            if round_bf16:
                p.copy_(p.to(torch.bfloat16).float())
    return net


def tp_slice(full, p):
    if getattr(p, "tensor_model_parallel", False):
        world = ps.get_tensor_model_parallel_world_size()
        return full.chunk(world, dim=p.partition_dim)[ps.get_tensor_model_parallel_rank()]
    return full


def parallel_from_dense(dense, sp, dtype, config=None):
    net = Net(lambda: ParallelBlock(sp, dtype), len(dense.blocks), config)
    full = dict(dense.named_parameters())
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(tp_slice(full[name], p).to(dtype))
    return net


def global_data(step, global_batch, per_token=False):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(S, global_batch, H, generator=g)
    t = torch.randn(S, global_batch, H, generator=g)
    mask = (torch.rand(S, global_batch, generator=g) < 0.6).float() if per_token else None
    return x, t, mask


def reference_train(dense, cfg, dp, m_micro, per_token=False):
    """Single-process training on the whole global batch; returns (model, grad norms)."""
    decay = [p for n, p in dense.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in dense.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adam":
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    else:
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)
    norms = []
    for step in range(STEPS):
        x, t, mask = global_data(step, dp * m_micro * B_MICRO, per_token)
        opt.zero_grad()
        sq = (dense(x) - t) ** 2
        loss = (sq * mask[..., None]).sum() / (mask.sum() * H) if per_token else sq.mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(dense.parameters(), cfg.clip_grad or float("inf")).item())
        opt.step()
    return dense, norms


def parallel_train(model, ddp_cfg, opt_cfg, dp_group, dp, dp_rank, m_micro, sp, per_token=False):
    ddp = DistributedDataParallel(model, ddp_cfg, dp_group=dp_group)
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    norms = []
    for step in range(STEPS):
        x, t, mask = global_data(step, dp * m_micro * B_MICRO, per_token)
        opt.zero_grad()
        tokens = torch.zeros((), dtype=torch.float32)
        for m in range(m_micro):
            cols = slice((dp_rank * m_micro + m) * B_MICRO, (dp_rank * m_micro + m + 1) * B_MICRO)
            xs, ts = x[:, cols], t[:, cols]
            if sp:  # each TP rank sees its slice of the sequence; the loss is a sum of the slices' parts
                xs, ts = xs.chunk(tp_size, 0)[tp_rank], ts.chunk(tp_size, 0)[tp_rank]
            ctx = ddp.no_sync() if m < m_micro - 1 else contextlib.nullcontext()
            with ctx:
                sq = (ddp(xs.to(model.blocks[0].fc1.weight.dtype)).float() - ts) ** 2
                if per_token:
                    ms = mask[:, cols]
                    loss = (sq * ms[..., None]).sum()
                    tokens += ms.sum() * H
                else:
                    loss = sq.sum() / (S * B_MICRO * H) / m_micro
                opt.scale_loss(loss).backward()
        finalize_model_grads([ddp], num_tokens=tokens if per_token else None)
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    return ddp, opt, norms


def check_against_reference(ddp, opt, ref, norms, ref_norms, what, atol=1e-5):
    full = dict(ref.named_parameters())
    masters = opt.state_dict()["params"][0]
    for name, p in ddp.module.named_parameters():
        want = tp_slice(full[name].detach(), p)
        err = (masters[name]["main_param"] - want).abs().max().item()
        assert err <= atol, f"{what}: master {name} differs from single-process training by {err:.3g}"
        err = (p.detach().float() - want).abs().max().item()
        assert err <= atol, f"{what}: model param {name} differs from single-process training by {err:.3g}"
    for i, (n, rn) in enumerate(zip(norms, ref_norms)):
        assert abs(n - rn) <= 1e-5 * rn, f"{what}: step {i} grad norm {n} vs single process {rn}"


def relative_update_error(ddp, opt, ref, init):
    full, start = dict(ref.named_parameters()), dict(init.named_parameters())
    masters = opt.state_dict()["params"][0]
    num = den = 0.0
    for name, p in ddp.module.named_parameters():
        want_delta = tp_slice((full[name] - start[name]).detach(), p)
        got_delta = masters[name]["main_param"] - tp_slice(start[name].detach(), p)
        num += (got_delta - want_delta).pow(2).sum().item()
        den += want_delta.pow(2).sum().item()
        # the bf16 model parameter is exactly the rounded master
        assert torch.equal(p.detach(), masters[name]["main_param"].to(p.dtype)), f"{name}: param != bf16(master)"
    return (num / den) ** 0.5


def _training_cases(layout, tp_size, sp, dp_group, dp, dp_rank):
    done = []
    adam = dict(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    cases = [
        # (name, ddp kwargs, optimizer kwargs, microbatches, per_token)
        ("fp32 adam overlap", dict(bucket_size=300, overlap_grad_reduce=True), adam, 2, False),
        ("fp32 adam zero1", dict(bucket_size=300, overlap_grad_reduce=True, use_distributed_optimizer=True),
         dict(adam, use_distributed_optimizer=True), 2, False),
        ("fp32 sgd no-overlap avg-in-collective", dict(overlap_grad_reduce=False, average_in_collective=True),
         dict(optimizer="sgd", lr=0.05, sgd_momentum=0.9, weight_decay=0.01, clip_grad=0.0), 1, False),
    ]
    if not sp:  # per-token loss counts tokens after the sequence is whole (Megatron's contract)
        cases.append(("fp32 adam per-token", dict(bucket_size=500, overlap_grad_reduce=True), adam, 2, True))
    for name, ddp_kw, opt_kw, m_micro, per_token in cases:
        what = f"[{layout}] {name}"
        cfg = OptimizerConfig(**opt_kw)
        ref, ref_norms = reference_train(dense_init(2, 7), cfg, dp, m_micro, per_token)
        model = parallel_from_dense(dense_init(2, 7), sp, torch.float32, Config(per_token))
        ddp, opt, norms = parallel_train(model, DistributedDataParallelConfig(**ddp_kw), cfg, dp_group, dp, dp_rank,
                                         m_micro, sp, per_token)
        check_against_reference(ddp, opt, ref, norms, ref_norms, what)
        if "zero1" in name:
            # ZeRO-1 keeps only the shard: masters and Adam state for about 1/DP of the elements
            held = sum(t.numel() for t in opt._main_params())
            assert held <= sum(p.numel() for p in model.parameters()) // dp + 64 * len(ddp.buckets), what
        done.append(name)

    # bf16 parameters, fp32 masters and fp32 gradient reduction, with and without ZeRO-1
    sgd = dict(optimizer="sgd", lr=0.1, sgd_momentum=0.9, weight_decay=0.0, clip_grad=0.0, bf16=True,
               params_dtype=torch.bfloat16)
    init = dense_init(2, 9, round_bf16=True)
    ref, _ = reference_train(dense_init(2, 9, round_bf16=True), OptimizerConfig(**sgd), dp, 2)
    masters = {}
    for zero in (False, True):
        what = f"[{layout}] bf16 sgd zero1={zero}"
        model = parallel_from_dense(init, sp, torch.bfloat16)
        ddp, opt, _ = parallel_train(
            model, DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=400,
                                                 use_distributed_optimizer=zero),
            OptimizerConfig(**sgd, use_distributed_optimizer=zero), dp_group, dp, dp_rank, 2, sp)
        rel = relative_update_error(ddp, opt, ref, init)
        assert rel < 0.02, f"{what}: weight update differs from fp32 single-process training by {rel:.3%}"
        masters[zero] = opt.state_dict()["params"][0]
        done.append(f"bf16 zero1={zero}")
    for name in masters[False]:
        err = (masters[False][name]["main_param"] - masters[True][name]["main_param"]).abs().max().item()
        assert err <= 1e-6, f"[{layout}] bf16 ZeRO-1 vs plain: master {name} differs by {err:.3g}"
    return done


def _two_chunk_case(layout, sp, dp, dp_rank):
    """Two model chunks (as with virtual pipeline stages) under one optimizer, with and without ZeRO-1."""
    cfg_kw = dict(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    ref, ref_norms = reference_train(dense_init(2, 5), OptimizerConfig(**cfg_kw), dp, 2)
    for zero in (False, True):
        what = f"[{layout}] two chunks zero1={zero}"
        dense = dense_init(2, 5)
        chunks = []
        for i in range(2):
            one = Net(DenseBlock, 1)
            one.blocks[0].load_state_dict(dense.blocks[i].state_dict())
            chunks.append(DistributedDataParallel(parallel_from_dense(one, sp, torch.float32),
                                                  DistributedDataParallelConfig(bucket_size=500,
                                                                                use_distributed_optimizer=zero)))
        opt = get_megatron_optimizer(OptimizerConfig(**cfg_kw, use_distributed_optimizer=zero), chunks)
        norms = []
        for step in range(STEPS):
            x, t, _ = global_data(step, dp * 2 * B_MICRO)
            opt.zero_grad()
            for m in range(2):
                cols = slice((dp_rank * 2 + m) * B_MICRO, (dp_rank * 2 + m + 1) * B_MICRO)
                xs, ts = x[:, cols], t[:, cols]
                if sp:
                    xs, ts = xs.chunk(tp_size, 0)[tp_rank], ts.chunk(tp_size, 0)[tp_rank]
                with contextlib.ExitStack() as stack:
                    if m == 0:
                        for c in chunks:
                            stack.enter_context(c.no_sync())
                    (((chunks[1](chunks[0](xs)) - ts) ** 2).sum() / (S * B_MICRO * H) / 2).backward()
            finalize_model_grads(chunks)
            norms.append(opt.step()[1])
        full = dict(ref.named_parameters())
        masters = opt.state_dict()["params"]
        for ci, chunk in enumerate(chunks):
            for name, p in chunk.module.named_parameters():
                want = tp_slice(full[name.replace("blocks.0.", f"blocks.{ci}.")].detach(), p)
                err = max((masters[ci][name]["main_param"] - want).abs().max().item(),
                          (p.detach() - want).abs().max().item())
                assert err <= 1e-5, f"{what}: chunk {ci} {name} differs from single-process training by {err:.3g}"
        assert all(abs(n - r) <= 1e-5 * r for n, r in zip(norms, ref_norms)), f"{what}: norms {norms} vs {ref_norms}"
    return True


def _overlap_events(dp_group):
    """Bucket launches happen during backward, before the first block's backward starts."""
    results = {}
    for overlap in (True, False):
        model = parallel_from_dense(dense_init(4, 3), False, torch.float32)
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=600,
                                                                           overlap_grad_reduce=overlap), dp_group)
        events = ddp.comm_events = []

        def mark(name):
            events.append((name, None, time.perf_counter_ns()))

        # The gradient of block 0's output is complete exactly when block 0's backward is about to run.
        def on_forward(mod, inp, out):
            out.register_hook(lambda g: mark("first_block_backward"))

        model.blocks[0].register_forward_hook(on_forward)
        x, t, _ = global_data(0, 2 * B_MICRO)
        with ddp.no_sync():
            ((ddp(x[:, :B_MICRO]) - t[:, :B_MICRO]) ** 2).mean().backward()
        mark("microbatch0_done")
        ((ddp(x[:, B_MICRO:]) - t[:, B_MICRO:]) ** 2).mean().backward()
        mark("backward_done")
        ddp.finish_grad_sync()
        names = [e[0] for e in events]
        launches = [e[1] for e in events if e[0] == "bucket_launch"]
        assert sorted(launches) == list(range(len(ddp.buckets))), f"every bucket launched once: {launches}"
        assert len(ddp.buckets) >= 4, f"small bucket_size should give several buckets, got {len(ddp.buckets)}"
        assert names.index("bucket_launch") > names.index("microbatch0_done"), "no launch inside no_sync()"
        first_block_params = set(model.blocks[0].parameters())
        later_only = {b.index for b in ddp.buckets if not first_block_params & set(b.params)}
        fb = len(names) - 1 - names[::-1].index("first_block_backward")  # the synced microbatch's
        launched_before = {e[1] for e in events[:fb] if e[0] == "bucket_launch"}
        if overlap:
            assert launches[0] == 0, f"bucket 0 (the last layers) must launch first, order {launches}"
            assert later_only and later_only <= launched_before, (
                f"buckets {sorted(later_only)} hold only later blocks and should be in flight before block 0's "
                f"backward starts; launched by then: {sorted(launched_before)}; events {names}")
        else:
            assert names.index("bucket_launch") > names.index("backward_done"), (
                f"overlap_grad_reduce=False must launch nothing during backward: {names}")
        results[overlap] = len(launched_before)
    return results


class _UnusedParamNet(Net):
    def __init__(self):
        super().__init__(lambda: ParallelBlock(False, torch.float32), 1)
        self.unused_gate = nn.Parameter(torch.ones(4))


def _missing_grad_error(dp_group):
    for overlap in (True, False):
        model = _UnusedParamNet()
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=None,
                                                                           overlap_grad_reduce=overlap), dp_group)
        x, t, _ = global_data(0, B_MICRO)
        ((ddp(x) - t) ** 2).mean().backward()
        try:
            ddp.finish_grad_sync()
        except RuntimeError as e:
            assert "unused_gate" in str(e) and "no gradient" in str(e), str(e)
        else:
            raise AssertionError("finish_grad_sync() accepted a bucket with a parameter that got no gradient")
    return True


class _FusedWgradLinear(torch.autograd.Function):
    """What a gradient-accumulation-fusion GEMM does: write the weight grad into main_grad itself."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        w.main_grad.add_(g.reshape(-1, g.size(-1)).t() @ x.reshape(-1, x.size(-1)))
        w.grad_added_to_main_grad = True
        return g @ w, torch.full_like(w, float("nan"))  # must not be added on top


class _FusedNet(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w.clone())
        self.b = nn.Parameter(torch.zeros(w.size(0)))

    def forward(self, x):
        return _FusedWgradLinear.apply(x, self.w) + self.b


def _grad_added_to_main_grad(dp_group, dp, dp_rank):
    torch.manual_seed(4)
    w = torch.randn(6, H)
    x, t, _ = global_data(0, dp * 2 * B_MICRO)
    t = t[..., :6]
    ref = _FusedNet(w)
    ref.w.main_grad = torch.zeros_like(ref.w)  # the reference runs the same Function without DDP
    ((ref(x) - t) ** 2).mean().backward()
    ref_grad_w = ref.w.main_grad
    model = _FusedNet(w)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=None), dp_group)
    for m in range(2):
        cols = slice((dp_rank * 2 + m) * B_MICRO, (dp_rank * 2 + m + 1) * B_MICRO)
        ctx = ddp.no_sync() if m == 0 else contextlib.nullcontext()
        with ctx:
            ((ddp(x[:, cols]) - t[:, cols]) ** 2).mean().div(2).backward()
    ddp.finish_grad_sync()
    err = (model.w.main_grad - ref_grad_w).abs().max().item()
    assert err <= 1e-6, f"fused-wgrad weight: main_grad off by {err:.3g} (dummy grad added?)"
    err = (model.b.main_grad - ref.b.grad).abs().max().item()
    assert err <= 1e-6, f"bias through the normal hook path off by {err:.3g}"
    return True


def _broadcast_params(dp_group, dp_rank):
    torch.manual_seed(100 + dist.get_rank())  # every rank starts different
    model = parallel_from_dense(dense_init(1, 100 + dist.get_rank()), False, torch.float32)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(use_distributed_optimizer=True), dp_group)
    ddp.broadcast_params()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather(gathered, flat, group=dp_group)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "DP ranks differ after broadcast_params()"
    assert set(ddp.state_dict()) == set(model.state_dict()), "DDP state_dict must not add a 'module.' prefix"
    assert not hasattr(ddp, "blocks"), "only the model contract (parallel3d.model_chunk) reaches the module"
    assert ddp.pre_process and ddp.post_process and ddp.shared_embedding_or_output_weight() is None
    return True


def _sweep(rank, world_size):
    done = {}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank makes both
    for layout, tp_size, sp, use_pairs in (("TP1xDP4", 1, False, False), ("TP1xDP2", 1, False, True),
                                           ("TP2xDP2", 2, False, False), ("TP2xDP2+SP", 2, True, False)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
        try:
            dp_group = pairs[rank // 2] if use_pairs else ps.get_data_parallel_group()
            dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
            done[layout] = _training_cases(layout, tp_size, sp, dp_group if use_pairs else None, dp, dp_rank)
            if layout == "TP1xDP4":
                done["overlap"] = _overlap_events(dp_group)
                done["missing"] = _missing_grad_error(dp_group)
            if layout == "TP2xDP2+SP":
                done["two chunks"] = _two_chunk_case(layout, sp, dp, dp_rank)
            if layout == "TP1xDP2":
                done["fused"] = _grad_added_to_main_grad(dp_group, dp, dp_rank)
                done["broadcast"] = _broadcast_params(dp_group, dp_rank)
        finally:
            ps.destroy_model_parallel()
    return done


def test_ddp_training_matches_single_process():
    results = run_distributed(_sweep, 4, timeout=300)
    for r in results:
        assert r["TP1xDP4"][-1] == "bf16 zero1=True" and len(r["TP1xDP4"]) == 6
        assert len(r["TP2xDP2+SP"]) == 5
        assert r["missing"] and r["fused"] and r["broadcast"] and r["two chunks"]
        assert r["overlap"][True] > 0 and r["overlap"][False] == 0
