"""Embed parallel3d's tensor-parallel layers, and its pipeline, in your own model.

    torchrun --nproc-per-node 4 examples/custom_model_tp.py

Builds a small model whose MLP and attention are split over the TP ranks, trains
it for a few steps next to the same model built densely in every process, and
prints whether the two agree. Then splits a two-block model over TP=2 x PP=2 and
trains it with parallel3d's pipeline schedule, DDP, finalize_model_grads and
optimizer: the chunk implements parallel3d.model_chunk.PipelineChunk (pre_process,
post_process, set_input_tensor, share_embeddings_and_output_weights,
shared_embedding_or_output_weight) and nothing else. Runs on CPUs (gloo) or GPUs (nccl).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
if __name__ == "__main__":
    from parallel3d.bootstrap import reexec_unless_ready  # noqa: E402
    reexec_unless_ready(__file__)  # this Python lacks torch & co: run inside .venv, as the demo does

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d import parallel_state as ps  # noqa: E402
from parallel3d.device import default_backend  # noqa: E402
from parallel3d import tensor_parallel as tp  # noqa: E402
from parallel3d.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    finalize_model_grads,
    get_megatron_optimizer,
)
from parallel3d.pipeline import forward_backward  # noqa: E402

HIDDEN, HEADS, FFN, SEQ, BATCH, STEPS = 64, 8, 256, 16, 4, 5


class ParallelBlock(nn.Module):
    """Pre-norm transformer block: attention heads and MLP columns split across TP."""

    def __init__(self):
        super().__init__()
        tp_size = ps.get_tensor_model_parallel_world_size()
        self.heads = tp.divide(HEADS, tp_size, "attention heads")
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = tp.ColumnParallelLinear(HIDDEN, 3 * HIDDEN, stride=3)  # [q; k; v], each split by heads
        self.proj = tp.RowParallelLinear(HIDDEN, HIDDEN)
        self.fc1 = tp.ColumnParallelLinear(HIDDEN, FFN)
        self.fc2 = tp.RowParallelLinear(FFN, HIDDEN)

    def forward(self, x):  # x: [s, b, h], replicated on the TP ranks
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x))[0].chunk(3, dim=-1)
        split = lambda t: t.reshape(s, b, self.heads, -1).permute(1, 2, 0, 3)  # noqa: E731
        attn = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.proj(attn.permute(2, 0, 1, 3).reshape(s, b, -1))[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))[0]))[0]


class DenseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        split = lambda t: t.reshape(s, b, HEADS, -1).permute(1, 2, 0, 3)  # noqa: E731
        attn = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.proj(attn.permute(2, 0, 1, 3).reshape(s, b, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class StageChunk(nn.Module):
    """One pipeline stage of the two-block model: the whole model contract parallel3d calls."""

    share_embeddings_and_output_weights = False  # no weight held by both the first and the last stage

    def __init__(self, pre_process: bool, post_process: bool):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.block = ParallelBlock()
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):  # what the previous stage sent (None on the first)
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self):
        return None

    def forward(self, x):
        return self.block(x if self.pre_process else self.input_tensor)


def train_tp_pp(steps: int = STEPS, microbatches: int = 2) -> bool:
    """TP=2 x PP=2: each stage holds one block; the same two blocks are trained densely everywhere."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    state = ps.resolve_parallel_state()
    stage, tp_rank = state.pipeline_model_parallel_rank, state.tensor_model_parallel_rank
    torch.manual_seed(0)
    dense = nn.Sequential(DenseBlock(), DenseBlock())  # the reference; each stage copies its block's slice
    chunk = StageChunk(pre_process=stage == 0, post_process=stage == 1).to(next(dense.parameters()).device)
    with torch.no_grad():
        for p, d in zip(chunk.block.parameters(), dense[stage].parameters()):
            p.copy_(tp.split_tensor_for_rank(d, p.partition_dim, p.partition_stride, tp_rank, 2)
                    if getattr(p, "tensor_model_parallel", False) else d)
    model = DistributedDataParallel(chunk, DistributedDataParallelConfig())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0,
                                                 clip_grad=0.0), [model])
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.1)
    worst = 0.0
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, device=chunk.block.qkv.weight.device)
        target = torch.randn_like(x)
        batches = iter(zip(x.chunk(microbatches, dim=1), target.chunk(microbatches, dim=1)))

        def forward_step(data_iterator, model):
            xb, tb = next(data_iterator)
            return model(xb), lambda out: (F.mse_loss(out, tb), {"loss": F.mse_loss(out, tb).detach()})

        model.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=batches, model=[model],
                                  num_microbatches=microbatches, tensor_shape=(SEQ, BATCH // microbatches, HIDDEN),
                                  finalize_model_grads_func=finalize_model_grads)
        opt.step()
        opt_dense.zero_grad()
        loss_dense = F.mse_loss(dense(x), target)
        loss_dense.backward()
        opt_dense.step()
        if chunk.post_process:  # the last stage holds the losses
            loss_par = sum(d["loss"].item() for d in losses) / microbatches
            worst = max(worst, abs(loss_par - loss_dense.item()))
    result = torch.tensor([worst])
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    ok = result.item() < 1e-4
    if dist.get_rank() == 0:
        print(f"TP=2 x PP=2: {'matches' if ok else 'DOES NOT match'} the dense model "
              f"(largest loss difference {result.item():.2e} over {steps} SGD steps)")
    ps.destroy_model_parallel()
    return ok


def main() -> None:
    backend = default_backend()
    if backend == "nccl":  # bind the rank to its GPU before NCCL creates a communicator
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    world = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    rank = ps.get_tensor_model_parallel_rank()

    torch.manual_seed(0)
    par = ParallelBlock()
    # Same weights densely: each parallel layer initialised the full matrix from the
    # global RNG and kept its slice; gather the slices back into a dense copy.
    dense = DenseBlock().to(par.qkv.weight.device)
    with torch.no_grad():
        for (name, p), (_, d) in zip(par.named_parameters(), dense.named_parameters()):
            if getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(parts, p.contiguous(), group=ps.get_tensor_model_parallel_group())
                stride = p.partition_stride
                blocks = [part.chunk(stride, dim=p.partition_dim) for part in parts]
                d.copy_(torch.cat([blk[i] for i in range(stride) for blk in blocks], dim=p.partition_dim))
            else:
                d.copy_(p)

    opt_par = torch.optim.SGD(par.parameters(), lr=0.1)
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.1)
    worst = 0.0
    for step in range(STEPS):
        torch.manual_seed(100 + step)  # same batch on every rank
        x = torch.randn(SEQ, BATCH, HIDDEN, device=par.qkv.weight.device)
        target = torch.randn_like(x)
        for model, opt in ((par, opt_par), (dense, opt_dense)):
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            if model is par:
                loss_par = loss.item()
            else:
                loss_dense = loss.item()
        worst = max(worst, abs(loss_par - loss_dense))
        if rank == 0:
            print(f"step {step}: loss tensor-parallel {loss_par:.6f}  dense {loss_dense:.6f}")
    ok = worst < 1e-4
    if rank == 0:
        print(f"TP={world}: {'matches' if ok else 'DOES NOT match'} the dense model "
              f"(largest loss difference {worst:.2e} over {STEPS} SGD steps)")
    ps.destroy_model_parallel()
    if world == 4:
        ok = train_tp_pp() and ok
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
