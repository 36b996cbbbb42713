"""GPT (GPT-2 and LLaMA families) built from parallel3d's tensor-parallel layers.

Megatron-Core's GPTModel with its local layer spec, written out in one file:

    GPTModel
      embedding: LanguageModelEmbedding        (pre_process: first virtual pipeline stage)
        word_embeddings: VocabParallelEmbedding
        position_embeddings: nn.Embedding      (learned_absolute only)
      rotary_pos_emb: RotaryEmbedding          (rope only; no parameters)
      decoder: TransformerBlock
        layers.{i}: TransformerLayer            (i = local index; layer.layer_number = global, 1-based)
          input_layernorm -> self_attention (linear_qkv -> core_attention -> linear_proj) -> bias-dropout-add
          pre_mlp_layernorm -> mlp (linear_fc1 -> activation -> linear_fc2) -> bias-dropout-add
        final_layernorm                          (post_process)
      output_layer: ColumnParallelLinear         (post_process; fed the embedding weight when tied)

Parameter names are Megatron-Core's, so checkpoint converters map them one to one.
Layouts inside the parameters (also Megatron's):
- ``linear_qkv``: rows grouped per query group, each group [its q heads, k, v] (hn rows per
  head); TP ranks hold whole groups, so a plain (stride-1) split along dim 0.
- ``linear_fc1`` with a gated unit: [gate; up]; each TP rank holds [gate_r; up_r]
  (``partition_stride=2``).
- embedding / output layer: the vocabulary padded to ``config.padded_vocab_size``; padding rows
  are zero and excluded from the loss.

Activations are [s, b, h] (a sequence shard [s/tp, b, h] under sequence parallelism).

Initialisation is layout-independent: every layer draws its parameters from its own
sub-seed (config.seed, global layer index), the embedding, final norm and output layer from
fixed sub-seeds, and each TP layer initialises the full weight and keeps its slice. So a
pipeline stage that holds only layers 4..7 builds exactly the full model's layers 4..7, and
a tied output layer on the last stage starts equal to the first stage's embedding.
"""
from __future__ import annotations

import contextlib
import functools
import zlib
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d import tensor_parallel
from parallel3d.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    init_method_normal,
    scaled_init_method_normal,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from parallel3d.device import default_device
from parallel3d.tensor_parallel.layers import InitMethod
from parallel3d.tensor_parallel.utils import group_rank_and_size, resolve_tp_group

from .config import TransformerConfig

# torch >= 2.5 lets SDPA share key/value heads across query heads without copying them.
_TORCH_VERSION = tuple(int(v) for v in torch.__version__.split(".")[:2])
_SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)
_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


# --- fused-op wrappers --------------------------------------------------------------------------
# The model calls parallel3d.fused's ops (CUDA kernels, with PyTorch fallbacks off the GPU) where
# the matching config flag is on, and these _plain_* compositions where it is off.

def _plain_bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "tanh") -> torch.Tensor:
    """GeLU of x + bias; "tanh" is Megatron's fused formula and HF GPT-2's gelu_new, "none" is erf."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def _plain_bias_swiglu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """SwiGLU of x + bias, whose last dim is [gate; up]: silu(gate) * up."""
    gate, up = torch.chunk(x if bias is None else x + bias, 2, dim=-1)
    return F.silu(gate) * up


def _plain_bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                            prob: float, training: bool) -> torch.Tensor:
    """residual + dropout(x + bias)."""
    out = x if bias is None else x + bias
    return residual + F.dropout(out, p=prob, training=training)


def _plain_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim; torch's kernels keep the statistics in fp32 for bf16/fp16 x."""
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalised in fp32, cast to x's dtype, times weight (HF LLaMA's order)."""
    if _HAS_RMS_NORM:  # the same formula, one kernel on recent CUDA builds
        return F.rms_norm(x, (x.size(-1),), weight, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _plain_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on t [s, b, n, d] with freqs [s, 1, 1, rot] (Megatron's / HF LLaMA's rotate-half).

    Only the first ``rot`` channels of each head rotate (rotary_percent < 1 leaves the rest).
    """
    rot = freqs.size(-1)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    out = t_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if t_pass.size(-1) == 0 else torch.cat((out, t_pass), dim=-1)


