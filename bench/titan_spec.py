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

SPEC_NAME = "llama3_bench"

# name -> (model args, seq_len, micro-batch). Shapes as plain_gpt_bench.py's presets of the same name.
# The FFN width comes out of torchtitan's rule int(ffn_dim_multiplier * int(2 * 4 * dim / 3)) rounded
# up to multiple_of: dim 2048, 1.5, 1024 -> 8192 (Llama-3.2-1B's values); dim 4096, 1.3, 1024 -> 14336.
PRESETS: dict[str, tuple[TransformerModelArgs, int, int]] = {
    "tiny": (TransformerModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024,
                                  multiple_of=256, rope_theta=500000), 256, 4),
    "llama-1b": (TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                      multiple_of=1024, ffn_dim_multiplier=1.5, rope_theta=500000), 2048, 4),
    "llama3-8b": (TransformerModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                       multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000), 8192, 1),
}


def ffn_hidden(args: TransformerModelArgs) -> int:
    """The SwiGLU width torchtitan's FeedForward builds from these args (its formula, restated)."""
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


def expected_params(args: TransformerModelArgs) -> int:
    """Parameter count by formula (untied embedding and output, no biases), to check the built model."""
    d, hd = args.dim, args.dim // args.n_heads
    kv = (args.n_kv_heads or args.n_heads) * hd
    attn = d * d + 2 * d * kv + d * d
    layer = attn + 3 * d * ffn_hidden(args) + 2 * d
    return args.n_layers * layer + 2 * args.vocab_size * d + d


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
