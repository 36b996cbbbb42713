"""TransformerConfig: every setting of the GPT model in one dataclass, checked in one place.

Field names follow Megatron-Core's ``TransformerConfig`` (and Megatron-LM's
arguments where Core has none), so porting a Megatron script is mechanical.
``__post_init__`` fills the derived defaults (as Megatron does: ffn_hidden_size,
kv_channels, num_query_groups, max_position_embeddings, params_dtype) and
rejects inconsistent settings with an error that names the numbers, before any
parameter is allocated. The derived fields are then ordinary values: a
``dataclasses.replace(config, hidden_size=...)`` keeps the old kv_channels and
ffn_hidden_size, so change the model's shape through the constructor or a preset.

Presets: ``gpt2_config(size)`` (LayerNorm, gelu-tanh MLP, learned positions,
biases, tied embeddings: HF GPT-2) and ``llama_config(size)`` (RMSNorm, SwiGLU,
RoPE, no biases, untied embeddings, GQA where the model has it); "tiny" is
sized for CPU tests.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from parallel3d.parallel_state import check_virtual_pipeline_size
from parallel3d.pipeline.layout import layers_per_virtual_stage
from parallel3d.tensor_parallel import vocab_size_with_padding
from parallel3d.tensor_parallel.fp8 import Fp8Recipe
from parallel3d.tensor_parallel.random import GRAPH_SAFE_RNG  # dropout inside CUDA graphs needs it

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# "gelu": exact (erf) GeLU, torch's F.gelu; "gelu_tanh": the tanh approximation, HF GPT-2's ``gelu_new``
# and what a Megatron-LM GeLU model computes by default (megatron_activation); "silu": with
# gated_linear_unit this is SwiGLU (LLaMA).
ACTIVATIONS = ("gelu", "gelu_tanh", "silu")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
# "sdpa": torch scaled_dot_product_attention (flash / cuDNN / memory-efficient on GPU);
# "local": Megatron's DotProductAttention (explicit scores, masked softmax, dropout, bmm).
ATTENTION_BACKENDS = ("sdpa", "local")
_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
# LLaMA rounds its SwiGLU width up to a multiple of this (``multiple_of`` in Meta's code).
_LLAMA_FFN_MULTIPLE_OF = 256


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = _LLAMA_FFN_MULTIPLE_OF) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4h (same FLOPs as a 4h GeLU MLP), rounded up to ``multiple_of``."""
    width = int(2 * 4 * hidden_size / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


def megatron_activation(swiglu: bool, openai_gelu: bool, bias_gelu_fusion: bool, add_bias_linear: bool) -> str:
    """The MLP activation Megatron-LM's flags build: SiLU (gated) with --swiglu; else GeLU, which Megatron-Core's
    fused bias-GeLU (``bias_gelu_impl``: on by default, off with --no-bias-gelu-fusion or without biases)
    computes with the tanh approximation, as --openai-gelu does; the exact erf GeLU otherwise."""
    if swiglu:
        return "silu"
    return "gelu_tanh" if openai_gelu or (bias_gelu_fusion and add_bias_linear) else "gelu"


def megatron_gelu_flags(activation: str, add_bias_linear: bool) -> dict[str, bool]:
    """The inverse of ``megatron_activation`` for a GeLU model: the Megatron-LM flags that build ``activation``."""
    tanh = activation == "gelu_tanh"
    return {"openai_gelu": tanh and not add_bias_linear, "bias_gelu_fusion": tanh and add_bias_linear}


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's --ffn-hidden-size when none is given (its validate_args): 4h, or with --swiglu 2/3 of 4h
    rounded down to a multiple of 64 (LLaMA's rule, ``default_ffn_hidden_size``, rounds up to 256)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def default_ffn_hidden_size(hidden_size: int, gated_linear_unit: bool) -> int:
    """The MLP width when none is given: 4h, or LLaMA's rule for a gated MLP (what the model builds)."""
    return llama_ffn_hidden_size(hidden_size) if gated_linear_unit else 4 * hidden_size


def num_floating_point_operations(*, batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                                  num_attention_heads: int, kv_channels: Optional[int],
                                  num_query_groups: Optional[int], ffn_hidden_size: int, swiglu: bool,
                                  padded_vocab_size: int) -> float:
    """Model FLOPs of one iteration (Megatron's formula; causal attention counted as half)."""
    h, L, s = hidden_size, num_layers, seq_length
    head_dim = kv_channels or h // num_attention_heads
    q = num_attention_heads * head_dim
    k = (num_query_groups or num_attention_heads) * head_dim
    g = 3 if swiglu else 2
    return (6 * batch_size * s * (L * (h * (q + 2 * k) + q * h + g * h * ffn_hidden_size) + h * padded_vocab_size)
            + 6 * batch_size * s * s * L * q)


def cuda_graph_blockers(hidden_dropout: float, attention_dropout: float = 0.0,
                        recompute_granularity: Optional[str] = None, compile_layers: bool = False) -> list[str]:
    """What a captured layer cannot hold, each named with its fix: dropout where torch's generators have no
    graph-safe states (the RNG tracker swaps them in; training/cuda_graphs.py registers them with each graph), a
    second forward inside backward (recompute) and Inductor's own graphs (FP8 is held: its cached weight operands
    are refreshed in place before each replay, training/cuda_graphs.py). The
    one rule for the refusal (TransformerConfig), the default (the training arguments turn the graphs on where
    none applies) and the planner (on the fields a plan knows)."""
    blockers = {
        f"hidden_dropout / attention_dropout > 0 (set both to 0: torch {torch.__version__}'s generators have no "
        "graph-safe states)": (hidden_dropout > 0 or attention_dropout > 0) and not GRAPH_SAFE_RNG,
        "recompute_granularity (drop recomputation)": recompute_granularity is not None,
        "compile_layers (--compile: choose one)": bool(compile_layers),
    }
    return [name for name, applies in blockers.items() if applies]


@dataclass
class TransformerConfig:
    # --- architecture ---------------------------------------------------------------------------
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # the real vocabulary; padded for the embedding (see padded_vocab_size)
    seq_length: int
    ffn_hidden_size: Optional[int] = None  # None: 4h, or LLaMA's rule with gated_linear_unit
    num_query_groups: Optional[int] = None  # GQA: key/value heads; None = num_attention_heads (MHA)
    kv_channels: Optional[int] = None  # per-head width; None = hidden_size // num_attention_heads
    max_position_embeddings: Optional[int] = None  # None = seq_length
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    gated_linear_unit: bool = False  # with activation="silu": SwiGLU, linear_fc1 = [gate; up]
    activation: str = "gelu"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a QKV bias even when add_bias_linear is False (Qwen-style)
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # Seed of the parameter initialisation. Each layer (and the embedding, final norm and
    # output layer) draws from its own sub-seed, so parameters do not depend on TP/PP/VP.
    seed: int = 1234
    apply_residual_connection_post_layernorm: bool = False

    # --- parallelism ----------------------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    # With TP=1 sequence parallelism means nothing: like Megatron, it is switched off with a warning.
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Uneven pipeline split (Megatron's): the first/last stage hold this many layers and the
    # others share the rest evenly. Needed when num_layers is not divisible by PP x VP.
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    # The interleaved schedule's microbatches per chunk in a row (Megatron's; None: PP). The schedule reads it.
    microbatch_group_size_per_vp_stage: Optional[int] = None

    # --- activation recomputation ---------------------------------------------------------------
    recompute_granularity: Optional[str] = None  # None | "full" (whole layers) | "selective" (attention core)
    recompute_method: str = "uniform"  # full: "uniform" = groups of recompute_num_layers layers,
    recompute_num_layers: int = 1  # "block" = only the first recompute_num_layers layers of each chunk

    # --- precision ------------------------------------------------------------------------------
    params_dtype: Union[torch.dtype, str, None] = None  # None: bf16/fp16 flags decide, else fp32
    bf16: bool = False
    fp16: bool = False
    attention_softmax_in_fp32: bool = True  # "local" attention: softmax statistics in fp32
    # FP8 GEMMs in the transformer layers' linears (Megatron's fields; parallel3d/tensor_parallel/fp8.py).
    # The output layer and the embeddings stay in params_dtype.
    fp8: Optional[str] = None  # None | "e4m3" | "hybrid" (e4m3 forward, e5m2 gradients)
    fp8_recipe: str = "delayed"  # "delayed" | "tensorwise" | "rowwise" (ours: torchao's axiswise scaling)
    fp8_margin: int = 0  # delayed only: scale = fp8_max / amax / 2**margin
    fp8_amax_history_len: int = 1  # delayed only: steps of amax history per tensor
    fp8_amax_compute_algo: str = "most_recent"  # delayed only: "most_recent" | "max" of the history
    fp8_wgrad: bool = True  # False: the weight-gradient GEMM in high precision

    # --- kernels: each flag off = the op's PyTorch reference (the rule: parallel3d/fused) ---
    attention_backend: str = "sdpa"
    gradient_accumulation_fusion: bool = False  # wgrad GEMM into param.main_grad (needs the DDP buffers)
    bias_activation_fusion: bool = True
    bias_dropout_fusion: bool = True
    masked_softmax_fusion: bool = True  # "local" attention only
    apply_rope_fusion: bool = True
    normalization_fusion: bool = True  # LayerNorm / RMSNorm through parallel3d.fused
    # torch.compile each transformer layer (--compile): Inductor fuses the elementwise passes and
    # chooses what backward recomputes; the TP linears (tensor_parallel/layers.py) and the loss
    # (outside the layers; its kernel beat Inductor's, BENCHMARKS.md) stay eager.
    compile_layers: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend ("aot_eager": trace only, for tests)
    # Megatron's CUDA graphs: each layer's forward and backward captured after this many eager training steps
    # and replayed (parallel3d/training/cuda_graphs.py); what a graph cannot hold is refused below.
    enable_cuda_graph: bool = False
    cuda_graph_warmup_steps: int = 3

    # --- training (Megatron-Core reads it from the model config: DDP's gradient scaling, the schedules) ---
    calculate_per_token_loss: bool = False  # average over every token of the step, not per microbatch

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "make_vocab_size_divisible_by", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "recompute_num_layers"):
            positive(name)
        for name, allowed in (("position_embedding_type", POSITION_EMBEDDING_TYPES),
                              ("normalization", NORMALIZATIONS), ("activation", ACTIVATIONS),
                              ("recompute_granularity", RECOMPUTE_GRANULARITIES),
                              ("recompute_method", RECOMPUTE_METHODS),
                              ("attention_backend", ATTENTION_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        if self.layernorm_epsilon <= 0:
            raise ValueError(f"layernorm_epsilon must be > 0, got {self.layernorm_epsilon}")

        # Derived defaults (Megatron fills these the same way).
        h, heads = self.hidden_size, self.num_attention_heads
        if self.kv_channels is None:
            if h % heads != 0:
                raise ValueError(
                    f"hidden_size ({h}) is not divisible by num_attention_heads ({heads}); "
                    "set kv_channels explicitly for a per-head width that does not divide the hidden size"
                )
            self.kv_channels = h // heads
        positive("kv_channels")
        if self.num_query_groups is None:
            self.num_query_groups = heads
        positive("num_query_groups")
        if heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) is not divisible by num_query_groups ({self.num_query_groups}): "
                "each key/value head must serve the same number of query heads"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(h, self.gated_linear_unit)
        positive("ffn_hidden_size")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        positive("max_position_embeddings")
        if self.position_embedding_type == "learned_absolute" and self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"seq_length ({self.seq_length}) exceeds max_position_embeddings ({self.max_position_embeddings}) "
                "of the learned position embedding"
            )
        if self.position_embedding_type == "rope":
            if not 0.0 < self.rotary_percent <= 1.0:
                raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
            rot = self.rotary_dim
            if rot < 2 or rot % 2 != 0:
                raise ValueError(
                    f"the rotary dimension kv_channels ({self.kv_channels}) x rotary_percent ({self.rotary_percent}) "
                    f"= {rot} must be an even number >= 2"
                )

        self._check_precision()
        self._fp8 = Fp8Recipe.from_config(self)  # checked now, before any parameter exists
        self._check_tensor_parallel()
        self._check_pipeline_split()
        self._check_cuda_graph()

    # --- checks ---------------------------------------------------------------------------------
    def _check_precision(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 are both set; choose one")
        wanted = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else None
        dtype = self.params_dtype
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"params_dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
            dtype = _DTYPES[dtype]
        if dtype is None:
            dtype = wanted or torch.float32
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {dtype}")
        if wanted is not None and dtype != wanted:
            raise ValueError(
                f"params_dtype={dtype} contradicts {'bf16' if self.bf16 else 'fp16'}=True (which means {wanted})"
            )
        self.params_dtype = dtype

    def _check_cuda_graph(self) -> None:
        """The graphs' refusals (cuda_graph_blockers); the zero-bubble schedules' W split is refused with the
        schedule, in the training arguments."""
        if not self.enable_cuda_graph:
            return
        if not isinstance(self.cuda_graph_warmup_steps, int) or self.cuda_graph_warmup_steps < 1:
            raise ValueError(f"cuda_graph_warmup_steps must be a positive integer, got {self.cuda_graph_warmup_steps!r}")
        named = self.cuda_graph_blocked_by()
        if named:
            raise ValueError(f"enable_cuda_graph is not supported with {'; '.join(named)}: a captured layer replays "
                             "a micro-batch's fixed kernels")

    def cuda_graph_blocked_by(self) -> list[str]:
        """What of this config a captured layer cannot hold (cuda_graph_blockers)."""
        return cuda_graph_blockers(self.hidden_dropout, self.attention_dropout, self.recompute_granularity,
                                   self.compile_layers)

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_model_parallel_size
        heads, groups = self.num_attention_heads, self.num_query_groups
        if heads % tp != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) is not divisible by tensor_model_parallel_size ({tp}): "
                "attention heads are split across TP ranks"
            )
        if groups % tp != 0:
            raise ValueError(
                f"num_query_groups ({groups}) is not divisible by tensor_model_parallel_size ({tp}): "
                "key/value heads are split across TP ranks (use a TP size that divides the KV heads)"
            )
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(f"ffn_hidden_size ({self.ffn_hidden_size}) is not divisible by "
                             f"tensor_model_parallel_size ({tp})")
        if self.sequence_parallel and tp == 1:
            warnings.warn("sequence_parallel=True has no effect with tensor_model_parallel_size=1: turned off "
                          "(as Megatron does)", stacklevel=3)
            self.sequence_parallel = False
        if self.sequence_parallel and self.seq_length % tp != 0:
            raise ValueError(
                f"sequence_parallel needs seq_length ({self.seq_length}) divisible by "
                f"tensor_model_parallel_size ({tp}): each TP rank holds seq_length / TP positions"
            )

    def _check_pipeline_split(self) -> None:
        pp, vp, layers = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size, self.num_layers
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        check_virtual_pipeline_size(pp, vp)
        # Any total without first/last: a layout string or the balanced split places the layers (the model takes
        # its layer_numbers); the even split is checked where it is asked for (layers_per_virtual_stage).
        if first is not None or last is not None:
            layers_per_virtual_stage(layers, pp, vp or 1, first_stage_layers=first, last_stage_layers=last)

    # --- derived quantities ---------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary the embedding and output layer hold (Megatron's padding, x TP)."""
        return vocab_size_with_padding(self.vocab_size, self.make_vocab_size_divisible_by,
                                       self.tensor_model_parallel_size)

    def layers_per_virtual_stage(self) -> list[int]:
        """Layers held by each virtual pipeline stage v = chunk * PP + rank (Megatron's numbering).

        This is ``layers_per_stage`` for ``parallel3d.pipeline.partition.partition_layers``: an
        even split, or Megatron's uneven one (the first/last pipeline rank hold
        num_layers_in_first/last_pipeline_stage layers, spread evenly over their chunks).
        """
        return layers_per_virtual_stage(
            self.num_layers, self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size or 1,
            first_stage_layers=self.num_layers_in_first_pipeline_stage,
            last_stage_layers=self.num_layers_in_last_pipeline_stage, split="even")

    def checkpoint_mismatches(self, saved: dict[str, Any]) -> list[str]:
        """The architecture fields where a saved config (its JSON) differs from this one: checkpointing
        refuses such a checkpoint (parallel3d.model_chunk.CheckpointableConfig)."""
        return [f"{k}: checkpoint {saved[k]!r} vs this run {getattr(self, k)!r}" for k in _ARCHITECTURE
                if k in saved and saved[k] != getattr(self, k)]

    def num_floating_point_operations(self, batch_size: int) -> float:
        """Model FLOPs of one iteration of ``batch_size`` sequences (Megatron's formula, the one the planner
        prices too; causal attention counted as half)."""
        return num_floating_point_operations(
            batch_size=batch_size, seq_length=self.seq_length, num_layers=self.num_layers,
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads, kv_channels=self.kv_channels,
            num_query_groups=self.num_query_groups, ffn_hidden_size=self.ffn_hidden_size, swiglu=self.swiglu,
            padded_vocab_size=self.padded_vocab_size)

    def linear_kwargs(self, tp_group: Optional[Any], fp8: bool = True) -> dict[str, Any]:
        """The keywords every parallel linear of the model takes from this config; ``fp8=False``: this
        linear stays in params_dtype whatever the FP8 fields say (the output layer)."""
        return dict(sequence_parallel=self.sequence_parallel,
                    gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                    params_dtype=self.params_dtype, tp_group=tp_group, fp8=(fp8 and self._fp8) or False)

    @property
    def fp8_settings(self) -> Optional[Fp8Recipe]:
        """The FP8 recipe these fields describe (None: no FP8), built and checked once."""
        return self._fp8

    @property
    def rotary_dim(self) -> int:
        return int(self.kv_channels * self.rotary_percent)

    @property
    def swiglu(self) -> bool:
        return self.gated_linear_unit and self.activation == "silu"


# Every field that changes the function the weights compute (their shapes, or what is done with them): a
# checkpoint saved otherwise is refused, naming the field (precision, kernels and dropout may change).
_ARCHITECTURE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                 "vocab_size", "make_vocab_size_divisible_by", "normalization", "layernorm_epsilon",
                 "position_embedding_type", "rotary_base", "rotary_percent", "gated_linear_unit", "activation",
                 "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights", "kv_channels",
                 "apply_residual_connection_post_layernorm")

