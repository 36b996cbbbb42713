"""Indexed .bin/.idx files, GPTDataset, blends, samplers and tokenizers (parallel3d.data)."""
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from parallel3d.data import (
    BlendedDataset,
    ByteTokenizer,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    best_fitting_dtype,
    build_blending_indices,
    build_pretraining_data_loader,
    build_tokenizer,
    build_train_valid_test_datasets,
    get_blend_from_list,
    get_split_indices,
)
from parallel3d.data.gpt_dataset import _build_sample_index

HEADER = b"MMIDIDX\x00\x00"


def hand_built_idx(dtype_code, lengths, pointers, doc_indices):
    """The .idx bytes straight from the format description."""
    out = HEADER + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    out += struct.pack(f"<{len(lengths)}i", *lengths)
    out += struct.pack(f"<{len(pointers)}q", *pointers)
    out += struct.pack(f"<{len(doc_indices)}q", *doc_indices)
    return out


def write_pair(prefix, idx_bytes, bin_bytes):
    with open(prefix + ".idx", "wb") as f:
        f.write(idx_bytes)
    with open(prefix + ".bin", "wb") as f:
        f.write(bin_bytes)


def write_docs(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_document(doc, [len(doc)] if len(doc) else [])
    builder.finalize(prefix + ".idx")
    return prefix


def random_docs(n, seed, max_len=40, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, max_len))).tolist() for _ in range(n)]


# --------------------------------------------------------------------------- indexed dataset


def test_reader_on_hand_built_uint16_files(tmp_path):
    # 3 sequences in 2 documents: doc0 = [seq0, seq1], doc1 = [seq2]
    seqs = [[1, 2, 3], [65000, 7], [9, 8, 7, 6]]
    lengths = [3, 2, 4]
    pointers = [0, 6, 10]  # bytes, uint16
    bin_bytes = b"".join(struct.pack(f"<{len(s)}H", *s) for s in seqs)
    prefix = str(tmp_path / "hand")
    write_pair(prefix, hand_built_idx(8, lengths, pointers, [0, 2, 3]), bin_bytes)

    ds = IndexedDataset(prefix)
    assert len(ds) == 3
    assert ds.dtype is np.uint16
    assert ds.sequence_lengths.tolist() == lengths
    assert ds.sequence_pointers.tolist() == pointers
    assert ds.document_indices.tolist() == [0, 2, 3]
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
        assert ds[i].dtype == np.uint16
    assert ds[-1].tolist() == seqs[-1]
    assert ds.get(2, offset=1, length=2).tolist() == [8, 7]
    assert ds.get(2, offset=3).tolist() == [6]
    assert [x.tolist() for x in ds[1:3]] == seqs[1:]
    with pytest.raises(IndexError, match="out of range"):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[3]
    # DataLoader workers started by spawn get a pickled copy that reopens the files
    clone = pickle.loads(pickle.dumps(ds))
    assert [clone[i].tolist() for i in range(3)] == seqs


def test_reader_on_hand_built_int32_files(tmp_path):
    seqs = [[100000, -5], [], [70000]]
    bin_bytes = b"".join(struct.pack(f"<{len(s)}i", *s) for s in seqs)
    prefix = str(tmp_path / "hand32")
    write_pair(prefix, hand_built_idx(4, [2, 0, 1], [0, 8, 8], [0, 1, 3]), bin_bytes)
    ds = IndexedDataset(prefix)
    assert ds.dtype is np.int32
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert ds.document_indices.tolist() == [0, 1, 3]


def test_writer_bytes_match_format(tmp_path):
    prefix = str(tmp_path / "w")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_item(torch.tensor([5, 6, 7]))
    builder.add_item(np.array([8]))
    builder.end_document()
    builder.add_document([1, 2, 3, 4, 5], [2, 3])
    builder.finalize(prefix + ".idx")

    expected_idx = hand_built_idx(8, [3, 1, 2, 3], [0, 6, 8, 12], [0, 2, 4])
    expected_bin = struct.pack("<9H", 5, 6, 7, 8, 1, 2, 3, 4, 5)
    assert open(prefix + ".idx", "rb").read() == expected_idx
    assert open(prefix + ".bin", "rb").read() == expected_bin
    # no temp files left; w.stats.json records the largest token id (issue 14)
    assert sorted(os.listdir(tmp_path)) == ["w.bin", "w.idx", "w.stats.json"]