def _plain_scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(scale * x) over the last dim of x [batches, sq, sk], in x's dtype."""
    sq, sk = x.shape[-2:]
    future = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x * scale).masked_fill(future, float("-inf")), dim=-1)


from parallel3d.fused import (  # noqa: E402 - the kernels (with their own fallbacks) where a flag is on
    apply_rotary_pos_emb_qk,
    bias_dropout_add,
    bias_gelu,
    bias_swiglu,
    layer_norm,
    rms_norm,
    scaled_upper_triang_masked_softmax,
)


# --- helpers ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _init_rng(seed: int, part: str):
    """Draw initial values for ``part`` from their own CPU sub-seed; restore the caller's RNG after.

    Only the CPU generator is touched (all masters are initialised on the CPU), so the
    accelerator's dropout streams are left alone.
    """
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(zlib.crc32(f"{seed}/{part}".encode()))
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _vocab_init(init_method: InitMethod, vocab_size: int) -> InitMethod:
    """Initialise the real vocabulary rows, zero the padding (as VocabParallelEmbedding does)."""

    def init_(weight: torch.Tensor) -> None:
        weight.zero_()
        init_method(weight[:vocab_size])

    return init_


def _dropout_rng(sequence_parallel: bool, active: bool):
    """Dropout on a TP-split or sequence-sharded tensor runs on the per-rank tracked stream."""
    return get_cuda_rng_tracker().fork() if (sequence_parallel and active) else contextlib.nullcontext()


def _mark_sequence_parallel(module: nn.Module, sequence_parallel: bool) -> None:
    for p in module.parameters():
        p.sequence_parallel = sequence_parallel


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight) over the hidden dim, statistics in fp32."""

    def __init__(self, config: TransformerConfig, hidden_size: int):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.fused = config.normalization_fusion
        device, dtype = default_device(), config.params_dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        if self.rms:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        # Under SP a norm sees a sequence shard: its gradient must be summed over TP.
        _mark_sequence_parallel(self, config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return (rms_norm if self.fused else _plain_rms_norm)(x, self.weight, self.eps)
        return (layer_norm if self.fused else _plain_layer_norm)(x, self.weight, self.bias, self.eps)


# --- embedding ----------------------------------------------------------------------------------

class LanguageModelEmbedding(nn.Module):
    """Word (+ learned position) embeddings -> [s, b, h] (a sequence shard under SP) -> dropout."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.learned_positions = config.position_embedding_type == "learned_absolute"
        init = init_method_normal(config.init_method_std)
        # Without position embeddings the vocab-parallel sum can be a reduce-scatter straight into
        # sequence shards (Megatron's reduce_scatter_embeddings); with them, positions are added first.
        self.reduce_scatter_embeddings = config.sequence_parallel and not self.learned_positions
        with _init_rng(config.seed, "embedding.word_embeddings"):
            self.word_embeddings = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, init_method=init,
                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                reduce_scatter_embeddings=self.reduce_scatter_embeddings,
                params_dtype=config.params_dtype, tp_group=tp_group,
            )
        if self.learned_positions:
            with _init_rng(config.seed, "embedding.position_embeddings"):
                master = torch.empty(config.max_position_embeddings, config.hidden_size, dtype=torch.float32)
                init(master)
            self.position_embeddings = nn.utils.skip_init(
                nn.Embedding, config.max_position_embeddings, config.hidden_size,
                device=default_device(), dtype=config.params_dtype,
            )
            with torch.no_grad():
                self.position_embeddings.weight.copy_(master)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        emb = self.word_embeddings(input_ids)  # [b, s, h], or [s/tp, b, h] when reduce-scattered
        if self.learned_positions:
            emb = emb + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            emb = emb.transpose(0, 1).contiguous()
            if cfg.sequence_parallel:
                emb = scatter_to_sequence_parallel_region(emb, self.tp_group)
        active = self.training and cfg.hidden_dropout > 0
        with _dropout_rng(cfg.sequence_parallel, active):
            return F.dropout(emb, p=cfg.hidden_dropout, training=self.training)


