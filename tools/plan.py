"""Plan a training layout before renting the cluster: predicted step time, throughput and memory.

    python3 tools/plan.py --num-layers 80 --hidden-size 8192 --num-attention-heads 64 \\
        --num-query-groups 8 --seq-length 4096 --global-batch-size 1024 --cluster h100-8x64

Search mode (no layout given) lists the fastest layouts that fit in memory; giving
--tensor-model-parallel-size, --pipeline-model-parallel-size, --micro-batch-size, ... evaluates
that layout.  --json prints machine-readable results.  The model is parallel3d.planning
(docs/planning.md); --cluster-file takes the JSON that bench/calibrate_planner.py writes.

A whole pretrain_gpt.py command line is accepted too: the training flags that do not change the
plan (--train-iters, --lr, --save, ...) are checked as pretrain_gpt.py would and ignored.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __package__ in (None, ""):
    from parallel3d.bootstrap import reexec_unless_ready  # noqa: E402
    reexec_unless_ready(__file__)  # this Python lacks torch & co: run inside .venv, as the demo does

from parallel3d.models.config import megatron_ffn_hidden_size  # noqa: E402
from parallel3d.training.megatron_args import ATTENTION_BACKENDS  # noqa: E402
from parallel3d.pipeline.registry import SCHEDULE_NAMES, build_schedule  # noqa: E402
from parallel3d.pipeline.simulate import simulate  # noqa: E402
from parallel3d.pipeline.visualize import text_timeline  # noqa: E402
from parallel3d.planning import PRESETS, Layout, ModelSpec, StepEstimate, estimate, get_cluster, load_cluster  # noqa: E402
from parallel3d.planning.search import search  # noqa: E402
from parallel3d.training.arguments import build_parser as training_parser  # noqa: E402
from parallel3d.training.gpt import add_sampling_args  # noqa: E402

LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                "micro_batch_size", "recompute_granularity", "pipeline_schedule")


# pretrain_gpt.py's flags that change the step but that the planner does not model: said, not silently ignored.
UNMODELLED = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def _training_flags(rest: list[str], p: argparse.ArgumentParser) -> None:
    """Check the flags plan.py has no use for as pretrain_gpt.py's (a typo is still refused); note the
    ones that would change the step without the planner knowing."""
    training = training_parser()
    add_sampling_args(training)  # examples/pretrain_gpt.py's own two flags
    known, unknown = training.parse_known_args(rest)
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    defaults = vars(training.parse_args([]))
    unmodelled = [f"--{k.replace('_', '-')}" for k in UNMODELLED if getattr(known, k) != defaults[k]]
    if (known.recompute_method, known.recompute_num_layers) not in ((None, None), ("uniform", 1)):
        unmodelled.append("--recompute-method / --recompute-num-layers (full recompute is priced per layer)")
    if unmodelled:
        print(f"note: the plan splits the layers its own way; {', '.join(unmodelled)} not modelled", file=sys.stderr)
    if known.fp8 is not None:
        print(f"note: --fp8-format {known.fp8} not modelled: the plan prices bf16 GEMMs", file=sys.stderr)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    g = p.add_argument_group("model (Megatron's names)")
    for name in ("num-layers", "hidden-size", "num-attention-heads", "seq-length"):
        g.add_argument(f"--{name}", type=int, required=True)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=32000)
    g.add_argument("--padded-vocab-size", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="Megatron's default, as pretrain_gpt.py's (0 for LLaMA-style runs)")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="learned position table (default: "
                   "--seq-length)")
    g.add_argument("--attention-backend", choices=sorted(ATTENTION_BACKENDS), default="auto",
                   help="Megatron's values: unfused / local keep the softmax scores in memory, the others use SDPA")
    g.add_argument("--group-query-attention", action="store_true", help="accepted: --num-query-groups says it")
    t = p.add_argument_group("training and layout")
    t.add_argument("--global-batch-size", type=int, required=True)
    t.add_argument("--micro-batch-size", type=int, default=None)
    t.add_argument("--tensor-model-parallel-size", type=int, default=None)
    t.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    t.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    t.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="= --num-layers-per-virtual-pipeline-stage num-layers / (PP x this)")
    t.add_argument("--pipeline-split", choices=["balanced", "even"], default="balanced")
    t.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, default=None,
                   help="as pretrain_gpt.py's (default: 1f1b, interleaved-1f1b with virtual stages); the search "
                        "tries every schedule when none is given")
    t.add_argument("--recompute-granularity", choices=["none", "selective", "full"], default=None)
    t.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")
    t.add_argument("--sequence-parallel", action="store_true")
    t.add_argument("--use-distributed-optimizer", action="store_true")
    t.add_argument("--overlap-grad-reduce", action="store_true")
    t.add_argument("--enable-cuda-graph", action="store_true", help="the layers replayed as CUDA graphs (1F1B or "
                   "interleaved schedules); training's default for TP > 1 where a graph holds the run")
    t.add_argument("--cuda-graph-impl", choices=["none", "local", "transformer_engine"], default=None,
                   help="as pretrain_gpt.py's: none keeps the layers eager; local / transformer_engine = "
                        "--enable-cuda-graph")
    t.add_argument("--bf16", action="store_true", default=True, help="bf16 params, fp32 grads/masters (default)")
    t.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 everything")
    t.add_argument("--fp16", dest="bf16", action="store_true", help="as --bf16: the same bytes per value")
    t.add_argument("--num-gpus", type=int, default=None, help="default: the whole cluster")
    c = p.add_argument_group("cluster and output")
    c.add_argument("--cluster", default=None, help=f"preset: {', '.join(sorted(PRESETS))}")
    c.add_argument("--cluster-file", default=None, help="JSON written by bench/calibrate_planner.py")
    c.add_argument("--top", type=int, default=5)
    c.add_argument("--json", action="store_true")
    c.add_argument("--timeline", action="store_true", help="draw the timeline even for PP > 16")
    args, rest = p.parse_known_args(argv)
    if rest:
        _training_flags(rest, p)
    if args.cluster and args.cluster_file:
        p.error("give --cluster or --cluster-file, not both")
    args.attention_backend = ATTENTION_BACKENDS[args.attention_backend]  # the model config's name
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    vp = args.virtual_pipeline_model_parallel_size
    if vp and vp > 1:
        stages = (args.pipeline_model_parallel_size or 1) * vp
        if args.num_layers_per_virtual_pipeline_stage is not None or args.num_layers % stages:
            p.error(f"--virtual-pipeline-model-parallel-size {vp}: give it without --num-layers-per-virtual-"
                    f"pipeline-stage, with --num-layers ({args.num_layers}) a multiple of PP x {vp}")
        args.num_layers_per_virtual_pipeline_stage = args.num_layers // stages
    return args


def model_from(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, vocab_size=args.vocab_size, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size or megatron_ffn_hidden_size(args.hidden_size, args.swiglu),
        kv_channels=args.kv_channels, swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear, normalization=args.normalization,
        position_embedding_type=args.position_embedding_type,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, padded_vocab_size=args.padded_vocab_size,
        hidden_dropout=args.hidden_dropout, attention_backend=args.attention_backend,
        max_position_embeddings=args.max_position_embeddings)


def timeline(est: StepEstimate) -> str:
    """The chosen schedule on the text grid of parallel3d.pipeline.visualize.

    Costs are rounded to whole units of the shortest forward so the grid stays narrow, and
    at most 2 x PP microbatches (PP when interleaved) are drawn: past them every schedule
    repeats its steady step.
    """
    L, m = est.layout, est.model
    P, V = L.pp, L.virtual_stages(m)
    M = P if V > 1 else min(L.num_microbatches, 2 * P)
    sim = est.pipeline.sim
    costs = {}
    for rank, tl in enumerate(sim.timelines):
        for start, end, a in tl:
            costs.setdefault((rank, a.chunk), {})[a.kind] = end - start
    unit = min(c["F"] for c in costs.values())
    # (F, B) per (rank, chunk), or (F, B, W) where the schedule splits the backward
    q = [[tuple(max(1, round(costs[(r, c)][k] / unit)) for k in "FBW" if k in costs[(r, c)]) for c in range(V)]
         for r in range(P)]
    schedule = build_schedule(L.schedule_name(m), P, M, V, hidden_size=m.hidden_size, seq_length=m.seq_length)
    result = simulate(schedule, stage_costs=q)  # as the estimate simulates
    return (f"timeline of {M} of {L.num_microbatches} microbatches, 1 column = {unit * 1e3:.1f} ms "
            f"(F/B/W = forward / backward / weight gradient of microbatch.chunk, '.' = idle):\n"
            + text_timeline(result))


def report(est: StepEstimate, out=None, draw: bool = True, force_timeline: bool = False) -> None:
    out = out or sys.stdout
    d = est.as_dict()
    print(f"layout {est.layout.describe(est.model)} on {est.layout.num_gpus} GPUs, schedule {d['schedule']}, "
          f"{d['num_microbatches']} microbatches", file=out)
    print(f"  step {d['step_time_s']:.3f} s, {d['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
          f"{d['tflops_per_gpu']:.0f} TFLOP/s/GPU (MFU {100 * d['mfu']:.1f}%), peak memory "
          f"{d['peak_memory_gb']:.1f} GiB, {'fits' if d['fits'] else 'DOES NOT FIT'}", file=out)
    b = d["step_breakdown_s"]
    print("  step breakdown (critical rank): " + ", ".join(f"{k} {v:.3f} s ({100 * v / d['step_time_s']:.0f}%)"
                                                             for k, v in b.items()), file=out)
    for rank in sorted({0, est.layout.pp - 1}):
        mem = d["memory_gb_per_stage"][rank]
        print(f"  memory stage {rank} (GiB): params {mem['params']:.1f}, grads {mem['grads']:.1f}, optimizer "
              f"{mem['optimizer']:.1f}, activations {mem['activations']:.1f} ({mem['inflight_microbatches']} "
              f"in flight), transient {mem['transient']:.1f}, peak {mem['peak']:.1f} (+{100 * est.cluster.fragmentation:.0f}% "
              f"allocator, +{est.cluster.context_gib:g} GiB context vs {est.cluster.memory_gib:g} GiB)", file=out)
    for w in est.warnings:
        print(f"  warning: {w}", file=out)
    if draw and est.layout.pp > 1:
        if est.layout.pp <= 16 or force_timeline:
            print(timeline(est), file=out)
        else:
            print(f"  (timeline of PP={est.layout.pp} omitted; --timeline draws it)", file=out)


def _default_graphs(model, layout: Layout) -> Layout:
    """Training's default (arguments.py): a TP run replays its layers as CUDA graphs where a graph holds it."""
    graphed = replace(layout, enable_cuda_graph=True)
    try:
        graphed.check(model)
    except ValueError:
        return layout
    return graphed


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        cluster = load_cluster(args.cluster_file) if args.cluster_file else get_cluster(args.cluster or "h100-sxm")
        model = model_from(args)
        num_gpus = args.num_gpus or cluster.num_gpus
        rc = None if args.recompute_granularity in (None, "none") else args.recompute_granularity
        base = Layout(global_batch_size=args.global_batch_size, bf16=args.bf16,
                      overlap_grad_reduce=args.overlap_grad_reduce, pipeline_split=args.pipeline_split,
                      enable_cuda_graph=args.enable_cuda_graph or args.cuda_graph_impl not in (None, "none"))
        given = {k: getattr(args, k) for k in LAYOUT_FLAGS if getattr(args, k) is not None}
        if args.tensor_model_parallel_size or args.pipeline_model_parallel_size:  # evaluate mode
            tp, pp = args.tensor_model_parallel_size or 1, args.pipeline_model_parallel_size or 1
            if num_gpus % (tp * pp):
                raise ValueError(f"--num-gpus {num_gpus} is not a multiple of TP x PP = {tp * pp}")
            layout = replace(base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             data_parallel_size=num_gpus // (tp * pp), micro_batch_size=args.micro_batch_size or 1,
                             num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
                             recompute_granularity=rc, sequence_parallel=args.sequence_parallel,
                             use_distributed_optimizer=args.use_distributed_optimizer,
                             pipeline_schedule=args.pipeline_schedule)
            if tp > 1 and args.cuda_graph_impl is None and not layout.enable_cuda_graph:
                layout = _default_graphs(model, layout)
            results, header = [estimate(model, layout, cluster)], None
        else:
            fixed = {k: v for k, v in given.items() if k in ("micro_batch_size", "recompute_granularity",
                                                             "pipeline_schedule")}
            if "recompute_granularity" in fixed:
                fixed["recompute_granularity"] = rc
            found = search(model, cluster, num_gpus, base, args.top, fixed)
            results = found.best
            header = (f"{found.considered} layouts of {model.total_params() / 1e9:.1f}B parameters on {num_gpus} "
                      f"GPUs of {cluster.name}; {found.simulated} simulated, {found.not_fitting} do not fit")
            if not found.considered:
                for why in found.skipped:
                    print(f"warning: no layout can be modelled: {why}", file=sys.stderr)
    except (ValueError, OSError) as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"cluster": cluster.name, "num_gpus": num_gpus, "layouts": [r.as_dict() for r in results]},
                         indent=1))
        return 0
    if header:
        print(header)
        if not results:
            print("no layout fits in memory: try more GPUs, --recompute-granularity full or a smaller micro-batch")
            return 1
        print(f"\n{'#':>2} {'layout':<48} {'tokens/s/GPU':>12} {'TFLOP/s':>8} {'step s':>8} {'mem GiB':>8}")
        for i, r in enumerate(results):
            print(f"{i + 1:>2} {r.layout.describe(model):<48} {r.tokens_per_s_per_gpu:>12,.0f} "
                  f"{r.tflops_per_gpu:>8.0f} {r.step_time_s:>8.3f} {r.peak_memory_gib:>8.1f}")
        print("\nbest:")
    report(results[0], draw=True, force_timeline=args.timeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
