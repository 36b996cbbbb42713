"""Corrupt .idx entries are refused when the dataset opens, naming the file, the sequence and the numbers.

Megatron's index holds, per sequence, a length (tokens) and a pointer (byte offset in the .bin);
only the last entry used to be checked against the .bin's size, so a corrupt entry in the middle
read garbage tokens or crashed mid-training. Each case below edits one field of a valid pair.
"""
import os
import time

import numpy as np
import pytest

from parallel3d.data import IndexedDataset, IndexedDatasetBuilder, get_blend_from_list, normalize

N = 300  # sequences, each its own document
PREAMBLE = 34  # magic(9) + version(8) + dtype code(1) + sequence count(8) + document count(8)


@pytest.fixture
def prefix(tmp_path):
    rng = np.random.default_rng(0)
    p = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(p + ".bin", np.uint16)
    for _ in range(N):
        doc = rng.integers(0, 1000, size=int(rng.integers(1, 20)))
        builder.add_document(doc, [len(doc)])
    builder.finalize(p + ".idx")
    return p


def _poke(prefix, field, index, value):
    """Overwrite one entry of the .idx's "lengths" (int32), "pointers" (int64) or "documents" (int64)."""
    with open(prefix + ".idx", "rb") as f:
        data = bytearray(f.read())
    offset = {"lengths": PREAMBLE, "pointers": PREAMBLE + 4 * N, "documents": PREAMBLE + 12 * N}[field]
    dtype = np.int32 if field == "lengths" else np.int64
    np.frombuffer(data, dtype, count=N + (field == "documents"), offset=offset)[index] = value
    with open(prefix + ".idx", "wb") as f:
        f.write(data)


def test_the_intact_pair_opens(prefix):
    ds = IndexedDataset(prefix)
    assert len(ds) == N and ds[N - 1].size == ds.sequence_lengths[-1]


@pytest.mark.parametrize("field,index,value,message", [
    ("lengths", 100, 50_000, r"sequence 100 \(pointer \d+ \+ 50000 tokens x 2 bytes = \d+\) ends beyond the "
                             r"\d+-byte .bin"),
    ("pointers", 200, 10**12, r"sequence 200 starts at byte 1000000000000, beyond the \d+-byte .bin"),
    ("lengths", 7, -5, r"sequence 7 has negative length -5"),
    ("pointers", 9, -16, r"sequence 9 has negative pointer -16"),
    ("pointers", 0, 2, r"sequence 0 starts at byte 2, expected 0"),
    ("pointers", 50, 4, r"sequence 50 starts at byte 4 but sequence 49 ends at byte \d+"),  # overlaps earlier data
    ("lengths", 60, 0, r"sequence 61 starts at byte \d+ but sequence 60 ends at byte \d+"),  # a gap
    ("documents", 120, 3, r"document index 120 is 3, below the previous 119: document indices must not decrease"),
    ("documents", 299, 10**9, r"document index 300 is 300, below the previous 1000000000"),
], ids=["length_50000_at_100", "pointer_1e12_at_200", "negative_length", "negative_pointer", "first_pointer_not_0",
        "overlap", "gap", "decreasing_document_index", "document_index_out_of_range"])
def test_a_corrupt_index_entry_is_refused_at_open(prefix, field, index, value, message):
    _poke(prefix, field, index, value)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert prefix + ".idx" in str(info.value)


def test_both_issue_cases_together_are_refused(prefix):
    _poke(prefix, "lengths", 100, 50_000)
    _poke(prefix, "pointers", 200, 10**12)
    with pytest.raises(ValueError, match=r"corpus_text_document.idx: sequence 200 starts at byte 1000000000000"):
        IndexedDataset(prefix)


def test_validation_is_vectorised(tmp_path):
    """Two million sequences open in well under a second (the checks are numpy passes, not a Python loop)."""
    n = 2_000_000
    p = str(tmp_path / "big")
    builder = IndexedDatasetBuilder(p + ".bin", np.uint16)
    builder.add_document(np.zeros(n, np.uint16), [1] * n)
    builder.finalize(p + ".idx")
    start = time.perf_counter()
    IndexedDataset(p)
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------- issue 29, item 10: stale stats, blend weights


def test_a_stats_file_left_from_an_older_bin_is_detected_even_with_its_mtime_restored(prefix):
    """The .bin rewritten in place with larger ids, same size, its modification time set back."""
    from parallel3d.data.token_stats import check_tokens_fit_vocab, max_token_id

    bin_path = prefix + ".bin"
    assert max_token_id(prefix, np.uint16) < 1000
    st = os.stat(bin_path)
    data = np.fromfile(bin_path, np.uint16)
    data[len(data) // 2] = 5000
    data.tofile(bin_path)
    os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(bin_path).st_size == st.st_size and os.stat(bin_path).st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ValueError, match=r"corpus_text_document.bin holds token id 5000 but the vocabulary has "
                                         r"1000 ids"):
        check_tokens_fit_vocab(prefix, np.uint16, 1000, "--tokenizer-type X")


@pytest.mark.parametrize("data_path,message", [
    (["inf", "A"], r"--data-path weight 'inf' of A must be a finite number > 0"),
    (["nan", "A", "1", "B"], r"weight 'nan' of A must be a finite number > 0"),
    (["0.5", "A", "-1", "B"], r"weight '-1' of B must be a finite number > 0"),
    (["0", "A", "1", "B"], r"weight '0' of A must be a finite number > 0"),
], ids=["inf", "nan", "negative", "zero"])
def test_blend_weights_must_be_finite_and_positive(data_path, message):
    with pytest.raises(ValueError, match=message):
        get_blend_from_list(data_path)


def test_huge_blend_weights_are_normalised_not_lost():
    prefixes, weights = get_blend_from_list(["1e308", "A", "1e308", "B"])
    assert prefixes == ["A", "B"] and normalize(weights) == [0.5, 0.5]
