"""torchtitan 0.2.2 extension module for bench/torchtitan_bench.py: our presets as llama3 flavors, and
random tokens in place of the C4 dataloader.

torchtitan loads this through its own hook, ``[experimental] custom_import = "titan_spec"`` in the
job TOML (``Trainer.__init__`` imports it before anything is built). Importing it registers a
``TrainSpec`` named ``llama3_bench`` (``torchtitan.protocols.train_spec.register_train_spec``):
torchtitan's own llama3 spec (``Transformer``, ``parallelize_llama``, optimizer, LR scheduler,
cross-entropy loss) with two things swapped, because the GPU machine has no internet and no
tokenizer files:

- ``model_args``: flavors named like our presets (torchtitan 0.2.2 ships no 1B flavor);
- ``build_dataloader_fn``: uniform random tokens (the same data plain_gpt_bench.py trains on), and
  ``build_tokenizer_fn=None`` (SDPA attention needs no tokenizer; torchtitan allows None).

Nothing else in the training path is ours.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.config import JobConfig
from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec
from torchtitan.protocols.train_spec import register_train_spec

from parallel3d.planning.model import ModelSpec

SPEC_NAME = "llama3_bench"

# name -> (model args, seq_len, micro-batch). Shapes as plain_gpt_bench.py's presets of the same name.
# The FFN width comes out of torchtitan's rule int(ffn_dim_multiplier * int(2 * 4 * dim / 3)) rounded
# up to multiple_of: dim 2048, 1.5, 1024 -> 8192 (Llama-3.2-1B's values); dim 3072, 1.0, 256 -> 8192
# (Llama-3.2-3B's); dim 4096, 1.3, 1024 -> 14336.
PRESETS: dict[str, tuple[TransformerModelArgs, int, int]] = {
    "tiny": (TransformerModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024,
                                  multiple_of=256, rope_theta=500000), 256, 4),
    "llama-1b": (TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                      multiple_of=1024, ffn_dim_multiplier=1.5, rope_theta=500000), 2048, 4),
    "llama-3b": (TransformerModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                                      multiple_of=256, ffn_dim_multiplier=1.0, rope_theta=500000), 2048, 1),
    "llama3-8b": (TransformerModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                       multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000), 8192, 1),
}


def ffn_hidden(args: TransformerModelArgs) -> int:
    """The SwiGLU width torchtitan's FeedForward builds from these args (its formula, restated)."""
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


def model_spec(args: TransformerModelArgs, seq_len: int) -> ModelSpec:
    """The same model in parallel3d's planning terms, so its parameter count and FLOPs formula (one place
    each, parallel3d.planning.model) check and score torchtitan's run: untied, no biases, RMSNorm, RoPE."""
    return ModelSpec(num_layers=args.n_layers, hidden_size=args.dim, num_attention_heads=args.n_heads,
                     seq_length=seq_len, vocab_size=args.vocab_size, num_query_groups=args.n_kv_heads,
                     ffn_hidden_size=ffn_hidden(args), swiglu=True, add_bias_linear=False, normalization="RMSNorm",
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                     padded_vocab_size=args.vocab_size)  # torchtitan does not pad the vocabulary


class RandomTokens(IterableDataset):
    """Endless uniform random token sequences from a fixed pool (no tokenizer, no download).

    A pool of 16 samples is drawn once and cycled, so data loading costs a tensor slice and the
    timed steps measure the model, as in plain_gpt_bench.py (4 pre-drawn batches).
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, pool: int = 16) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (pool, seq_len + 1), generator=g)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        i = 0
        while True:
            t = self.tokens[i % len(self.tokens)]
            yield {"input": t[:-1]}, t[1:]
            i += 1


def build_random_dataloader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: JobConfig,
                            **kwargs: Any) -> ParallelAwareDataloader:
    """torchtitan's DataLoaderBuilder signature; the model's vocabulary bounds the token ids."""
    del tokenizer, kwargs
    vocab = PRESETS[job_config.model.flavor][0].vocab_size
    seed = 1234 + dp_rank
    return ParallelAwareDataloader(RandomTokens(vocab, job_config.training.seq_len, seed), dp_rank=dp_rank,
                                   dp_world_size=dp_world_size, batch_size=job_config.training.local_batch_size)


def _register() -> None:
    """Register once per process (torchtitan refuses a second registration of the same name)."""
    import torchtitan.protocols.train_spec as ts

    if SPEC_NAME in ts._extra_train_specs:
        return
    base = get_train_spec()
    register_train_spec(SPEC_NAME, dataclasses.replace(
        base, model_args={name: args for name, (args, _, _) in PRESETS.items()},
        build_dataloader_fn=build_random_dataloader, build_tokenizer_fn=None, build_validator_fn=None))


_register()
