"""GPT (GPT-2 and LLaMA families) built from parallel3d's tensor-parallel layers.

Megatron-Core's GPTModel with its local layer spec (attention.py, mlp.py, block.py, ops.py):

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

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d.device import default_device
from parallel3d.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
    init_method_normal,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from parallel3d.tensor_parallel.utils import group_rank_and_size, resolve_tp_group

from .attention import InferenceParams
from .block import TransformerBlock
from .config import TransformerConfig
from .rng import dropout_rng, init_rng, vocab_init

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
        with init_rng(config.seed, "embedding.word_embeddings"):
            self.word_embeddings = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, init_method=init,
                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                reduce_scatter_embeddings=self.reduce_scatter_embeddings,
                params_dtype=config.params_dtype, tp_group=tp_group,
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            )
        if self.learned_positions:
            with init_rng(config.seed, "embedding.position_embeddings"):
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
        with dropout_rng(cfg.sequence_parallel, active):
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


# --- the model ----------------------------------------------------------------------------------

class GPTModel(nn.Module):
    """One model chunk of a GPT: the whole model, or one (virtual) pipeline stage of it.

    Args:
        config: the TransformerConfig.
        pre_process: this chunk holds the embedding (the first virtual pipeline stage).
        post_process: this chunk holds the final norm, the output layer and the loss (the last).
        layer_numbers: GLOBAL 0-based indices of the layers this chunk holds (a step-1 range);
            None = all ``config.num_layers``. ``decoder.layers.{i}`` is the i-th of them.
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
            with init_rng(config.seed, "embedding.word_embeddings" if tied else "output_layer"):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, config.padded_vocab_size, bias=False, gather_output=False,
                    init_method=vocab_init(init_method_normal(config.init_method_std), config.vocab_size),
                    skip_weight_param_allocation=pre_process and tied,
                    **config.linear_kwargs(self.tp_group, fp8=False),  # the LM head stays in bf16
                )
        self._mark_embedding_parameters()

    def _mark_embedding_parameters(self) -> None:
        """Megatron's parameter attributes: ``zero_out_wgrad`` (fused wgrad) and ``shared_embedding`` (ZeRO-1's
        own bucket for the weight two stages hold; finalize_model_grads sums its gradient over the embedding
        group through shared_embedding_or_output_weight())."""
        if self.pre_process and self.post_process and self.share_embeddings_and_output_weights:
            # The output layer is fed the embedding weight, which has gradients from the embedding too:
            # a fused wgrad must leave those for the DDP hook to add (Megatron's zero_out_wgrad).
            self.embedding.word_embeddings.weight.zero_out_wgrad = True
        shared = self.shared_embedding_or_output_weight()
        if shared is not None and self.pre_process != self.post_process:
            # Held by the first and the last stage: DDP keeps it out of the shared ZeRO-1 buckets.
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

    def global_parameter_name(self, name: str) -> str:
        """The whole (single-chunk) model's name of this chunk's parameter ``name``.

        Local layer indices become global ones; a tied output layer (the last stage's
        copy) is the embedding it mirrors.
        """
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{self.layer_numbers[int(local)]}.{rest}"
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
        # The logits are the model's own and unused after the loss: its backward may overwrite them
        loss = vocab_parallel_cross_entropy(logits, labels.t(), vocab_size=cfg.vocab_size, group=self.tp_group,
                                            inplace_backward=True)
        loss = loss.t().contiguous()  # [b, s]
        if loss_mask is not None:
            loss = loss * loss_mask.to(loss.dtype)
        return loss


def gather_logits(logits: torch.Tensor, vocab_size: int,
                  tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Full real-vocabulary logits [..., vocab_size] from GPTModel's TP-split, padded ones."""
    return gather_from_tensor_model_parallel_region(logits, tp_group)[..., :vocab_size]