def test_writer_int32_and_empty_document(tmp_path):
    prefix = str(tmp_path / "w32")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    builder.add_document([70000], [1])
    builder.add_document([], [])
    builder.finalize(prefix + ".idx")
    assert open(prefix + ".idx", "rb").read() == hand_built_idx(4, [1], [0], [0, 1, 1])
    assert open(prefix + ".bin", "rb").read() == struct.pack("<i", 70000)


def test_writer_rejects_ids_that_do_not_fit_and_bad_lengths(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="65536"):
        builder.add_item([1, 65536])
    with pytest.raises(ValueError, match="do not cover"):
        builder.add_document([1, 2, 3], [2])
    builder.cancel()
    assert os.listdir(tmp_path) == []


def test_writer_is_atomic(tmp_path):
    prefix = str(tmp_path / "a")
    write_docs(prefix, [[1, 2], [3]])
    old_idx = open(prefix + ".idx", "rb").read()
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_document([9, 9, 9], [3])
    # before finalize the old pair is untouched and still readable
    assert open(prefix + ".idx", "rb").read() == old_idx
    assert IndexedDataset(prefix)[0].tolist() == [1, 2]
    builder.finalize(prefix + ".idx")
    assert IndexedDataset(prefix)[0].tolist() == [9, 9, 9]
    # an abandoned build leaves nothing behind
    builder = IndexedDatasetBuilder(str(tmp_path / "b.bin"), np.uint16)
    builder.add_item([1])
    builder.cancel()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "a.stats.json"]


def test_reader_errors_name_the_problem(tmp_path):
    prefix = str(tmp_path / "e")
    with pytest.raises(FileNotFoundError, match="e.idx"):
        IndexedDataset(prefix)
    good_idx = hand_built_idx(8, [2], [0], [0, 1])
    write_pair(prefix, good_idx, struct.pack("<2H", 1, 2))
    assert IndexedDataset(prefix)[0].tolist() == [1, 2]

    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match="e.bin"):
        IndexedDataset(prefix)
    write_pair(prefix, b"NOTMMIDX\x00" + good_idx[9:], struct.pack("<2H", 1, 2))
    with pytest.raises(ValueError, match="header"):
        IndexedDataset(prefix)
    write_pair(prefix, HEADER + struct.pack("<Q", 2) + good_idx[17:], struct.pack("<2H", 1, 2))
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(prefix)
    write_pair(prefix, good_idx[:-4], struct.pack("<2H", 1, 2))
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)
    write_pair(prefix, good_idx, struct.pack("<1H", 1))
    with pytest.raises(ValueError, match="2 bytes but .* describes 4 bytes"):
        IndexedDataset(prefix)


def test_best_fitting_dtype():
    assert best_fitting_dtype(257) is np.uint16
    assert best_fitting_dtype(65499) is np.uint16
    assert best_fitting_dtype(65500) is np.int32
    assert best_fitting_dtype(128256) is np.int32


# --------------------------------------------------------------------------- GPT dataset


def reference_sample_index(sizes, document_index, seq_length, num_samples):
    """Line-by-line port of Megatron's C++ build_sample_idx (drop last partial, extra token)."""
    out = [(0, 0)]
    doc_pos, doc_offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_len = sizes[document_index[doc_pos]] - doc_offset
            remaining -= doc_len
            if remaining <= 0:
                doc_offset += remaining + doc_len - 1
                remaining = 0
            else:
                doc_pos += 1
                doc_offset = 0
        out.append((doc_pos, doc_offset))
    return np.array(out)


def test_sample_index_matches_megatron_walk():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 30, size=50).astype(np.int32)  # includes empty documents
    sizes[0] = 5
    document_index = rng.permutation(np.tile(np.arange(50), 3)).astype(np.int32)
    document_index[0] = 0
    for seq_length in (1, 4, 17, 64):
        n = (int(sizes[document_index].sum()) - 1) // seq_length
        ours = _build_sample_index(sizes, document_index, seq_length, n)
        np.testing.assert_array_equal(ours, reference_sample_index(sizes, document_index, seq_length, n))


