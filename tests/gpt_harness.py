"""A small GPT trained through parallel3d.training.gpt's model, forward step and loss (those that
examples/pretrain_gpt.py trains), for the layout tests: the CPU sweep (tests/test_gpt_training.py) and
the GPU suite (tests/gpu/).

``train(args)`` runs ``pretrain`` on deterministic random tokens in whatever layout
``parallel_state`` was initialised with (or one process). ``layout_args`` builds the arguments of
one layout; every layout of one family and precision trains the same model on the same data.
"""
import io
import os
from contextlib import redirect_stdout
from functools import partial

import torch

from parallel3d import parallel_state as ps
from parallel3d.training.arguments import parse_args, validate_args
from parallel3d.tensor_parallel import model_parallel_cuda_manual_seed, split_tensor_for_rank
from parallel3d.training import gpt, pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB, SEQ, MBS, GBS, ITERS = 300, 16, 2, 16, 3
FAMILIES = {
    "gpt2": ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4"],
    "llama": ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
              "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
              "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
}


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic random token sequences in GPTDataset's item format."""

    def __init__(self, n: int, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        t = self.tokens[i]
        return {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(SEQ),
                "position_ids": torch.arange(SEQ)}


def layout_args(family, tp=1, pp=1, vp=None, sp=False, extra=(), world=1, iters=ITERS, dropout=0.0):
    argv = FAMILIES[family] + [
        "--seq-length", str(SEQ), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
        "--train-iters", str(iters), "--lr", "1e-2", "--lr-warmup-iters", "1", "--min-lr", "1e-3",
        "--clip-grad", "0.5", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "16",
        "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout), "--log-interval", "1000",
        "--eval-interval", "1000", "--no-progress-bar", "--seed", "5",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
    ] + (["--virtual-pipeline-model-parallel-size", str(vp)] if vp and vp > 1 else []) \
      + (["--sequence-parallel"] if sp else []) + list(extra)
    return validate_args(parse_args(argv, extra_args_provider=gpt.add_sampling_args), world)


def train(args, dataset_size=GBS * ITERS * 2):
    config = gpt.transformer_config_from_args(args)
    partition = gpt.layer_partition(args, config)
    seed = args.seed + 100 * ps.resolve_parallel_state().pipeline_model_parallel_rank
    torch.manual_seed(seed)  # what training.initialize_distributed seeds
    model_parallel_cuda_manual_seed(seed)
    with redirect_stdout(io.StringIO()):
        result = pretrain(args, partial(gpt.model_provider, config, partition),
                          partial(gpt.forward_step, args.calculate_per_token_loss),
                          lambda n: (TokenDataset(dataset_size), None, None), model_config=config,
                          layer_numbers=[[list(r) for r in chunks] for chunks in partition])  # as pretrain_gpt.py
    return result


def full_weights(result) -> dict:
    """{global parameter name: tensor} of a one-process run."""
    model = result["model"][0].module
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def shards_against(result, ref_weights: dict):
    """(global name, this rank's shard, the reference's slice for it) for every local parameter."""
    state = ps.resolve_parallel_state()
    tp_rank, tp = state.tensor_model_parallel_rank, state.tensor_model_parallel_size
    for chunk in result["model"]:
        module = chunk.module
        for name, p in module.named_parameters():
            global_name = module.global_parameter_name(name)
            full = ref_weights[global_name].to(p.device)
            if getattr(p, "tensor_model_parallel", False):
                full = split_tensor_for_rank(full, p.partition_dim, p.partition_stride, tp_rank, tp,
                                             padded_size=p.size(p.partition_dim) * tp)
            yield global_name, p.detach(), full


def assert_trains_like(result, reference, where: str) -> None:
    """``result`` (this rank's) equals the one-process ``reference`` (losses, gradient norms, full weights):
    per-iteration losses and gradient norms within 1e-5 (relative above 1), every weight within 2e-5."""
    ref_losses, ref_norms, ref_weights = reference
    for it, (got, want) in enumerate(zip(result["losses"], ref_losses)):
        for key in want:
            err = abs(got[key] - want[key])
            assert err <= 1e-5 * max(1.0, abs(want[key])), f"{where} iteration {it + 1} {key}: {got} vs {want}"
    for it, (got, want) in enumerate(zip(result["grad_norms"], ref_norms)):
        assert abs(got - want) <= 1e-5 * max(1.0, want), f"{where} iteration {it + 1} grad norm: {got} vs {want}"
    for name, got, want in shards_against(result, ref_weights):
        err = (got - want).abs().max().item()
        assert err <= 2e-5, f"{where} weight {name} differs from the single process by {err:.3g}"
