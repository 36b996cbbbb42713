"""Tokenizers with Megatron's interface: ``tokenize``, ``detokenize``, ``vocab_size``, ``eod``.

"byte" needs no files (ids 0..255 are UTF-8 bytes, 256 is the end-of-document
token). "HuggingFaceTokenizer" reads a local ``tokenizer.json`` with the
``tokenizers`` package, imported only when used; it never downloads anything.
"""
from __future__ import annotations

import os

from parallel3d.data.gpt2_bpe import GPT2BPETokenizer

# Tried in order when no eod is given.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class ByteTokenizer:
    """UTF-8 bytes as token ids; ``eod = 256``, ``vocab_size = 257``."""

    def __init__(self) -> None:
        self.eod = 256
        self.vocab_size = 257

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        """Bytes back to text; eod tokens are dropped, invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not (0 <= i < 256 or i == self.eod)]
        if bad:
            raise ValueError(f"ids {bad[:5]} are outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
        return bytes(i for i in ids if i != self.eod).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A ``tokenizers.Tokenizer`` from a local ``tokenizer.json`` (or a directory holding one).

    ``tokenize`` applies the tokenizer's post-processor (its special tokens, e.g.
    a BOS), as Megatron's HuggingFace tokenizer does. ``eod`` is the given id or
    token string, else the first of ``<|endoftext|>``, ``</s>``,
    ``<|end_of_text|>``, ``<eos>`` in the vocabulary.
    """

    def __init__(self, tokenizer_model: str, eod: int | str | None = None) -> None:
        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"tokenizer file not found: {path} (HuggingFaceTokenizer needs a local tokenizer.json "
                f"or a directory containing one; nothing is downloaded)"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                "HuggingFaceTokenizer needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        self.tokenizer_model = tokenizer_model
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception that names neither the file nor the cause
            raise ValueError(f"cannot read tokenizer file {path}: {' '.join(str(e).split())} (is it a complete "
                             "HuggingFace tokenizer.json?)") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = self._resolve_eod(eod, path)

    def _resolve_eod(self, eod: int | str | None, path: str) -> int:
        if isinstance(eod, int):
            if not 0 <= eod < self.vocab_size:
                raise ValueError(f"eod id {eod} is outside the vocabulary [0, {self.vocab_size}) of {path}")
            return eod
        candidates = (eod,) if eod is not None else _EOD_CANDIDATES
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(f"{path} has none of the eod tokens {list(candidates)}; pass eod= an id or token")

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


TOKENIZER_TYPES = ("byte", "HuggingFaceTokenizer", "GPT2BPETokenizer")


def build_tokenizer(
    tokenizer_type: str = "byte", tokenizer_model: str | None = None, eod: int | str | None = None,
    vocab_file: str | None = None, merge_file: str | None = None,
) -> ByteTokenizer | HuggingFaceTokenizer | GPT2BPETokenizer:
    """Megatron's ``--tokenizer-type`` / ``--tokenizer-model`` (``--vocab-file`` / ``--merge-file`` for
    GPT2BPETokenizer); ``eod`` overrides the eod token."""
    if tokenizer_type == "GPT2BPETokenizer":
        if tokenizer_model is not None or eod is not None:
            raise ValueError("GPT2BPETokenizer reads --vocab-file and --merge-file; its eod is <|endoftext|>")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if vocab_file is not None or merge_file is not None:
        raise ValueError(f"--vocab-file/--merge-file belong to GPT2BPETokenizer, not {tokenizer_type}")
    if tokenizer_type == "byte":
        if tokenizer_model is not None:
            raise ValueError(f"the byte tokenizer takes no tokenizer_model, got {tokenizer_model!r}")
        if eod is not None:
            raise ValueError("the byte tokenizer's eod is fixed at 256")
        return ByteTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs tokenizer_model: a tokenizer.json path or its directory")
        return HuggingFaceTokenizer(tokenizer_model, eod=eod)
    raise ValueError(f"unknown tokenizer_type {tokenizer_type!r}; choose from {TOKENIZER_TYPES}")