def test_gpt_samples_are_windows_of_the_document_stream(tmp_path):
    docs = random_docs(30, seed=1)
    indexed = IndexedDataset(write_docs(str(tmp_path / "g"), docs))
    config = GPTDatasetConfig(random_seed=1234, sequence_length=16)
    ds = GPTDataset(indexed, "g", np.arange(30), 100, "train", config)
    assert len(ds) >= 100
    stream = np.concatenate([docs[d] for d in ds.document_index])
    # epochs: every document appears the same number of times
    counts = np.bincount(ds.document_index, minlength=30)
    assert (counts == counts[0]).all() and counts[0] * sum(map(len, docs)) >= 100 * 16 + 1
    seen = set()
    for i in range(len(ds)):
        item = ds[i]
        j = int(ds.shuffle_index[i])
        window = torch.from_numpy(stream[j * 16 : j * 16 + 17].astype(np.int64))
        assert torch.equal(item["tokens"], window[:-1])
        assert torch.equal(item["labels"], window[1:])
        assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (16,)
        assert torch.equal(item["position_ids"], torch.arange(16))
        assert torch.equal(item["loss_mask"], torch.ones(16))
        seen.add(j)
    assert seen == set(range(len(ds)))  # the shuffle is a permutation


@pytest.mark.parametrize(
    "num_samples, document_index, shuffle_index, first_tokens",
    [
        # golden values from megatron-core 0.16.1's GPTDataset (seed 1234, seq_length 4)
        (12, [1, 2, 5, 2, 3, 4, 1, 0, 4, 5, 0, 3], [7, 11, 2, 3, 1, 9, 5, 4, 0, 8, 6, 10, 12],
         [[405, 100, 101, 102], [501, 502, 503, 0], [205, 206, 500, 501]]),
        # few samples from the last epoch: Megatron shuffles that epoch separately
        (7, [2, 1, 5, 0, 4, 3, 0, 4, 3, 2, 5, 1], [1, 0, 3, 2, 5, 4, 8, 9, 11, 7, 10, 12, 6],
         [[204, 205, 206, 100], [200, 201, 202, 203], [502, 503, 0, 1]]),
    ],
)
def test_gpt_dataset_matches_megatron(tmp_path, num_samples, document_index, shuffle_index, first_tokens):
    docs = [list(range(100 * k, 100 * k + n)) for k, n in enumerate([5, 3, 7, 2, 6, 4])]
    prefix = write_docs(str(tmp_path / "golden"), docs)
    train, valid, test = build_train_valid_test_datasets([prefix], "1", 4, 1234, (num_samples, 0, 0))
    assert valid is None and test is None
    assert train.document_index.tolist() == document_index
    assert train.shuffle_index.tolist() == shuffle_index
    assert [train[i]["tokens"].tolist() for i in range(3)] == first_tokens
    assert len(train) == 13


def test_gpt_dataset_seed_determinism(tmp_path):
    prefix = write_docs(str(tmp_path / "s"), random_docs(40, seed=2))
    build = lambda seed: build_train_valid_test_datasets([prefix], "1", 8, seed, (50, 0, 0))[0]
    a, b, c = build(1), build(1), build(2)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert not all(torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(len(a)))


def test_eod_mask_loss_and_reset_position_ids(tmp_path):
    eod = 999
    docs = [[1, 2, eod], [3, 4, 5, eod], [6, eod]]
    indexed = IndexedDataset(write_docs(str(tmp_path / "m"), docs))
    config = GPTDatasetConfig(random_seed=0, sequence_length=8, eod_token=eod, eod_mask_loss=True, reset_position_ids=True)
    ds = GPTDataset(indexed, "m", np.arange(3), 1, "train", config)
    item = ds[0]
    tokens = item["tokens"].tolist()
    expected_mask = [0.0 if t == eod else 1.0 for t in tokens]
    assert item["loss_mask"].tolist() == expected_mask
    expected_pos, p = [], 0
    for t in tokens:
        expected_pos.append(p)
        p = 0 if t == eod else p + 1
    assert item["position_ids"].tolist() == expected_pos
    with pytest.raises(ValueError, match="eod_token"):
        GPTDatasetConfig(random_seed=0, sequence_length=8, eod_mask_loss=True)


