"""Megatron's GPT2BPETokenizer: GPT-2's byte-level BPE from its ``vocab.json`` and ``merges.txt``
(``--vocab-file`` / ``--merge-file``), read with the ``tokenizers`` package; nothing is downloaded."""
from __future__ import annotations

import os

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer:
    """``tokenize`` / ``detokenize`` / ``vocab_size`` / ``eod`` (``<|endoftext|>``), as Megatron's."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        for flag, path, name in (("--vocab-file", vocab_file, "vocab.json"),
                                 ("--merge-file", merge_file, "merges.txt")):
            if not path:
                raise FileNotFoundError(f"GPT2BPETokenizer needs {flag} (GPT-2's {name}; nothing is downloaded)")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer: {flag} {path!r} is not a file (GPT-2's {name}; nothing "
                                        "is downloaded)")
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        except ImportError:
            raise ImportError("GPT2BPETokenizer needs the 'tokenizers' package: pip install tokenizers "
                              "(or pip install 'parallel3d[hf]')") from None
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # tokenizers raises a bare Exception naming neither file
            raise ValueError(f"cannot read GPT-2 BPE files {vocab_file} / {merge_file}: {' '.join(str(e).split())}"
                             ) from None
        self._tokenizer = Tokenizer(bpe)
        # GPT-2's byte-level scheme: no prefix space, bytes mapped to printable characters and back.
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        self.vocab_size = self._tokenizer.get_vocab_size()
        eod = self._tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"{vocab_file} has no {EOD_TOKEN} token (GPT2BPETokenizer's end of document)")
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
