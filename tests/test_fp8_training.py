"""FP8 training (emulated on the CPU) in every layout equals one process with the same FP8 settings."""
import io

import pytest
import torch

pytest.importorskip("torchao")

from gpt_harness import full_weights, layout_args, shards_against, train  # noqa: E402
from parallel3d import parallel_state as ps  # noqa: E402
from parallel3d.testing import run_distributed  # noqa: E402

FP8 = {
    "delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max"),
    "tensorwise": dict(fp8="hybrid", fp8_recipe="tensorwise"),
    "rowwise": dict(fp8="e4m3", fp8_recipe="rowwise"),
}
# (family, FP8 recipe, TP, PP, V, SP, extra flags); world size 8, DP = 8 / (TP * PP)
LAYOUTS = [
    ("gpt2", "delayed", 2, 2, 1, True, ["--use-distributed-optimizer", "--recompute-granularity", "full"]),
    ("gpt2", "tensorwise", 2, 2, 1, True, ["--pipeline-schedule", "zb-h1", "--overlap-grad-reduce"]),
    ("llama", "rowwise", 2, 2, 2, True, ["--use-distributed-optimizer"]),
]


def _args(family, recipe, *layout, world=1, **kw):
    args = layout_args(family, *layout, world=world, **kw)
    for k, v in FP8[recipe].items():
        setattr(args, k, v)
    return args


def _reference(family, recipe):
    result = train(_args(family, recipe))
    return result["losses"], result["grad_norms"], full_weights(result)


def _sweep(rank, world_size, refs_bytes):
    refs = torch.load(io.BytesIO(refs_bytes), weights_only=True)
    out = []
    for family, recipe, tp, pp, vp, sp, extra in LAYOUTS:
        args = _args(family, recipe, tp, pp, vp, sp, extra, world=world_size)
        ps.initialize_model_parallel(tp, pp, args.virtual_pipeline_model_parallel_size)
        try:
            result = train(args)
            ref_losses, ref_norms, ref_weights = refs[family, recipe]
            loss = max(abs(g["lm loss"] - w["lm loss"]) for g, w in zip(result["losses"], ref_losses))
            norm = max(abs(g - w) for g, w in zip(result["grad_norms"], ref_norms))
            weight = max((got - want).abs().max().item() for _, got, want in shards_against(result, ref_weights))
            out.append((family, recipe, loss, norm, weight))
        finally:
            ps.destroy_model_parallel()
    return out


def test_fp8_layouts_train_like_a_single_process():
    refs = {(f, r): _reference(f, r) for f, r, *_ in LAYOUTS}
    buffer = io.BytesIO()  # bytes, not tensors: each tensor would travel as a file descriptor
    torch.save(refs, buffer)
    results = run_distributed(_sweep, 8, args=(buffer.getvalue(),), timeout=600)
    for r in results:
        print(r)
