"""Where the model's random numbers come from: each part's initial values from its own CPU sub-seed (the padded
vocabulary rows zeroed), and which stream hidden dropout draws from."""
from __future__ import annotations

import contextlib
import zlib

import torch

from parallel3d.tensor_parallel import get_cuda_rng_tracker
from parallel3d.tensor_parallel.layers import InitMethod


@contextlib.contextmanager
def init_rng(seed: int, part: str):
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


def vocab_init(init_method: InitMethod, vocab_size: int) -> InitMethod:
    """Initialise the real vocabulary rows, zero the padding (as VocabParallelEmbedding does)."""

    def init_(weight: torch.Tensor) -> None:
        weight.zero_()
        init_method(weight[:vocab_size])

    return init_


def dropout_rng(sequence_parallel: bool, active: bool):
    """Hidden dropout under sequence parallelism (each TP rank holds another part of the sequence) runs on the
    per-rank tracked stream; without it the hidden states are replicated over TP and every rank draws the
    same mask from the default stream. (Attention dropout, on TP-split heads, always forks: attention.py.)"""
    return get_cuda_rng_tracker().fork() if (sequence_parallel and active) else contextlib.nullcontext()