# --- presets ----------------------------------------------------------------------------------

_GPT2_FAMILY = dict(
    position_embedding_type="learned_absolute", normalization="LayerNorm", layernorm_epsilon=1e-5,
    activation="gelu_tanh", gated_linear_unit=False, add_bias_linear=True,
    untie_embeddings_and_output_weights=False, hidden_dropout=0.1, attention_dropout=0.1,
)
_GPT2_SIZES = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000),
    "124m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50257),
    "350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50257),
    "1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257),
}
_LLAMA_FAMILY = dict(
    position_embedding_type="rope", normalization="RMSNorm", layernorm_epsilon=1e-5,
    activation="silu", gated_linear_unit=True, add_bias_linear=False,
    untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
)
_LLAMA_SIZES = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32,
                 vocab_size=1000),
    # Llama-3.2-1B shape (the shared Megatron benchmark's "llama-1b" preset: untied embeddings)
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192,
               seq_length=2048, vocab_size=128256, rotary_base=500000.0),
    # Llama-2-7B
    "7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008, seq_length=4096,
               vocab_size=32000),
}


def _preset(family: str, sizes: dict, base: dict, size: str, overrides: dict[str, Any]) -> TransformerConfig:
    if size not in sizes:
        raise ValueError(f"unknown {family} size {size!r}; valid sizes: {', '.join(sizes)}")
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"{family}_config: unknown TransformerConfig field(s) {unknown}")
    return TransformerConfig(**{**base, **sizes[size], **overrides})


def gpt2_config(size: str = "124m", **overrides: Any) -> TransformerConfig:
    """GPT-2 family (HF GPT-2 conventions); ``size`` in tiny / 124m / 350m / 1.3b."""
    return _preset("gpt2", _GPT2_SIZES, _GPT2_FAMILY, size, overrides)


def llama_config(size: str = "7b", **overrides: Any) -> TransformerConfig:
    """LLaMA family (HF LLaMA conventions); ``size`` in tiny / 1b / 7b."""
    return _preset("llama", _LLAMA_SIZES, _LLAMA_FAMILY, size, overrides)
