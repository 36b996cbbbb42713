"""tools/preprocess_data.py: jsonl -> Megatron .bin/.idx."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from parallel3d.data import IndexedDataset, build_pretraining_data_loader, build_tokenizer, build_train_valid_test_datasets

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # tools/ is not installed with the package
    sys.path.insert(0, REPO_ROOT)
from parallel3d.tools import preprocess_data  # noqa: E402
TEXTS = ["hello world", "", "héllo 世界\nsecond line", "a" * 300, "x"]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


def test_byte_tokenizer_two_workers_round_trip(tmp_path):
    records = [{"text": t, "title": f"t{i}"} for i, t in enumerate(TEXTS * 20)]
    src = write_jsonl(tmp_path / "corpus.jsonl", records)
    out = str(tmp_path / "out")
    prefixes = preprocess_data.main(
        ["--input", src, "--json-keys", "text", "title", "--output-prefix", out,
         "--tokenizer-type", "byte", "--append-eod", "--workers", "2", "--log-interval", "7"]
    )
    assert prefixes == {"text": out + "_text_document", "title": out + "_title_document"}
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["corpus.jsonl", "out_text_document.bin", "out_text_document.idx", "out_text_document.stats.json",
         "out_title_document.bin", "out_title_document.idx", "out_title_document.stats.json"]
    )
    tok = build_tokenizer("byte")
    for key in ("text", "title"):
        ds = IndexedDataset(prefixes[key])
        assert ds.dtype is np.uint16
        expected = [tok.tokenize(r[key]) + [tok.eod] for r in records if r[key]]  # empty docs get no eod
        assert [ds[i].tolist() for i in range(len(ds))] == expected
        # one document per line, in input order; an empty text is a document with no sequences
        assert len(ds.document_indices) == len(records) + 1
    doc_sizes = np.diff(IndexedDataset(prefixes["text"]).document_indices)
    assert doc_sizes.tolist() == [0 if r["text"] == "" else 1 for r in records]


def test_without_append_eod_and_blank_lines_skipped(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "ab"}\n\n   \n{"text": "c"}\n', encoding="utf-8")
    out = str(tmp_path / "o")
    preprocess_data.main(["--input", str(src), "--output-prefix", out, "--workers", "1"])
    ds = IndexedDataset(out + "_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[97, 98], [99]]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "line 3: invalid JSON"),
        ('{"body": "x"}', "line 3: missing key 'text'"),
        ('{"text": 5}', "line 3: key 'text' holds int"),
        ('["text"]', "line 3: expected a JSON object"),
    ],
)
def test_bad_line_fails_with_its_number_and_writes_nothing(tmp_path, bad_line, message):
    src = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": "ok"}), json.dumps({"text": "fine"}), bad_line, json.dumps({"text": "late"})]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(preprocess_data.BadInputLine, match=message):
        preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--workers", "2"])
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # no output pair, no temp files


def test_argument_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        preprocess_data.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o")])
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    with pytest.raises(ValueError, match="--workers"):
        preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "o"), "--workers", "0"])
    with pytest.raises(FileNotFoundError, match="nodir"):
        preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "nodir" / "o")])


def test_runs_as_a_script_from_repo_root(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "hi"}, {"text": "there"}])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", src, "--output-prefix", str(tmp_path / "s"), "--append-eod"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ds = IndexedDataset(str(tmp_path / "s_text_document"))
    assert [ds[i].tolist() for i in range(2)] == [[104, 105, 256], [116, 104, 101, 114, 101, 256]]

    with open(src, "a") as f:
        f.write("oops\n")
    cmd[cmd.index("--output-prefix") + 1] = str(tmp_path / "bad")
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "line 3" in done.stderr and "Traceback" not in done.stderr


def test_preprocessed_corpus_feeds_training_loader(tmp_path):
    records = [{"text": f"document number {i} " * (1 + i % 5)} for i in range(60)]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    prefix = preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "d"), "--append-eod"])["text"]
    train, valid, test = build_train_valid_test_datasets([prefix], "90,10,0", 32, 1234, (64, 8, 0), eod_token=256)
    assert test is None
    loader = build_pretraining_data_loader(train, 0, 4, 0, 2)
    batch = next(iter(loader))
    assert batch["tokens"].shape == (4, 32) and batch["labels"].shape == (4, 32)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["tokens"].max()) <= 256


# --------------------------------------------------------------------------- HuggingFace tokenizer


def make_wordlevel_tokenizer(directory):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "foo": 3, "<|endoftext|>": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_huggingface_tokenizer(tmp_path):
    directory = make_wordlevel_tokenizer(tmp_path)
    tok = build_tokenizer("HuggingFaceTokenizer", str(directory))
    assert tok.vocab_size == 5 and tok.eod == 4
    assert tok.tokenize("hello foo world bar") == [1, 3, 2, 0]
    assert tok.detokenize([1, 2]) == "hello world"
    same = build_tokenizer("HuggingFaceTokenizer", str(directory / "tokenizer.json"), eod="foo")
    assert same.eod == 3
    with pytest.raises(ValueError, match="nothere"):
        build_tokenizer("HuggingFaceTokenizer", str(directory), eod="nothere")


def test_preprocess_with_huggingface_tokenizer(tmp_path):
    directory = make_wordlevel_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}, {"text": "foo foo hello"}, {"text": "zzz"}])
    out = str(tmp_path / "hf")
    preprocess_data.main(
        ["--input", src, "--output-prefix", out, "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", str(directory), "--append-eod", "--workers", "2"]
    )
    ds = IndexedDataset(out + "_text_document")
    assert ds.dtype is np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 4], [3, 3, 1, 4], [0, 4]]


@pytest.mark.parametrize("flag,alternative", [
    (["--split-sentences"], "--split-sentences is not supported: documents are not split into sentences"),
    (["--partitions", "4"], "--partitions is not supported: the input is read as one file"),
    (["--lang", "english"], "--lang is not supported"),
])
def test_megatrons_preprocessing_flags_are_refused_naming_the_alternative(tmp_path, flag, alternative):
    """Issue 30 item 10: a bare "unrecognized arguments" before."""
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    with pytest.raises(ValueError, match=alternative):
        preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "o")] + flag)


def test_megatrons_flags_that_are_so_already_are_accepted(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a\nb"}, {"text": "c"}])
    prefix = preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "o"),
                                   "--keep-sequential-samples", "--keep-newlines"])["text"]
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(2)] == [[97, 10, 98], [99]]


def test_a_missing_merge_file_is_named_not_none(tmp_path):
    """Issue 30 item 10: `--merge-file None is not a file`."""
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    with pytest.raises(FileNotFoundError, match=r"GPT2BPETokenizer needs --merge-file \(GPT-2's merges.txt"):
        preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "o"),
                              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab)])
