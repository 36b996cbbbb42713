"""finalize_model_grads' first-step check: replicated parameters agree across TP ranks and the tied
embedding's copies agree across pipeline stages, else one line naming the parameter (every rank)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d import tensor_parallel as tp
from parallel3d.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from parallel3d.testing import run_distributed

S, B, H = 4, 2, 8


class SPBlock(nn.Module):
    """norm -> column -> gelu -> row, all on a sequence-parallel shard [s/tp, b, h]."""

    def __init__(self, mark_norm: bool, norm_seed: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = tp.ColumnParallelLinear(H, 2 * H, sequence_parallel=True)
        self.fc2 = tp.RowParallelLinear(2 * H, H, sequence_parallel=True)
        torch.manual_seed(norm_seed)
        self.norm = nn.LayerNorm(H)
        nn.init.normal_(self.norm.weight)
        if mark_norm:
            for p in self.norm.parameters():
                p.sequence_parallel = True

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))[0]))[0]


def _one_step(model):
    torch.manual_seed(5)
    x = torch.randn(S, B, H)
    shard = x.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig())
    ddp(shard).square().sum().backward()
    finalize_model_grads([ddp])
    return ddp


def _tp2_worker(rank, world_size, case):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        if case == "marked":
            ddp = _one_step(SPBlock(mark_norm=True))
            finalize_model_grads([ddp])  # a second call does not check again (and still works)
        elif case == "unmarked":
            with pytest.raises(ValueError, match=r"replicated parameter 'norm.weight' \(model chunk 0\) has different "
                                                 r"gradients on tensor-parallel ranks \[0, 1\]: mark it "
                                                 r"\.sequence_parallel = True"):
                _one_step(SPBlock(mark_norm=False))
        elif case == "seeded_per_rank":
            with pytest.raises(ValueError, match=r"replicated parameter 'norm.weight' \(model chunk 0\) has different "
                                                 r"values"):
                _one_step(SPBlock(mark_norm=True, norm_seed=rank))
    finally:
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("case", ["marked", "unmarked", "seeded_per_rank"])
def test_replicated_parameters_agree_across_tensor_parallel_ranks(case):
    assert run_distributed(_tp2_worker, 2, args=(case,), timeout=60) == [True, True]


class TiedEnd(nn.Module):
    """One end of a two-stage model whose first and last stage hold a tied [vocab, h] weight."""
    share_embeddings_and_output_weights = True

    def __init__(self, stage, seed):
        super().__init__()
        self.pre_process, self.post_process = stage == 0, stage == 1
        torch.manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(6, H))

    def shared_embedding_or_output_weight(self):
        return self.weight

    def forward(self, x):
        return x @ self.weight.t()


def _pp2_worker(rank, world_size, same_init):
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        ddp = DistributedDataParallel(TiedEnd(rank, seed=0 if same_init else rank), DistributedDataParallelConfig())
        ddp(torch.ones(3, H)).sum().backward()
        if same_init:
            finalize_model_grads([ddp])
        else:
            with pytest.raises(ValueError, match=r"the tied embedding weight \(shared_embedding_or_output_weight\) "
                                                 r"differs between the first and the last pipeline stage "
                                                 r"\(ranks \[0, 1\]\)"):
                finalize_model_grads([ddp])
    finally:
        ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("same_init", [True, False])
def test_tied_copies_agree_across_stages(same_init):
    assert run_distributed(_pp2_worker, 2, args=(same_init,), timeout=60) == [True, True]
