#!/usr/bin/env python3
"""Tokenize a jsonl corpus into Megatron .bin/.idx files (Megatron's tools/preprocess_data.py).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix OUT --tokenizer-type byte --append-eod --workers 4

writes ``OUT_text_document.bin/.idx``: one file pair per json key, one document
per input line, token dtype chosen from the vocabulary size. Whitespace-only
lines are skipped; any other line that is not a JSON object holding a string
under every key stops the run with its line number, and no output pair is
written (files appear only when the whole corpus went through).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

if __package__ in (None, ""):
    # run as a script: make the repo importable without installing it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from parallel3d.bootstrap import reexec_unless_ready  # noqa: E402
    reexec_unless_ready(__file__)  # this Python lacks torch & co: run inside .venv, as the demo does

from parallel3d.data.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype, get_bin_path, get_idx_path
from parallel3d.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from parallel3d.progress import make_bar


class BadInputLine(ValueError):
    """An input line that cannot become a document."""


# Per-process tokenizer, built once by Encoder.initializer in every pool worker.
_TOKENIZER = None


class Encoder:
    """Turns one input line into token ids per json key (picklable: holds only options)."""

    def __init__(self, json_keys: list[str], tokenizer_type: str, tokenizer_model: str | None, append_eod: bool,
                 vocab_file: str | None = None, merge_file: str | None = None) -> None:
        self.json_keys = json_keys
        self.tokenizer_type = tokenizer_type
        self.tokenizer_model = tokenizer_model
        self.append_eod = append_eod
        self.bpe_files = {"vocab_file": vocab_file, "merge_file": merge_file}

    def initializer(self) -> None:
        global _TOKENIZER
        _TOKENIZER = build_tokenizer(self.tokenizer_type, self.tokenizer_model, **self.bpe_files)

    def encode(self, item: tuple[int, bytes]) -> tuple[int, str | None, dict | None, int]:
        """(line number, error or None, {key: token ids} or None for a skipped line, bytes read)."""
        lineno, raw = item
        nbytes = len(raw)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return lineno, f"not valid UTF-8 (byte {e.start})", None, nbytes
        if not line.strip():
            return lineno, None, None, nbytes
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            return lineno, f"invalid JSON: {e.msg} at column {e.colno}", None, nbytes
        if not isinstance(data, dict):
            return lineno, f"expected a JSON object, got {type(data).__name__}", None, nbytes
        ids = {}
        for key in self.json_keys:
            if key not in data:
                return lineno, f"missing key {key!r} (keys: {sorted(data)[:10]})", None, nbytes
            text = data[key]
            if not isinstance(text, str):
                return lineno, f"key {key!r} holds {type(text).__name__}, expected a string", None, nbytes
            doc_ids = _TOKENIZER.tokenize(text)
            # as Megatron: an empty document stays empty, it gets no lone eod
            if doc_ids and self.append_eod:
                doc_ids.append(_TOKENIZER.eod)
            ids[key] = doc_ids
        return lineno, None, ids, nbytes


# Megatron's preprocess_data.py flags with no meaning here: refused, each naming what to do instead.
REFUSED = {
    "--split-sentences": "documents are not split into sentences (Megatron needs nltk for it); each json line is "
                         "one document: split the text before writing the jsonl if you need sentences",
    "--lang": "it chooses the language of --split-sentences, which is not supported",
    "--partitions": "the input is read as one file, tokenized by --workers processes; to partition, split the "
                    "jsonl yourself and run once per part",
    "--vocab-size": "it sizes Megatron's NullTokenizer, which is not supported: use --tokenizer-type byte",
}
# Megatron's flags whose meaning is what happens here anyway: accepted.
ALREADY_SO = {
    "--keep-sequential-samples": "the documents keep the input's order (there are no partitions to merge)",
    "--keep-newlines": "the text is tokenized as it is, newlines included",
}


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="path to the input jsonl file")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each json line")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="byte", choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="tokenizer.json (or its directory) for HuggingFaceTokenizer")
    group.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json for GPT2BPETokenizer")
    group.add_argument("--merge-file", default=None, help="GPT-2's merges.txt for GPT2BPETokenizer")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000, help="report progress every this many lines")
    group = parser.add_argument_group("Megatron-LM flags")
    for flag, why in ALREADY_SO.items():
        group.add_argument(flag, action="store_true", help=f"accepted: {why}")
    for flag, why in REFUSED.items():
        group.add_argument(flag, nargs="*", default=None, help=f"refused: {why}")
    args = parser.parse_args(argv)
    refused = [f"{flag} is not supported: {why}" for flag, why in REFUSED.items()
               if getattr(args, flag[2:].replace("-", "_")) is not None]
    if refused:
        raise ValueError("; ".join(refused))

    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input {args.input} does not exist")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        raise ValueError(f"--log-interval must be >= 1, got {args.log_interval}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise ValueError(f"--json-keys has duplicates: {args.json_keys}")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"output directory {out_dir} (from --output-prefix) does not exist")
    return args


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Run the tool; returns {json key: written path prefix}. Raises on bad input."""
    args = get_args(argv)
    bpe_files = {"vocab_file": args.vocab_file, "merge_file": args.merge_file}
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, **bpe_files)  # fail early on a bad one
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    encoder = Encoder(args.json_keys, args.tokenizer_type, args.tokenizer_model, args.append_eod, **bpe_files)
    prefixes = {key: output_prefix_for_key(args.output_prefix, key) for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(get_bin_path(prefix), dtype) for key, prefix in prefixes.items()}

    start = time.time()
    total_bytes = 0
    num_docs = 0
    pool = None
    # On a terminal a bar over the input's bytes (elapsed, MB/s, ETA); elsewhere the log lines below.
    bar = make_bar(os.path.getsize(args.input), "tokenizing", unit="B", unit_scale=True)
    try:
        with open(args.input, "rb") as fin:
            if args.workers == 1:
                encoder.initializer()
                encoded = map(encoder.encode, enumerate(fin, start=1))
            else:
                # Spawned, not forked: a fork copies whatever locks the parent's threads hold (torch's, a test
                # runner's), and a worker forked while one was held waited on it forever (CI, 2026-11-27).
                pool = multiprocessing.get_context("spawn").Pool(args.workers, initializer=encoder.initializer)
                encoded = pool.imap(encoder.encode, enumerate(fin, start=1), chunksize=32)
            for lineno, error, ids, nbytes in encoded:
                total_bytes += nbytes
                if bar is not None:
                    bar.update(nbytes)
                if error is not None:
                    raise BadInputLine(f"{args.input}: line {lineno}: {error}")
                if ids is None:
                    continue
                for key, doc_ids in ids.items():
                    builders[key].add_document(doc_ids, [len(doc_ids)] if doc_ids else [])
                num_docs += 1
                if num_docs % args.log_interval == 0 and bar is None:
                    elapsed = max(time.time() - start, 1e-9)
                    print(
                        f"Processed {num_docs} documents ({num_docs / elapsed:.1f} docs/s, "
                        f"{total_bytes / elapsed / 1024**2:.2f} MB/s)",
                        file=sys.stderr,
                    )
        for key, builder in builders.items():
            builder.finalize(get_idx_path(prefixes[key]))
    except BaseException:
        for builder in builders.values():
            builder.cancel()
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    print(f"Done: {num_docs} documents from {args.input} -> {', '.join(prefixes.values())}", file=sys.stderr)
    return prefixes


def cli() -> int:
    """The console script: 0 on success, 1 with one error line."""
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