class RotaryEmbedding(nn.Module):
    """RoPE angles [s, 1, 1, rot] for positions 0..s-1 (Megatron's freqs, HF LLaMA's inv_freq).

    Like Megatron, the angles depend on the sequence length only, not on position_ids: every
    pipeline stage computes the same angles without being sent the batch (middle stages read
    no data), so stages cannot disagree. No parameters and no buffer: the inverse frequencies
    are recomputed in fp32 on each call (rot/2 numbers), so a cast of the model to bf16
    cannot degrade them.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.dim = config.rotary_dim
        self.base = config.rotary_base

    def forward(self, seq_len: int, device: torch.device) -> torch.Tensor:
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim))
        freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # [s, rot/2]
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


# --- attention ----------------------------------------------------------------------------------

class InferenceParams:
    """Key/value cache for incremental decoding (Megatron-Core's ``InferenceParams``).

    Pass the same object to every forward of a generation (all model chunks of a rank share it):
    each SelfAttention keeps the rotated keys and the values of the positions seen so far in
    ``key_value_memory_dict[layer_number]`` = (k, v), each [max_sequence_length, max_batch_size,
    query groups per TP rank, kv_channels], so a decode step computes only the new tokens.
    A forward of s tokens writes positions [sequence_len_offset, sequence_len_offset + s);
    the caller advances ``sequence_len_offset`` by the tokens it keeps. Tokens written past the
    ones kept (e.g. padding) are never seen by earlier positions (causal) and are overwritten
    by the next step.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(f"max_batch_size ({max_batch_size}) and max_sequence_length ({max_sequence_length}) "
                             "must be >= 1")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class DotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v for this rank's heads: q [s, b, np, d], k/v [s, b, ng, d] -> [s, b, np*d].

    ``attention_mask``: bool [b or 1, 1, s, s], True where attention is NOT allowed (Megatron's
    convention); None means causal. Attention dropout runs on the TP-split tracked stream.
    """

    def __init__(self, config: TransformerConfig, heads_per_rank: int, groups_per_rank: int):
        super().__init__()
        self.config = config
        self.heads_per_rank, self.groups_per_rank = heads_per_rank, groups_per_rank
        self.softmax_scale = config.kv_channels ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        s, b = q.shape[:2]
        p = self.config.attention_dropout if self.training else 0.0
        with (get_cuda_rng_tracker().fork() if p > 0 else contextlib.nullcontext()):
            if self.config.attention_backend == "sdpa":
                ctx = self._sdpa(q, k, v, attention_mask, p)
            else:
                ctx = self._local(q, k, v, attention_mask, p)
        return ctx.reshape(s, b, -1)

    def _sdpa(self, q, k, v, attention_mask, p):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        kwargs = {}
        if self.groups_per_rank != self.heads_per_rank:
            if _SDPA_HAS_GQA:
                kwargs["enable_gqa"] = True
            else:
                rep = self.heads_per_rank // self.groups_per_rank
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, dropout_p=p,
            is_causal=attention_mask is None, scale=self.softmax_scale, **kwargs,
        )
        return ctx.permute(2, 0, 1, 3)  # [s, b, n, d]

    def _local(self, q, k, v, attention_mask, p):
        """Megatron's DotProductAttention: explicit [b, np, s, s] scores, (fused) masked softmax."""
        cfg = self.config
        sq, b, np_, d = q.shape
        sk = k.size(0)
        if self.groups_per_rank != np_:
            rep = np_ // self.groups_per_rank
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q = q.reshape(sq, b * np_, d).transpose(0, 1)  # [b*np, sq, d]
        k = k.reshape(sk, b * np_, d).transpose(0, 1)
        v = v.reshape(sk, b * np_, d).transpose(0, 1)
        scores = torch.baddbmm(torch.empty(b * np_, sq, sk, dtype=q.dtype, device=q.device), q, k.transpose(1, 2),
                               beta=0.0, alpha=self.softmax_scale)
        if cfg.attention_softmax_in_fp32:
            scores = scores.float()
        if attention_mask is None:
            softmax = scaled_upper_triang_masked_softmax if cfg.masked_softmax_fusion else \
                _plain_scaled_upper_triang_masked_softmax
            probs = softmax(scores, 1.0)
        else:
            scores = scores.view(b, np_, sq, sk).masked_fill(attention_mask, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1).view(b * np_, sq, sk)
        probs = F.dropout(probs.to(v.dtype), p=p, training=p > 0)
        ctx = torch.bmm(probs, v)  # [b*np, sq, d]
        return ctx.view(b, np_, sq, d).permute(2, 0, 1, 3)


class SelfAttention(nn.Module):
    """linear_qkv (column-parallel) -> RoPE -> core attention -> linear_proj (row-parallel).

    Returns (output, bias): the projection's bias is left for the bias-dropout-add.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        _, tp = group_rank_and_size(tp_group)
        self.heads_per_rank = config.num_attention_heads // tp
        self.groups_per_rank = config.num_query_groups // tp
        self.kv_channels = config.kv_channels
        query_size = config.kv_channels * config.num_attention_heads
        kv_size = config.kv_channels * config.num_query_groups
        common = dict(sequence_parallel=config.sequence_parallel,
                      gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                      params_dtype=config.params_dtype, tp_group=tp_group)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, query_size + 2 * kv_size, bias=config.add_bias_linear or config.add_qkv_bias,
            gather_output=False, init_method=init_method_normal(config.init_method_std), **common,
        )
        self.core_attention = DotProductAttention(config, self.heads_per_rank, self.groups_per_rank)
        self.linear_proj = RowParallelLinear(
            query_size, config.hidden_size, bias=config.add_bias_linear, input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            skip_bias_add=True, **common,
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor], inference_params: Optional[InferenceParams] = None):
        cfg = self.config
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, ng/tp * (np/ng + 2) * d]
        s, b = mixed.shape[:2]
        q_per_group, d = self.heads_per_rank // self.groups_per_rank, self.kv_channels
        mixed = mixed.view(s, b, self.groups_per_rank, (q_per_group + 2) * d)
        q, k, v = torch.split(mixed, [q_per_group * d, d, d], dim=3)
        q = q.reshape(s, b, self.heads_per_rank, d)
        if rotary_pos_emb is not None:
            if cfg.apply_rope_fusion:
                q, k = apply_rotary_pos_emb_qk(q, k, rotary_pos_emb)
            else:
                q, k = _plain_apply_rotary_pos_emb(q, rotary_pos_emb), _plain_apply_rotary_pos_emb(k, rotary_pos_emb)
        if inference_params is not None:
            k, v, attention_mask = self._update_kv_cache(k, v, attention_mask, inference_params)
        if cfg.recompute_granularity == "selective" and self.training:
            # Keep only q, k, v: the s x s scores and probabilities are recomputed in backward.
            ctx = tensor_parallel.checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(ctx)

    def _update_kv_cache(self, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
                         inference_params: InferenceParams):
        """Store this step's k/v [s, b, ng, d] at the cache offset; return all cached k/v and the mask."""
        offset, (s, b) = inference_params.sequence_len_offset, k.shape[:2]
        end = offset + s
        if end > inference_params.max_sequence_length or b > inference_params.max_batch_size:
            raise ValueError(f"the KV cache holds {inference_params.max_sequence_length} positions x "
                             f"{inference_params.max_batch_size} sequences; this step needs positions up to {end} "
                             f"for {b} sequence(s)")
        cache = inference_params.key_value_memory_dict.get(self.layer_number)
        if cache is None:
            shape = (inference_params.max_sequence_length, inference_params.max_batch_size) + tuple(k.shape[2:])
            cache = (k.new_empty(shape), v.new_empty(shape))
            inference_params.key_value_memory_dict[self.layer_number] = cache
        cache_k, cache_v = cache
        cache_k[offset:end, :b] = k
        cache_v[offset:end, :b] = v
        if offset > 0:
            if attention_mask is not None:
                raise ValueError("an explicit attention_mask is not supported with a KV-cache offset > 0")
            # query i sits at position offset + i: it sees keys 0 .. offset + i (True = not allowed)
            attention_mask = torch.ones(s, end, dtype=torch.bool, device=k.device).triu(offset + 1)[None, None]
        return cache_k[:end, :b], cache_v[:end, :b], attention_mask


# --- MLP ----------------------------------------------------------------------------------------

def _activation_fn(config: TransformerConfig) -> Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]:
    """act(x + bias), or act(gate) * up for a gated unit; the fused wrapper where one exists."""
    fused = config.bias_activation_fusion
    if config.swiglu:
        return bias_swiglu if fused else _plain_bias_swiglu
    if config.activation in ("gelu", "gelu_tanh") and not config.gated_linear_unit:
        return functools.partial(bias_gelu if fused else _plain_bias_gelu,
                                 approximate="tanh" if config.activation == "gelu_tanh" else "none")
    # The rest (GeGLU, a non-gated SiLU) has no kernel: plain PyTorch.
    act = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu}[config.activation]

    def plain(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x = x if bias is None else x + bias
        if config.gated_linear_unit:
            gate, up = torch.chunk(x, 2, dim=-1)
            return act(gate) * up
        return act(x)

    return plain


class MLP(nn.Module):
    """linear_fc1 (column-parallel, [gate; up] with a gated unit) -> activation -> linear_fc2 (row-parallel)."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        common = dict(sequence_parallel=config.sequence_parallel,
                      gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                      params_dtype=config.params_dtype, tp_group=tp_group, skip_bias_add=True,
                      bias=config.add_bias_linear)
        gated = config.gated_linear_unit
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size * (2 if gated else 1), gather_output=False,
            init_method=init_method_normal(config.init_method_std), stride=2 if gated else 1, **common,
        )
        self.activation = _activation_fn(config)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers), **common,
        )

    def forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        return self.linear_fc2(self.activation(intermediate, bias))


# --- transformer layer and block ----------------------------------------------------------------

class TransformerLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then x + mlp(norm(x)), each with bias-dropout-add."""

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.config = config
        self.layer_number = layer_number  # global, 1-based (Megatron's)
        self.input_layernorm = Norm(config, config.hidden_size)
        self.self_attention = SelfAttention(config, layer_number, tp_group)
        self.pre_mlp_layernorm = Norm(config, config.hidden_size)
        self.mlp = MLP(config, tp_group)
        self.bias_dropout_add = bias_dropout_add if config.bias_dropout_fusion else _plain_bias_dropout_add

    def _residual(self, out_with_bias, residual: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        out, bias = out_with_bias
        with _dropout_rng(cfg.sequence_parallel, self.training and cfg.hidden_dropout > 0):
            return self.bias_dropout_add(out, bias, residual, cfg.hidden_dropout, self.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor],
                inference_params: Optional[InferenceParams] = None) -> torch.Tensor:
        post_ln_residual = self.config.apply_residual_connection_post_layernorm
        normed = self.input_layernorm(hidden_states)
        attention = self.self_attention(normed, attention_mask, rotary_pos_emb, inference_params)
        hidden_states = self._residual(attention, normed if post_ln_residual else hidden_states)
        normed = self.pre_mlp_layernorm(hidden_states)
        return self._residual(self.mlp(normed), normed if post_ln_residual else hidden_states)


class TransformerBlock(nn.Module):
    """The layers of one model chunk (global indices ``layer_numbers``) and, on the last, the final norm."""

    def __init__(self, config: TransformerConfig, layer_numbers: range, post_process: bool,
                 tp_group: Optional[dist.ProcessGroup]):
        super().__init__()
        self.config = config
        layers = []
        for index in layer_numbers:
            with _init_rng(config.seed, f"decoder.layers.{index}"):
                layers.append(TransformerLayer(config, index + 1, tp_group))
        self.layers = nn.ModuleList(layers)
        if post_process:
            self.final_layernorm = Norm(config, config.hidden_size)
        else:
            self.final_layernorm = None

    def _run(self, start: int, end: int) -> Callable:
        def run(hidden_states, attention_mask, rotary_pos_emb, inference_params=None):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb, inference_params)
            return hidden_states

        return run

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                rotary_pos_emb: Optional[torch.Tensor],
                inference_params: Optional[InferenceParams] = None) -> torch.Tensor:
        cfg, n = self.config, len(self.layers)
        if cfg.recompute_granularity == "full" and self.training and inference_params is None:
            k = cfg.recompute_num_layers
            if cfg.recompute_method == "uniform":  # every group of k layers keeps only its input
                for start in range(0, n, k):
                    hidden_states = tensor_parallel.checkpoint(
                        self._run(start, min(start + k, n)), hidden_states, attention_mask, rotary_pos_emb)
            else:  # "block": the first k layers of the chunk are recomputed, the rest keep activations
                for i in range(n):
                    if i < k:
                        hidden_states = tensor_parallel.checkpoint(
                            self._run(i, i + 1), hidden_states, attention_mask, rotary_pos_emb)
                    else:
                        hidden_states = self.layers[i](hidden_states, attention_mask, rotary_pos_emb)
        else:
            hidden_states = self._run(0, n)(hidden_states, attention_mask, rotary_pos_emb, inference_params)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


