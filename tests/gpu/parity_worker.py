"""One launch of the parity suite: train each case for a few steps and record what tests/gpu compares.

    torchrun --nproc-per-node N tests/gpu/parity_worker.py CASES.json OUT_DIR

Started by tests/gpu/test_nccl_parity.py (one process per GPU, NCCL) and, to prove the same driver on
CPU ranks, with PARALLEL3D_DEVICE=cpu (gloo). CASES.json is a list of cases
``{"name", "kind", "family", "dtype", "tp", "pp", "vp", "sp", "extra"}``, ``dtype`` a key of PRECISIONS:
- ``reference`` (one process): save the weights, losses and gradient norms as OUT_DIR/ref_<family>_<dtype>.*;
  with ``"against": DTYPE``, also how far its weights are from that reference (run earlier in the same
  list): an FP8 reference against bf16 measures what FP8 changes;
- ``layout``: train in the case's layout and write, per rank, each iteration's losses and gradient norm and
  how far every weight shard is from the reference of the same family and precision;
- ``resume``: 6 iterations straight, then 3 + save + load + 3 in the same layout (dropout on).
Each rank writes OUT_DIR/<name>.rank<r>.json. The last line printed is "parity: done", so the test can
time how long the job takes to exit after its work.
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpt_harness import full_weights, layout_args, shards_against, train  # noqa: E402
from parallel3d import parallel_state as ps  # noqa: E402
from parallel3d import symmetric_memory  # noqa: E402
from parallel3d.device import default_backend  # noqa: E402


# A case's precision -> its flags. FP8 computes the TP linears' GEMMs in FP8 on a bf16 model (Megatron's
# flags; torchao's recipes of those names: tensorwise keeps e5m2 gradients, rowwise is e4m3 throughout).
PRECISIONS = {
    "fp32": [],
    "bf16": ["--bf16"],
    "fp8-tensorwise": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8-delayed": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
                    "--fp8-amax-compute-algo", "max"],
    "fp8-rowwise": ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
}


def _args(case, world, **kw):
    return layout_args(case["family"], case["tp"], case["pp"], case["vp"], case["sp"],
                       PRECISIONS[case["dtype"]] + case["extra"], world=world, **kw)


def _losses(result):
    return [d["lm loss"] for d in result["losses"]]


def _weights_against(result, out, family, dtype):
    """{weight name: how far this rank's shard is from the ``dtype`` reference's}."""
    ref = load_file(os.path.join(out, f"ref_{family}_{dtype}.safetensors"))
    weights = {}
    for name, got, want in shards_against(result, ref):
        diff = got.float() - want
        weights[name] = {"max_abs": diff.abs().max().item(), "diff_sq": diff.square().sum().item(),
                         "ref_sq": want.float().square().sum().item()}
    return weights


def reference(case, out):
    result = train(_args(case, 1))
    stem = os.path.join(out, f"ref_{case['family']}_{case['dtype']}")
    save_file({n: t.float().cpu().contiguous() for n, t in full_weights(result).items()}, stem + ".safetensors")
    record = {"losses": _losses(result), "grad_norms": result["grad_norms"]}
    if "against" in case:
        record["weights"] = _weights_against(result, out, case["family"], case["against"])
    return record


def layout(case, out):
    result = train(_args(case, dist.get_world_size()))
    return {"losses": _losses(result), "grad_norms": result["grad_norms"],
            "weights": _weights_against(result, out, case["family"], case["dtype"]),
            "cuda_graph_replays": result["cuda_graph_replays"]}


def resume(case, out):
    save_dir = os.path.join(out, f"{case['name']}_ckpt")
    runs = {}
    for name in ("straight", "first", "resumed"):
        args = _args(case, dist.get_world_size(), iters=6, dropout=0.1)
        if name == "first":  # a job of 6 iterations stopped after 3 (the LR schedule of the straight run)
            args.save, args.save_interval, args.exit_interval = save_dir, 3, 3
        if name == "resumed":
            args.load = save_dir
        ps.initialize_model_parallel(case["tp"], case["pp"], args.virtual_pipeline_model_parallel_size)
        try:
            runs[name] = _losses(train(args))
        finally:
            ps.destroy_model_parallel()
    return runs


def main() -> None:
    cases_file, out = sys.argv[1], sys.argv[2]
    with open(cases_file) as f:
        cases = json.load(f)
    if default_backend() == "nccl":  # bind the rank to its GPU before NCCL creates a communicator
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        symmetric_memory.nccl_environment_defaults()  # the training application's NCCL policy
    dist.init_process_group(default_backend(), timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    for case in cases:
        if case["kind"] == "resume":
            record = resume(case, out)
        else:
            # the symmetric gathers wherever NCCL has them, eager cases too: the path must train like one GPU
            ps.initialize_model_parallel(case["tp"], case["pp"],
                                         case["vp"] if case["vp"] and case["vp"] > 1 else None,
                                         tp_symmetric_gathers=None)
            try:
                record = (reference if case["kind"] == "reference" else layout)(case, out)
            finally:
                ps.destroy_model_parallel()
        with open(os.path.join(out, f"{case['name']}.rank{rank}.json"), "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()
    print("parity: done", flush=True)


if __name__ == "__main__":
    from parallel3d.lifetime import exit_after_run, exit_with_launcher

    exit_with_launcher()  # a worker must not outlive a killed torchrun (parallel3d/lifetime.py)
    main()
    # its records are written: end as the training script does, without interpreter finalization, where one
    # rank of a finished 4-GPU launch once died of SIGSEGV after "parity: done" (4 x H200, 2026-11-28)
    exit_after_run(0)
