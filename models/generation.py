"""Generation and scoring through the pipeline with a KV cache (Megatron's text_generation, one sequence).

    tokens, logprobs = generate(model_chunks, prompt_ids, max_new_tokens=32)              # greedy
    tokens, logprobs = generate(model_chunks, prompt_ids, 32, greedy=False, temperature=0.8,
                                top_p=0.9, seed=7)                                          # sampling
    _, logprobs = generate(model_chunks, ids, 0)                                            # scoring

Collective over every rank of the model's replica (all TP x PP ranks; each data-parallel
replica runs its own copy). The prompt goes through the pipeline once (prefill, filling
each layer's KV cache); then each new token is one forward of length 1 through the
pipeline (forward-only schedule, one microbatch, shapes negotiated). The last pipeline
stage's TP rank 0 picks the token and broadcasts it (over TP, then along the pipeline),
so every rank returns the same ``(tokens, logprobs)``:

- ``tokens``: the prompt followed by the generated ids;
- ``logprobs[i]``: log p(tokens[i + 1] | tokens[: i + 1]) under the model's own distribution
  (fp32 log_softmax over the real vocabulary, gathered over TP; temperature, top-k and top-p
  only shape the sampling, never these numbers).

Sequence parallelism: a forward's length must divide by TP, which a decode step of one
token does not. Each forward is therefore padded at the end to a multiple of TP. The pads
come after every real token, so causal attention keeps them out of the real tokens' view;
the KV cache slots they fill are overwritten by the next step, and their logits are
dropped. Without sequence parallelism nothing is padded.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d.models.gpt import InferenceParams, gather_logits
from parallel3d import parallel_state
from parallel3d.model_chunk import unwrap
from parallel3d.pipeline import get_forward_backward_func


def _is_source() -> bool:
    """The rank that picks tokens: TP rank 0 of the last pipeline stage."""
    st = parallel_state.resolve_parallel_state()
    return st.is_pipeline_last_stage(ignore_virtual=True) and st.tensor_model_parallel_rank == 0


def _share_from_source(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the source rank holds it, on every rank of this model replica (in place)."""
    st = parallel_state.resolve_parallel_state()
    if st.tensor_model_parallel_size > 1 and st.is_pipeline_last_stage(ignore_virtual=True):
        dist.broadcast(t, src=st.group_ranks["tp"][0], group=st.tensor_model_parallel_group)
    if st.pipeline_model_parallel_size > 1:
        dist.broadcast(t, src=st.group_ranks["pp"][-1], group=st.pipeline_model_parallel_group)
    return t


def sample_token(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
                 generator: Optional[torch.Generator] = None) -> int:
    """Draw one id from fp32 ``logits`` [vocab] (Megatron's top-k then top-p filtering; 0 = off)."""
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the ones before it already reach top_p (the most likely one always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def check_generation_args(prompt_ids: Sequence[int], max_new_tokens: int, config, *, greedy: bool = True,
                          temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0) -> None:
    """Raise ValueError naming the problem with a request for ``config``'s model (before any collective)."""
    vocab_size = config.vocab_size
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: generation needs at least one token")
    bad = [i for i in prompt_ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the model's vocabulary [0, {vocab_size})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    total = len(prompt_ids) + max_new_tokens
    if config.position_embedding_type == "learned_absolute" and total - 1 > config.max_position_embeddings:
        raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus {max_new_tokens} new tokens needs "
                         f"{total - 1} positions, more than max_position_embeddings ({config.max_position_embeddings})")
    if not greedy:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (0 = off), got {top_p}")


@torch.no_grad()
def generate(
    model: Sequence[torch.nn.Module],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: Optional[int] = None,
) -> tuple[list[int], list[float]]:
    """Continue ``prompt_ids`` by ``max_new_tokens`` tokens; returns (tokens, logprobs) on every rank.

    ``model``: this rank's GPTModel chunks (DDP-wrapped or not), one per virtual stage.
    ``greedy``: argmax; else sample at ``temperature`` after top-k / top-p filtering with a
    generator seeded by ``seed`` (None: a random seed). ``max_new_tokens=0`` scores the prompt.
    """
    chunks = list(model)
    config = unwrap(chunks[0]).config
    vocab = config.vocab_size
    check_generation_args(prompt_ids, max_new_tokens, config, greedy=greedy, temperature=temperature, top_k=top_k,
                          top_p=top_p)
    device = next(chunks[0].parameters()).device
    tp_group = unwrap(chunks[-1]).tp_group
    pad_to = config.tensor_model_parallel_size if config.sequence_parallel else 1
    learned = config.position_embedding_type == "learned_absolute"
    tokens = [int(i) for i in prompt_ids]
    n = len(tokens)
    cache = InferenceParams(1, n + max_new_tokens + pad_to)
    forward_backward = get_forward_backward_func()
    generator = None
    if not greedy and _is_source():
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()

    def forward(new_ids: list[int]) -> Optional[torch.Tensor]:
        """Logits [len(new_ids), padded_vocab/tp] of new_ids at the cache offset (last stage; else None)."""
        real = len(new_ids)
        padded = -(-real // pad_to) * pad_to
        ids = torch.tensor([new_ids + [0] * (padded - real)], dtype=torch.long, device=device)
        offset = cache.sequence_len_offset
        positions = torch.arange(offset, offset + padded, device=device).unsqueeze(0)
        if learned:  # pads past the table reuse its last row: only their own (discarded) outputs see them
            positions = positions.clamp(max=config.max_position_embeddings - 1)

        def step(data_iterator, chunk):
            data = next(data_iterator) if chunk.pre_process else None
            out = chunk(data, positions, inference_params=cache)
            return out, lambda logits: (logits.new_zeros(()), {"logits": logits})

        outs = forward_backward(forward_step_func=step, data_iterator=[iter([ids]) for _ in chunks], model=chunks,
                                num_microbatches=1, forward_only=True, variable_seq_lengths=True)
        cache.sequence_len_offset += real
        return outs[0]["logits"][0, :real] if outs else None

    def log_probs(logits: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(log-probabilities, logits) over the real vocabulary in fp32, gathered over TP (last stage)."""
        if logits is None:
            return None, None
        full = gather_logits(logits.float(), vocab, tp_group)
        return torch.log_softmax(full, dim=-1), full

    def choose(lp_last: Optional[torch.Tensor], logits_last: Optional[torch.Tensor]) -> tuple[int, float]:
        pick = torch.zeros(2, dtype=torch.float64, device=device)
        if _is_source():
            if greedy:
                token = int(torch.argmax(lp_last).item())
            else:
                token = sample_token(logits_last, temperature=temperature, top_k=top_k, top_p=top_p,
                                     generator=generator)
            pick[0], pick[1] = token, lp_last[token].item()
        _share_from_source(pick)
        return int(pick[0].item()), float(pick[1].item())

    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        lp, full = log_probs(forward(tokens))
        prompt_lp = torch.zeros(n - 1, dtype=torch.float32, device=device)
        if lp is not None:
            prompt_lp.copy_(lp[torch.arange(n - 1, device=device), torch.tensor(tokens[1:], device=device)])
        logprobs = [float(x) for x in _share_from_source(prompt_lp).tolist()] if n > 1 else []
        for step_index in range(max_new_tokens):
            if step_index > 0:
                lp, full = log_probs(forward([tokens[-1]]))
            token, token_lp = choose(None if lp is None else lp[-1], None if full is None else full[-1])
            tokens.append(token)
            logprobs.append(token_lp)
    finally:
        for c, mode in zip(chunks, was_training):
            c.train(mode)
    return tokens, logprobs