# --- the model ----------------------------------------------------------------------------------

class GPTModel(nn.Module):
    """One model chunk of a GPT: the whole model, or one (virtual) pipeline stage of it.

    Args:
        config: the TransformerConfig.
        pre_process: this chunk holds the embedding (the first virtual pipeline stage).
        post_process: this chunk holds the final norm, the output layer and the loss (the last).
        layer_numbers: GLOBAL 0-based indices of the layers this chunk holds (a step-1 range);
            None = all ``config.num_layers``. ``decoder.layers.{i}`` is the i-th of them.
        vp_stage: the virtual pipeline stage (local chunk index) this chunk is, for the caller's use.
        tp_group: the tensor-parallel group; None = the default one from parallel_state (or none).

    ``forward(input_ids, position_ids, attention_mask=None, labels=None, loss_mask=None)`` returns
    - post_process with labels: the per-token loss [b, s] in fp32 (times loss_mask if given);
    - post_process without labels: logits [b, s, padded_vocab/tp] (see ``gather_logits``);
    - otherwise: hidden states [s, b, h] ([s/tp, b, h] under sequence parallelism), which the
      next stage receives through ``set_input_tensor``.
    ``position_ids`` [b, s] feed the learned position embedding (first stage; None = 0..s-1);
    RoPE ignores them (Megatron's behaviour), so other stages may pass None.
    ``attention_mask``: None = causal; else bool [b or 1, 1, s, s], True where NOT allowed.
    ``inference_params``: an :class:`InferenceParams` KV cache for incremental decoding; the
    inputs are then the tokens at positions sequence_len_offset + 0..s-1 (learned positions
    and RoPE angles start there), attending to every cached position before them.

    Dropout in training draws from the RNG tracker: call
    ``tensor_parallel.model_parallel_cuda_manual_seed(seed)`` first (as in Megatron).
    """

    def __init__(
        self,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: Optional[range] = None,
        vp_stage: Optional[int] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
    ):
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        _, tp = group_rank_and_size(self.tp_group)
        if tp != config.tensor_model_parallel_size:
            raise ValueError(
                f"config.tensor_model_parallel_size={config.tensor_model_parallel_size} but the tensor-parallel "
                f"group has {tp} rank(s); initialise parallel_state with the same TP size (or pass tp_group)"
            )
        if layer_numbers is None:
            layer_numbers = range(config.num_layers)
        if not isinstance(layer_numbers, range) or layer_numbers.step != 1 or (
                len(layer_numbers) and (layer_numbers.start < 0 or layer_numbers.stop > config.num_layers)):
            raise ValueError(f"layer_numbers must be a step-1 range inside range(0, {config.num_layers}) "
                             f"(num_layers), got {layer_numbers!r}")
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = layer_numbers
        self.vp_stage = vp_stage
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.input_tensor: Optional[torch.Tensor] = None

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.tp_group)
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config)
        self.decoder = TransformerBlock(config, layer_numbers, post_process, self.tp_group)
        if post_process:
            tied = self.share_embeddings_and_output_weights
            # Tied: the last stage's copy starts as the first stage's embedding (same sub-seed, same draws).
            with _init_rng(config.seed, "embedding.word_embeddings" if tied else "output_layer"):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, config.padded_vocab_size, bias=False, gather_output=False,
                    init_method=_vocab_init(init_method_normal(config.init_method_std), config.vocab_size),
                    skip_weight_param_allocation=pre_process and tied,
                    sequence_parallel=config.sequence_parallel,
                    gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                    params_dtype=config.params_dtype, tp_group=self.tp_group,
                )
        self._mark_embedding_parameters()

    def _mark_embedding_parameters(self) -> None:
        """Megatron's attributes for the gradient finalisation and the optimizer."""
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        shared = self.shared_embedding_or_output_weight()
        if shared is not None and self.pre_process != self.post_process:
            # Held by the first and the last stage: its gradients must be summed over the embedding group.
            shared.shared_embedding = True

    # --- Megatron's pipeline hooks ------------------------------------------------------------
    def set_input_tensor(self, input_tensor: Union[torch.Tensor, Sequence[Optional[torch.Tensor]], None]) -> None:
        """The hidden states a non-first stage starts from ([s, b, h], or [s/tp, b, h] under SP)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The tied parameter: the embedding weight on the first stage, the output weight on the last."""
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def global_layer_index(self, local_index: int) -> int:
        """Global 0-based index of ``decoder.layers.{local_index}``."""
        return self.layer_numbers[local_index]

    def global_parameter_name(self, name: str) -> str:
        """The whole (single-chunk) model's name of this chunk's parameter ``name``.

        Local layer indices become global ones; a tied output layer (the last stage's
        copy) is the embedding it mirrors.
        """
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{self.global_layer_index(int(local))}.{rest}"
        if name == "output_layer.weight" and self.share_embeddings_and_output_weights:
            return "embedding.word_embeddings.weight"
        return name

    # --- forward --------------------------------------------------------------------------------
    def _check_inputs(self, input_ids, position_ids, attention_mask, labels, loss_mask) -> tuple[int, int]:
        """(batch, full sequence length), after checking every shape against the config."""
        cfg = self.config
        tp = cfg.tensor_model_parallel_size
        if self.pre_process:
            if input_ids is None or input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq], got "
                                 f"{None if input_ids is None else tuple(input_ids.shape)}")
            b, s = input_ids.shape
        else:
            x = self.input_tensor
            if x is None:
                raise RuntimeError("this model chunk has no embedding (pre_process=False): call "
                                   "set_input_tensor() with the previous stage's output before forward")
            if x.dim() != 3 or x.size(2) != cfg.hidden_size:
                raise ValueError(f"the input tensor must be [s, b, hidden_size={cfg.hidden_size}], "
                                 f"got {tuple(x.shape)}")
            s, b = x.size(0) * (tp if cfg.sequence_parallel else 1), x.size(1)
        if cfg.sequence_parallel and s % tp != 0:
            raise ValueError(f"sequence_parallel needs the sequence length ({s}) divisible by "
                             f"tensor_model_parallel_size ({tp})")
        if cfg.position_embedding_type == "learned_absolute" and s > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings ({cfg.max_position_embeddings})")
        for name, t in (("position_ids", position_ids), ("labels", labels), ("loss_mask", loss_mask)):
            if t is not None and tuple(t.shape) != (b, s):
                raise ValueError(f"{name} must be [batch, seq] = {(b, s)}, got {tuple(t.shape)}")
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError("attention_mask must be a bool tensor, True where attention is NOT allowed "
                                 f"(Megatron's convention); got {attention_mask.dtype}")
            if attention_mask.dim() != 4 or attention_mask.shape[-2:] != (s, s) or attention_mask.size(0) not in (1, b):
                raise ValueError(f"attention_mask must be [b or 1, 1, s, s] = [{b}, 1, {s}, {s}], "
                                 f"got {tuple(attention_mask.shape)}")
        return b, s

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        inference_params: Optional[InferenceParams] = None,
    ) -> torch.Tensor:
        cfg = self.config
        b, s = self._check_inputs(input_ids, position_ids, attention_mask, labels, loss_mask)
        offset = inference_params.sequence_len_offset if inference_params is not None else 0
        if self.pre_process:
            if position_ids is None and cfg.position_embedding_type == "learned_absolute":
                if offset + s > cfg.max_position_embeddings:
                    raise ValueError(f"positions up to {offset + s} exceed max_position_embeddings "
                                     f"({cfg.max_position_embeddings})")
                position_ids = torch.arange(offset, offset + s, device=input_ids.device).expand(b, s)
            hidden_states = self.embedding(input_ids, position_ids)
        else:
            hidden_states = self.input_tensor
        rotary_pos_emb = None
        if cfg.position_embedding_type == "rope":
            rotary_pos_emb = self.rotary_pos_emb(offset + s, hidden_states.device)[offset:]

        hidden_states = self.decoder(hidden_states, attention_mask, rotary_pos_emb, inference_params)
        if not self.post_process:
            return hidden_states

        logits, _ = self.output_layer(hidden_states, weight=self.shared_embedding_or_output_weight())  # [s, b, padded_vocab/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), vocab_size=cfg.vocab_size, group=self.tp_group)
        loss = loss.t().contiguous()  # [b, s]
        if loss_mask is not None:
            loss = loss * loss_mask.to(loss.dtype)
        return loss


def gather_logits(logits: torch.Tensor, vocab_size: int,
                  tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Full real-vocabulary logits [..., vocab_size] from GPTModel's TP-split, padded ones."""
    return gather_from_tensor_model_parallel_region(logits, tp_group)[..., :vocab_size]