def test_split_indices_and_disjoint_splits(tmp_path):
    assert get_split_indices("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert get_split_indices("98,2,0", 200) == [(0, 196), (196, 200), None]
    assert get_split_indices("1", 10) == [(0, 10), None, None]
    with pytest.raises(ValueError, match="sum"):
        get_split_indices("0,0,0", 10)

    prefix = write_docs(str(tmp_path / "sp"), random_docs(100, seed=3))
    train, valid, test = build_train_valid_test_datasets([prefix], "80,15,5", 8, 7, (20, 5, 2))
    ranges = [set(ds.document_index.tolist()) for ds in (train, valid, test)]
    assert ranges[0] == set(range(0, 80)) and ranges[1] == set(range(80, 95)) and ranges[2] == set(range(95, 100))
    assert len(train) >= 20 and len(valid) >= 5 and len(test) >= 2

    train, valid, test = build_train_valid_test_datasets([prefix], "90,10,0", 8, 7, (20, 5, 0))
    assert test is None and valid is not None

    with pytest.raises(ValueError, match=r"valid split .* is empty"):
        build_train_valid_test_datasets([prefix], "999,1,0", 8, 7, (20, 5, 0))


# --------------------------------------------------------------------------- blends


def test_blending_indices_match_megatron_and_track_weights():
    # golden output of megatron-core 0.16.1's C++ helpers.build_blending_indices
    assert build_blending_indices([0.2, 0.5, 0.3], 24)[0].tolist() == [
        1, 2, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1, 2, 1, 2, 1, 0, 1, 2, 1, 0, 1, 2, 1
    ]
    assert build_blending_indices([0.05, 0.9, 0.05], 24)[0].tolist() == [
        1, 0, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1
    ]
    rng = np.random.default_rng(0)
    for weights in ([0.3, 0.7], [0.2, 0.5, 0.3], [1 / 3] * 3, *(rng.dirichlet(np.ones(4)) for _ in range(5))):
        weights = list(weights)
        dataset_index, sample_index = build_blending_indices(weights, 2000)
        onehot = np.eye(len(weights), dtype=np.int64)[dataset_index]
        counts = onehot.cumsum(axis=0)
        # each dataset is read in order: sample k of dataset j is its k-th use
        np.testing.assert_array_equal(sample_index, (counts - onehot)[np.arange(2000), dataset_index])
        # Megatron's rule targets weight * max(i, 1) before sample i, so after n
        # samples a dataset is less than 2 samples off weight * n (1 at the end here)
        deviation = np.abs(counts - np.outer(np.arange(1, 2001), weights))
        assert deviation.max() < 2.0, weights
        assert deviation[-1].max() <= 1.0, weights


def test_get_blend_from_list():
    assert get_blend_from_list(["A"]) == (["A"], None)
    assert get_blend_from_list(["A", "B"]) == (["A", "B"], None)
    assert get_blend_from_list(["30", "A", "70", "B"]) == (["A", "B"], [30.0, 70.0])
    with pytest.raises(ValueError, match="mixes"):
        get_blend_from_list(["0.3", "A", "B"])


def test_weighted_blend_builds_proportional_dataset(tmp_path):
    a = write_docs(str(tmp_path / "A"), random_docs(40, seed=4, vocab=500))
    b = write_docs(str(tmp_path / "B"), [[x + 500 for x in d] for d in random_docs(40, seed=5, vocab=500)])
    train, valid, test = build_train_valid_test_datasets(["0.3", a, "0.7", b], "90,10,0", 8, 1, (300, 20, 0))
    assert test is None
    assert isinstance(train, BlendedDataset) and len(train) == 90 + 210
    from_b = 0
    for i in range(len(train)):
        item = train[i]
        is_b = bool((item["tokens"] >= 500).all())
        assert is_b or bool((item["tokens"] < 500).all())
        assert int(item["dataset_id"]) == int(is_b)
        from_b += is_b
    assert abs(from_b - 0.7 * 300) <= 1
    # items are the constituent's samples
    j = int(train.dataset_sample_index[5])
    assert torch.equal(train[5]["tokens"], train.datasets[int(train.dataset_index[5])][j]["tokens"])
    assert len(valid) == 6 + 14


def test_unweighted_blend_and_missing_file(tmp_path):
    a = write_docs(str(tmp_path / "A"), random_docs(20, seed=6))
    b = write_docs(str(tmp_path / "B"), random_docs(20, seed=7))
    train, _, _ = build_train_valid_test_datasets([a, b], "1", 8, 1, (10, 0, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 10
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        build_train_valid_test_datasets(["0.5", a, "0.5", str(tmp_path / "nope")], "1", 8, 1, (10, 0, 0))


# --------------------------------------------------------------------------- samplers


def test_pretraining_sampler_ranks_partition_and_resume():
    total, mbs, dp = 103, 4, 3
    per_rank = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    flat = [i for batches in per_rank for b in batches for i in b]
    assert len(flat) == len(set(flat))
    assert set(flat) == set(range((total // (mbs * dp)) * mbs * dp))  # last partial global batch dropped
    assert per_rank[1][0] == [4, 5, 6, 7] and per_rank[2][1] == [20, 21, 22, 23]
    # resuming after k global batches continues exactly
    for k in (1, 5):
        for r in range(dp):
            resumed = list(MegatronPretrainingSampler(total, k * mbs * dp, mbs, r, dp))
            assert resumed == per_rank[r][k:]
    # drop_last=False hands out the tail
    tails = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp, drop_last=False)) for r in range(dp)]
    assert sorted(i for t in tails for b in t for i in b) == list(range(total))
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank 2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)


@pytest.mark.parametrize("data_sharding", [True, False])
def test_random_sampler_epochs_and_resume(data_sharding):
    total, mbs, dp = 50, 2, 2
    samplers = [MegatronPretrainingRandomSampler(None, total, 0, mbs, r, dp, data_sharding, seed=3) for r in range(dp)]
    epoch0 = [list(s) for s in samplers]
    flat = [i for batches in epoch0 for b in batches for i in b]
    assert len(flat) == 48 and len(set(flat)) == 48  # one epoch, no repeats
    epoch1 = [list(s) for s in samplers]  # iterating again gives the next epoch
    flat1 = [i for batches in epoch1 for b in batches for i in b]
    assert len(set(flat1)) == 48 and flat1 != flat
    # resume in the middle of epoch 0
    for r in range(dp):
        resumed = list(MegatronPretrainingRandomSampler(None, total, 3 * mbs * dp, mbs, r, dp, data_sharding, seed=3))
        assert resumed == epoch0[r][3:]
    other_seed = list(MegatronPretrainingRandomSampler(None, total, 0, mbs, 0, dp, data_sharding, seed=4))
    assert other_seed != epoch0[0]
    with pytest.raises(ValueError, match="multiple"):
        MegatronPretrainingRandomSampler(None, total, 3, mbs, 0, dp)


def test_data_loader_batches(tmp_path):
    prefix = write_docs(str(tmp_path / "dl"), random_docs(30, seed=8))
    train, _, _ = build_train_valid_test_datasets([prefix], "1", 8, 1, (40, 0, 0))
    loader = build_pretraining_data_loader(train, 8, 4, 1, 2)
    batches = list(loader)
    assert len(batches) == (len(train) - 8) // 8
    first = batches[0]
    assert first["tokens"].shape == (4, 8) and first["tokens"].dtype == torch.int64
    assert torch.equal(first["tokens"][0], train[12]["tokens"])  # consumed 8, rank 1 -> 12..15
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None
    cyclic = build_pretraining_data_loader(train, 0, 4, 0, 2, dataloader_type="cyclic", seed=1)
    assert next(iter(cyclic))["labels"].shape == (4, 8)
    with pytest.raises(ValueError, match="dataloader_type"):
        build_pretraining_data_loader(train, 0, 4, 0, 1, dataloader_type="external")


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eod == 256
    text = "héllo, 世界"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod]) == text
    assert tok.detokenize([0xFF]) == "\ufffd"
    with pytest.raises(ValueError, match="300"):
        tok.detokenize([300])
    with pytest.raises(ValueError, match="unknown tokenizer_type"):
        build_tokenizer("SentencePieceTokenizer")


def test_huggingface_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    with pytest.raises(ValueError, match="tokenizer_model"):
        build_tokenizer("HuggingFaceTokenizer")
