"""SC21 (Narayanan et al. 2021) Table 1 and Figure 12 settings, for the planner's reproduction test
(tests/test_planning.py; docs/planning.md shows the results).

Parallel sizes, micro-batch sizes and interleaving are those of Megatron-LM's
examples/sc21/run_table_1.sh and run_figure_12.sh (full recompute, "uniform" method).  The
paper's software ran unfused attention (scores in memory, fused masked softmax), fp16 with fp32
gradient buffers, dropout 0.1, its scatter-gather pipeline send, and did not overlap the
data-parallel all-reduce with the backward: the layouts below say so.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel3d.planning.hardware import ClusterSpec, get_cluster
from parallel3d.planning.model import Layout, ModelSpec, sc21_flops
from parallel3d.planning.step import StepEstimate, estimate


@dataclass(frozen=True)
class SC21Row:
    name: str
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    layers_per_virtual_stage: int | None
    published_tflops: float


TABLE_1 = [
    SC21Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, None, 137),
    SC21Row("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 8, None, 135),
    SC21Row("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 2, 5, 148),
    SC21Row("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 1, 1, 163),
    SC21Row("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 1, None, 163),
]


def sc21_model(row: SC21Row) -> ModelSpec:
    return ModelSpec(num_layers=row.layers, hidden_size=row.hidden, num_attention_heads=row.heads,
                     seq_length=2048, vocab_size=51200, padded_vocab_size=51200, hidden_dropout=0.1,
                     attention_backend="local")


def sc21_layout(row: SC21Row, batch: int | None = None, interleaved: bool = True) -> Layout:
    return Layout(tensor_model_parallel_size=row.tp, pipeline_model_parallel_size=row.pp,
                  num_layers_per_virtual_pipeline_stage=row.layers_per_virtual_stage if interleaved else None,
                  data_parallel_size=row.gpus // (row.tp * row.pp), micro_batch_size=row.micro_batch,
                  global_batch_size=batch or row.batch, recompute_granularity="full", scatter_gather_p2p=True,
                  pipeline_split="even")  # Megatron's split


def reproduce(row: SC21Row, cluster: ClusterSpec | None = None) -> tuple[StepEstimate, float]:
    """(estimate, predicted TFLOP/s per GPU counted as SC21 counts them)."""
    cluster = cluster or get_cluster("a100-80gb-sc21")
    model = sc21_model(row)
    est = estimate(model, sc21_layout(row), cluster)
    return est, sc21_flops(model, row.batch) / est.step_time_s / row.gpus / 1e12


# Figure 12: GPT-3 175B (96 layers, hidden 12288, 96 heads) on 96 GPUs, TP=8, PP=12, micro-batch 1,
# interleaved with 2 layers per virtual stage (V=4) against 1F1B, global batch 12 .. 60.
FIGURE_12 = SC21Row("175B", 96, 12288, 96, 8, 12, 96, 12, 1, 2, float("nan"))
FIGURE_12_BATCHES = (12, 24, 36, 48, 60)


def figure_12(cluster: ClusterSpec | None = None) -> list[tuple[int, float, float]]:
    """(batch, interleaved TFLOP/s per GPU, 1F1B TFLOP/s per GPU) by SC21's count."""
    cluster = cluster or get_cluster("a100-80gb-sc21")
    model, out = sc21_model(FIGURE_12), []
    for batch in FIGURE_12_BATCHES:
        flops = sc21_flops(model, batch) / FIGURE_12.gpus / 1e12
        inter = estimate(model, sc21_layout(FIGURE_12, batch, True), cluster).step_time_s
        plain = estimate(model, sc21_layout(FIGURE_12, batch, False), cluster).step_time_s
        out.append((batch, flops / inter, flops / plain))
    return out
