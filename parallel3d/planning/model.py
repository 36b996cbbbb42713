"""Model and layout descriptions (Megatron's argument names), parameter counts and FLOPs.

ModelSpec is a frozen view of the model's TransformerConfig (``ModelSpec.from_config``), with the
config's derived defaults and attention backend names; the parameter counts follow models/gpt.py
layer by layer (tests/test_planning.py checks them, and the FLOPs, against built models);
``num_floating_point_operations`` is the config's, the one ``parallel3d.training`` reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from parallel3d.models.config import (ATTENTION_BACKENDS, TransformerConfig, cuda_graph_blockers,
                                      default_ffn_hidden_size, num_floating_point_operations)
from parallel3d.pipeline.forward_backward import default_schedule_name
from parallel3d.symmetric_memory import gathers_run
from parallel3d.pipeline.registry import (SCHEDULE_NAMES, V_SHAPED, check_schedule_args, placement_of,
                                          splits_backward)
from parallel3d.tensor_parallel import vocab_size_with_padding

RECOMPUTE_CHOICES = (None, "selective", "full")
PIPELINE_SPLITS = ("balanced", "even")  # --pipeline-split: parallel3d's default, Megatron's


@dataclass(frozen=True)
class ModelSpec:
    """A GPT/LLaMA model, named as Megatron's arguments are."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    num_query_groups: Optional[int] = None  # None: as many as heads (no GQA)
    ffn_hidden_size: Optional[int] = None  # None: the config's default (4h, LLaMA's width under SwiGLU)
    kv_channels: Optional[int] = None  # None: hidden_size // num_attention_heads
    swiglu: bool = False
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"  # or "RMSNorm" (weight only)
    position_embedding_type: str = "learned_absolute"  # or "rope" (no parameters)
    untie_embeddings_and_output_weights: bool = False
    max_position_embeddings: Optional[int] = None  # None: seq_length
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: Optional[int] = None  # given: used as is, whatever the TP size
    hidden_dropout: float = 0.0  # > 0 keeps 1-byte masks per dropout for backward
    attention_backend: str = "sdpa"  # TransformerConfig's: "sdpa" (flash), "local" (scores in memory, SC21-era)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"--num-attention-heads ({self.num_attention_heads}) must be a multiple of "
                             f"--num-query-groups ({self.query_groups})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")

    @classmethod
    def from_config(cls, config: TransformerConfig) -> "ModelSpec":
        """The model training builds from ``config`` (its derived sizes; the vocabulary padded per layout's TP)."""
        return cls(**{f: getattr(config, f) for f in (
            "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "num_query_groups",
            "ffn_hidden_size", "kv_channels", "swiglu", "add_bias_linear", "normalization", "position_embedding_type",
            "untie_embeddings_and_output_weights", "max_position_embeddings", "make_vocab_size_divisible_by",
            "hidden_dropout", "attention_backend")})

    # Derived sizes (per whole model, before TP).
    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.query_groups * self.head_dim

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or default_ffn_hidden_size(self.hidden_size, self.swiglu)

    @property
    def fc1_out(self) -> int:
        """Width of the first MLP GEMM: [gate; up] under SwiGLU."""
        return 2 * self.ffn if self.swiglu else self.ffn

    def vocab(self, tp: int) -> int:
        """The padded vocabulary (Megatron pads to a multiple of make_vocab_size_divisible_by * TP)."""
        return self.padded_vocab_size or vocab_size_with_padding(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    # Parameter counts on one tensor-parallel rank.
    def layer_params(self, tp: int) -> int:
        h, bias = self.hidden_size, self.add_bias_linear
        norm = h if self.normalization == "RMSNorm" else 2 * h
        qkv = (self.q_size + 2 * self.kv_size) // tp
        n = 2 * norm
        n += qkv * h + (qkv if bias else 0)  # linear_qkv, column-parallel
        n += h * self.q_size // tp + (h if bias else 0)  # linear_proj, row-parallel: bias replicated
        n += self.fc1_out // tp * h + (self.fc1_out // tp if bias else 0)
        n += h * self.ffn // tp + (h if bias else 0)
        return n

    def embedding_params(self, tp: int) -> int:
        pos = (self.max_position_embeddings or self.seq_length) if self.position_embedding_type == \
            "learned_absolute" else 0
        return (self.vocab(tp) // tp + pos) * self.hidden_size

    def head_params(self, tp: int, holds_embedding: bool) -> int:
        """Final norm plus the output layer (a tied one is a second copy unless this chunk holds the embedding)."""
        norm = self.hidden_size if self.normalization == "RMSNorm" else 2 * self.hidden_size
        tied_here = not self.untie_embeddings_and_output_weights and holds_embedding
        return norm + (0 if tied_here else self.vocab(tp) // tp * self.hidden_size)

    def total_params(self) -> int:
        """The whole model, counted once (tied embedding once)."""
        return (self.num_layers * self.layer_params(1) + self.embedding_params(1)
                + self.head_params(1, holds_embedding=True))


@dataclass(frozen=True)
class Layout:
    """One way to run the model: TP x PP (x V) x DP, micro-batch, recompute, optimizer."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    data_parallel_size: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1
    recompute_granularity: Optional[str] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    bf16: bool = True  # bf16 params, fp32 main_grad and masters; False: fp32 everything
    scatter_gather_p2p: bool = False  # SC21's pipeline send of 1/TP per rank + all-gather inside the node
    pipeline_schedule: Optional[str] = None  # --pipeline-schedule; None: Megatron's 1f1b / interleaved-1f1b
    pipeline_split: str = "balanced"  # --pipeline-split: layers per stage as parallel3d.pipeline.layout splits them
    enable_cuda_graph: bool = False  # --enable-cuda-graph: each layer's launches replayed (the host's share priced)
    tp_symmetric_gathers: bool = True  # --no-tp-symmetric-gathers: False (they run only with SP and graphs)

    def __post_init__(self) -> None:
        if self.pipeline_schedule is not None and self.pipeline_schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown --pipeline-schedule {self.pipeline_schedule!r}; valid names: "
                             f"{', '.join(SCHEDULE_NAMES)}")
        if self.pipeline_split not in PIPELINE_SPLITS:
            raise ValueError(f"--pipeline-split must be one of {PIPELINE_SPLITS}, got {self.pipeline_split!r}")

    @classmethod
    def from_args(cls, args, **overrides) -> "Layout":
        """From parallel3d's (Megatron's) validated arguments, e.g. those bench/gpt_bench.py builds."""
        vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
        fields = dict(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            num_layers_per_virtual_pipeline_stage=(args.num_layers // (args.pipeline_model_parallel_size * vpp)
                                                   if vpp and vpp > 1 else None),
            data_parallel_size=args.data_parallel_size, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, recompute_granularity=args.recompute_granularity,
            sequence_parallel=bool(args.sequence_parallel),
            use_distributed_optimizer=bool(args.use_distributed_optimizer),
            overlap_grad_reduce=bool(args.overlap_grad_reduce), bf16=bool(args.bf16),
            pipeline_schedule=getattr(args, "pipeline_schedule", None),
            pipeline_split=getattr(args, "pipeline_split", "balanced"),
            enable_cuda_graph=bool(getattr(args, "enable_cuda_graph", False)),
            tp_symmetric_gathers=bool(getattr(args, "tp_symmetric_gathers", True)))
        fields.update(overrides)
        return cls(**fields)

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def symmetric_gathers(self) -> bool:
        """Whether the SP all-gathers run in NCCL symmetric windows (training's rule)."""
        return gathers_run(self.tp_symmetric_gathers, self.sequence_parallel, self.enable_cuda_graph)

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def virtual_stages(self, model: ModelSpec) -> int:
        """Model chunks per pipeline rank; the V-shaped schedules (zb-v, dualpipev) hold two."""
        if not self.num_layers_per_virtual_pipeline_stage:
            return 2 if self.pp > 1 and self.pipeline_schedule in V_SHAPED else 1
        return model.num_layers // (self.pp * self.num_layers_per_virtual_pipeline_stage)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def schedule_name(self, model: ModelSpec) -> str:
        """What parallel3d runs for this layout: --pipeline-schedule, else Megatron's choice."""
        if self.pipeline_schedule is not None and self.pp > 1:
            return self.pipeline_schedule
        v = self.virtual_stages(model)
        return default_schedule_name(self.pp, v if v > 1 else None)

    def placement(self, model: ModelSpec) -> str:
        """Which virtual stage each (rank, chunk) holds: "v" for zb-v / dualpipev, else "loop"."""
        return placement_of(self.schedule_name(model), self.virtual_stages(model))

    def describe(self, model: ModelSpec) -> str:
        v = self.virtual_stages(model)
        parts = [f"TP={self.tp}", f"PP={self.pp}"] + ([f"V={v}"] if v > 1 else []) + (
            [self.schedule_name(model)] if self.pipeline_schedule and self.pp > 1 else []) + [
            f"DP={self.dp}", f"mbs={self.micro_batch_size}", f"recompute={self.recompute_granularity or 'none'}"]
        if self.sequence_parallel:
            parts.append("SP")
        if self.use_distributed_optimizer:
            parts.append("ZeRO-1")
        if self.enable_cuda_graph:
            parts.append("CUDA graphs")
        return " ".join(parts)

    def check(self, model: ModelSpec) -> None:
        """Raise ValueError naming the first reason this layout cannot run (Megatron's rules)."""
        if min(self.tp, self.pp, self.dp, self.micro_batch_size, self.global_batch_size) < 1:
            raise ValueError("parallel sizes and batch sizes must be >= 1")
        if self.recompute_granularity not in RECOMPUTE_CHOICES:
            raise ValueError(f"--recompute-granularity must be selective or full, got {self.recompute_granularity!r}")
        if model.num_attention_heads % self.tp or model.query_groups % self.tp:
            raise ValueError(f"--tensor-model-parallel-size {self.tp} must divide --num-attention-heads "
                             f"({model.num_attention_heads}) and --num-query-groups ({model.query_groups})")
        if model.ffn % self.tp:
            raise ValueError(f"--tensor-model-parallel-size {self.tp} must divide --ffn-hidden-size ({model.ffn})")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise ValueError(f"--global-batch-size {self.global_batch_size} must be a multiple of "
                             f"--micro-batch-size x DP = {self.micro_batch_size} x {self.dp}")
        if model.num_layers % self.pp:
            raise ValueError(f"--num-layers {model.num_layers} must be a multiple of "
                             f"--pipeline-model-parallel-size {self.pp}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        zero_bubble = splits_backward(self.pipeline_schedule, self.pp)
        if self.enable_cuda_graph and (zero_bubble or cuda_graph_blockers(
                model.hidden_dropout, recompute_granularity=self.recompute_granularity)):
            # training's rules (cuda_graph_blockers, the arguments' zero-bubble one), on the fields a plan knows
            raise ValueError("--enable-cuda-graph needs a 1F1B or interleaved schedule (no zero-bubble W split), "
                             "no recomputation and --hidden-dropout 0")
        if self.num_layers_per_virtual_pipeline_stage:
            per = self.num_layers_per_virtual_pipeline_stage
            if self.pp < 2 or model.num_layers % (self.pp * per):
                raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per} needs PP >= 2 and --num-layers "
                                 f"({model.num_layers}) a multiple of PP x {per}")
        if self.pp > 1 and self.pipeline_schedule in V_SHAPED and (
                self.virtual_stages(model) != 2 or model.num_layers % (2 * self.pp)):
            raise ValueError(f"--pipeline-schedule {self.pipeline_schedule} holds two chunks per rank in a V: "
                             f"--num-layers ({model.num_layers}) must be a multiple of 2 x PP and "
                             f"--num-layers-per-virtual-pipeline-stage num_layers / (2 PP) (or unset)")
        if self.pp > 1:  # the schedule's own microbatch and chunk rules, as training checks them
            check_schedule_args(self.schedule_name(model), self.pp, self.num_microbatches, self.virtual_stages(model),
                                None)


def model_flops(model: ModelSpec, batch_size: int, tp: int = 1) -> float:
    return num_floating_point_operations(
        batch_size=batch_size, seq_length=model.seq_length, num_layers=model.num_layers,
        hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads, kv_channels=model.kv_channels,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn, swiglu=model.swiglu,
        padded_vocab_size=model.vocab(tp))


def sc21_flops(model: ModelSpec, batch_size: int) -> float:
    """SC21's FLOPs per iteration (its eq. 3): full recompute counted, attention NOT halved.

    96 B s l h^2 (1 + s / (6h) + V / (16 l h)); SC21's Table 1 TFLOP/s use this count.
    """
    B, s, l, h, V = batch_size, model.seq_length, model.num_layers, model.hidden_size, model.vocab(1)
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
