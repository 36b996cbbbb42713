"""Self-attention: the KV cache (InferenceParams), core attention, and the TP-split SelfAttention."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d import tensor_parallel
from parallel3d.fused import (
    apply_rotary_pos_emb_reference,
    scaled_upper_triang_masked_softmax,
    scaled_upper_triang_masked_softmax_reference,
    split_qkv,
    split_qkv_rope,
)
from parallel3d.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_cuda_rng_tracker,
    init_method_normal,
    scaled_init_method_normal,
)
from parallel3d.tensor_parallel.utils import group_rank_and_size

from .config import TransformerConfig

# torch >= 2.5 lets SDPA share key/value heads across query heads without copying them.
_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


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
        q, k, v = (t.reshape(t.size(0), b * np_, d).transpose(0, 1) for t in (q, k, v))  # [b*np, s, d]
        scores = torch.baddbmm(torch.empty(b * np_, sq, sk, dtype=q.dtype, device=q.device), q, k.transpose(1, 2),
                               beta=0.0, alpha=self.softmax_scale)
        if cfg.attention_softmax_in_fp32:
            scores = scores.float()
        if attention_mask is None:
            if cfg.masked_softmax_fusion:
                probs = scaled_upper_triang_masked_softmax(scores, 1.0)
            else:  # Megatron's unfused softmax: in the scores' dtype
                probs = scaled_upper_triang_masked_softmax_reference(scores, 1.0, in_fp32=False)
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
        common = config.linear_kwargs(tp_group)
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
        fuse_rope = rotary_pos_emb is not None and cfg.apply_rope_fusion
        # a bias's gradient summed in the pass that merges dq, dk and dv (fused.split_qkv), not by the linear
        split_bias = self.linear_qkv.bias if not fuse_rope else None
        # [s, b, ng/tp * (np/ng + 2) * d]
        mixed, _ = self.linear_qkv(hidden_states, defer_bias_grad=split_bias is not None)
        s, b = mixed.shape[:2]
        q_per_group, d = self.heads_per_rank // self.groups_per_rank, self.kv_channels
        mixed = mixed.view(s, b, self.groups_per_rank, (q_per_group + 2) * d)
        if fuse_rope:
            q, k, v = split_qkv_rope(mixed, q_per_group, d, rotary_pos_emb)
        else:
            q, k, v = split_qkv(mixed, q_per_group, d, split_bias)
            if rotary_pos_emb is not None:
                q, k = (apply_rotary_pos_emb_reference(t, rotary_pos_emb, in_fp32=False) for t in (q, k))
        if inference_params is not None:
            k, v, attention_mask = self._update_kv_cache(k, v, attention_mask, inference_params)
        if cfg.recompute_granularity == "selective" and self.training:
            # Keep only q, k, v: the s x s scores and probabilities are recomputed in backward.
            ctx = tensor_parallel.checkpoint(self.core_attention, False, q, k, v, attention_mask)
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
