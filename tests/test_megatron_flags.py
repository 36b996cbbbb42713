"""Megatron-LM's flags (issue 14, items 9-11, 14): each works with Megatron's meaning or is refused naming the
alternative; GPT-2 BPE files; data tokenized for another vocabulary is refused before training; --help."""
import json
import os
import re
import sys

import numpy as np
import pytest

from parallel3d.training.arguments import ArgumentError, build_parser, parse_args, validate_args
from parallel3d.data import IndexedDatasetBuilder, build_tokenizer
from parallel3d.data.token_stats import check_tokens_fit_vocab, max_token_id, stats_path
from parallel3d.training.megatron_args import ALREADY_SO, REFUSED, scheduler_steps, update_num_microbatches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16"]


def _validate(argv, world=1):
    return validate_args(parse_args(TINY + list(argv)), world)


@pytest.mark.parametrize("value,backend", [("auto", "sdpa"), ("flash", "sdpa"), ("fused", "sdpa"),
                                           ("unfused", "local"), ("local", "local")])
def test_attention_backend_takes_megatrons_values(value, backend):
    assert _validate(["--attention-backend", value]).attention_backend == backend
    assert _validate([]).attention_backend == "sdpa"


def test_ffn_hidden_size_defaults_as_megatron():
    """Megatron's validate_args: 4h, or with --swiglu 2/3 of 4h rounded down to a multiple of 64 (LLaMA-7B's
    11008 is LLaMA's rule, not Megatron's 10880); given, it is kept; a default of 0 is refused, naming it."""
    sizes = {(h, swiglu): _validate(["--hidden-size", str(h), "--num-attention-heads", "32"]
                                    + (["--swiglu"] if swiglu else [])).ffn_hidden_size
             for h in (2048, 4096) for swiglu in (False, True)}
    assert sizes == {(2048, False): 8192, (2048, True): 5440, (4096, False): 16384, (4096, True): 10880}
    assert _validate(["--swiglu", "--ffn-hidden-size", "48"]).ffn_hidden_size == 48
    with pytest.raises(ArgumentError, match="--swiglu with --hidden-size 16: .* is 0; give --ffn-hidden-size"):
        _validate(["--swiglu"])


@pytest.mark.parametrize("flags, activation", [
    ([], "gelu_tanh"),  # biases + Megatron-Core's fused bias-GeLU (bias_gelu_impl): the tanh approximation
    (["--no-bias-gelu-fusion"], "gelu"),  # F.gelu: erf
    (["--disable-bias-linear"], "gelu"),  # Megatron turns the fusion off without biases
    (["--openai-gelu", "--no-bias-gelu-fusion"], "gelu_tanh"),
    (["--openai-gelu", "--disable-bias-linear"], "gelu_tanh"),
    (["--swiglu", "--ffn-hidden-size", "32"], "silu"),
])
def test_the_gelu_is_the_one_megatrons_flags_build(flags, activation):
    from parallel3d.models.config import megatron_gelu_flags
    from parallel3d.training import gpt

    args = _validate(["--vocab-size", "64"] + flags)
    assert gpt.transformer_config_from_args(args).activation == activation
    if activation != "silu":  # export writes flags that build it again (Megatron checkpoints, --use-checkpoint-args)
        again = megatron_gelu_flags(activation, not args.disable_bias_linear)
        rebuilt = _validate(["--vocab-size", "64"] + (["--disable-bias-linear"] if args.disable_bias_linear else [])
                            + (["--openai-gelu"] if again["openai_gelu"] else [])
                            + ([] if again["bias_gelu_fusion"] else ["--no-bias-gelu-fusion"]))
        assert gpt.transformer_config_from_args(rebuilt).activation == activation


@pytest.mark.parametrize("swiglu", [False, True])
def test_bias_activation_fusion_follows_the_flag_of_the_models_activation(swiglu):
    """Megatron's rule: --no-bias-swiglu-fusion turns the fusion off for a SwiGLU model, --no-bias-gelu-fusion
    for a GeLU one; the other activation's flag changes nothing."""
    from parallel3d.training import gpt

    act = ["--swiglu", "--ffn-hidden-size", "32"] if swiglu else []
    own, other = ("--no-bias-swiglu-fusion", "--no-bias-gelu-fusion")[::1 if swiglu else -1]
    fusion = {}
    for flags in [(), (own,), (other,)]:
        args = _validate(act + ["--vocab-size", "64"] + list(flags))
        fusion[flags] = gpt.transformer_config_from_args(args).bias_activation_fusion
    assert fusion == {(): True, (own,): False, (other,): True}


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_name_an_alternative(flag):
    with pytest.raises(ArgumentError, match=re.escape(flag) + " is not supported by parallel3d: .+"):
        _validate([flag, "some-value"])


def test_refused_values_name_an_alternative():
    with pytest.raises(ArgumentError, match="--transformer-impl transformer_engine .*--transformer-impl local"):
        _validate(["--transformer-impl", "transformer_engine"])
    with pytest.raises(ArgumentError, match="SentencePieceTokenizer .*HuggingFaceTokenizer"):
        _validate(["--tokenizer-type", "SentencePieceTokenizer"])
    assert _validate(["--transformer-impl", "local", "--use-mcore-models"]).transformer_impl == "local"


def test_aliases_mean_what_megatron_means():
    args = _validate(["--recompute-activations", "--use-rotary-position-embeddings", "--no-position-embedding"])
    assert (args.recompute_granularity, args.position_embedding_type) == ("selective", "rope")
    with pytest.raises(ArgumentError, match="--no-position-embedding .*rope"):
        _validate(["--no-position-embedding"])
    with pytest.raises(ArgumentError, match="exclusive"):
        _validate(["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])


def test_train_samples_derive_iterations_and_a_schedule_in_samples():
    args = _validate(["--train-samples", "1000", "--global-batch-size", "32", "--lr-warmup-samples", "64",
                      "--lr-decay-samples", "800"])
    assert args.train_iters == 31  # a partial last batch is dropped, as in Megatron
    assert scheduler_steps(args) == {"lr_warmup_steps": 64, "lr_decay_steps": 800, "wd_incr_steps": 1000,
                                     "wsd_decay_steps": None}
    assert _validate([]).train_iters == 100
    it = _validate(["--train-iters", "10", "--lr-warmup-iters", "2", "--global-batch-size", "8"])
    assert scheduler_steps(it)["lr_warmup_steps"] == 16 and scheduler_steps(it)["lr_decay_steps"] == 80
    with pytest.raises(ArgumentError, match="not both"):
        _validate(["--train-samples", "100", "--train-iters", "5"])
    with pytest.raises(ArgumentError, match="--lr-warmup-iters belong to iteration-based"):
        _validate(["--train-samples", "100", "--lr-warmup-iters", "5"])


def test_a_warmup_fraction_is_a_fraction_of_the_decay_samples():
    """Megatron: lr_warmup_steps = fraction x decay samples, not a whole number of iterations: 0.01 of 150
    iterations x 8 samples is 12 samples (1.5 iterations), not 1 iteration's 8."""
    from parallel3d.training.megatron_args import scheduler_steps

    args = _validate(["--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "150",
                      "--lr-warmup-fraction", "0.01"])
    assert args.lr_decay_style == "linear"  # Megatron's default, as every LR flag's
    assert scheduler_steps(args)["lr_warmup_steps"] == pytest.approx(12.0)
    args = _validate(["--micro-batch-size", "8", "--global-batch-size", "8", "--train-samples", "1000",
                      "--lr-decay-samples", "900", "--lr-warmup-fraction", "0.001"])
    assert scheduler_steps(args)["lr_warmup_steps"] == pytest.approx(0.9)


def test_rampup_batch_size_grows_the_batch_as_megatron():
    # global batch 16 -> 32 by 8 over 96 samples, micro batch 4, DP 2: 2, 3 then 4 microbatches
    args = _validate(["--train-samples", "400", "--global-batch-size", "32", "--micro-batch-size", "4",
                      "--rampup-batch-size", "16", "8", "96"], world=2)
    seen = []
    consumed = 0
    for _ in range(args.train_iters):
        update_num_microbatches(args, consumed)
        seen.append(args.global_batch_size)
        consumed += args.global_batch_size
    assert seen[:8] == [16, 16, 16, 24, 24, 32, 32, 32] and consumed <= 400
    assert args.num_microbatches == 4
    with pytest.raises(ArgumentError, match="--rampup-batch-size belong to sample-based training"):
        _validate(["--global-batch-size", "32", "--rampup-batch-size", "16", "8", "96"])
    with pytest.raises(ArgumentError, match="not divisible by --micro-batch-size"):
        _validate(["--train-samples", "400", "--global-batch-size", "32", "--micro-batch-size", "4",
                   "--rampup-batch-size", "6", "2", "96"])


def test_gpt3_175b_script_flags_are_all_known():
    """Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (sizes shrunk): nothing unrecognised."""
    script = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
              "--max-position-embeddings", "16", "--attention-backend", "auto", "--micro-batch-size", "1",
              "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "64", "--train-samples", "1000",
              "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
              "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
              "--lr-warmup-fraction", ".001", "--lr-decay-samples", "900", "--tensor-model-parallel-size", "1",
              "--pipeline-model-parallel-size", "1", "--data-path", "x", "--split", "949,50,1", "--log-interval",
              "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "c", "--load", "c",
              "--eval-iters", "10", "--tensorboard-dir", "tb", "--vocab-file", "v.json", "--merge-file", "m.txt"]
    args = validate_args(parse_args(script), 1)
    assert args.tokenizer_type == "GPT2BPETokenizer" and args.train_iters > 0
    # the script itself gives --train-iters with --rampup-batch-size, which Megatron refuses too
    with pytest.raises(ArgumentError, match="--rampup-batch-size belong to sample-based training"):
        cut = script.index("--train-samples")
        iters = script[:cut] + script[cut + 2:]
        cut = iters.index("--lr-decay-samples")
        validate_args(parse_args(iters[:cut] + iters[cut + 2:] + ["--train-iters", "50"]), 1)


def test_schedule_errors_are_in_iterations():
    with pytest.raises(ArgumentError, match=r"--lr-warmup-iters \(20\) must be < --lr-decay-iters \(10"):
        _validate(["--train-iters", "10", "--lr-warmup-iters", "20"])


def test_every_option_has_a_help_line_and_shows_its_default():
    parser = build_parser()
    assert not [a.dest for a in parser._actions if not a.help]
    text = parser.format_help()
    assert "peak learning rate (default: 0.001)" in " ".join(text.split())
    assert "refused: " in text and all(flag in text for flag in ALREADY_SO)


# ----------------------------------------------------------------------------- GPT-2 BPE files


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture
def gpt2_files(tmp_path):
    """A tiny GPT-2-format vocab.json / merges.txt: the 256 byte symbols, a few merges, <|endoftext|>."""
    symbols = list(_bytes_to_unicode().values())
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


def test_gpt2_bpe_tokenizer_reads_vocab_and_merges(gpt2_files):
    pytest.importorskip("tokenizers")
    vocab_file, merge_file, vocab = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tok.vocab_size == len(vocab) and tok.eod == vocab["<|endoftext|>"]
    ids = tok.tokenize("hello world, ünï")
    assert ids[:2] == [vocab["hell"], vocab["o"]] and vocab["Ġw"] in ids
    assert tok.detokenize(ids) == "hello world, ünï"
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=vocab_file + ".missing")


def test_gpt2_bpe_matches_transformers(gpt2_files):
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file, _ = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    theirs = transformers.GPT2Tokenizer.from_pretrained(os.path.dirname(vocab_file))  # reads the same two files
    for text in ("hello world", "  two  spaces\nand a line", "héllo wörld 123"):
        assert ours.tokenize(text) == theirs.encode(text)


# ----------------------------------------------------------------------------- item 10: data vs vocabulary


def _write(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(d, [len(d)])
    builder.finalize(prefix + ".idx")


def test_preprocessing_records_the_largest_token_id_and_training_refuses_a_smaller_vocab(tmp_path):
    prefix = str(tmp_path / "bpe8k_text_document")
    _write(prefix, [[5, 7999, 3], [0, 12]])
    assert json.load(open(stats_path(prefix)))["max_token_id"] == 7999
    with pytest.raises(ValueError, match=r"bpe8k_text_document\.bin holds token id 7999 but the vocabulary has "
                                         r"257 ids \(--tokenizer-type byte\)"):
        check_tokens_fit_vocab(prefix, np.uint16, 257, "--tokenizer-type byte")
    check_tokens_fit_vocab(prefix, np.uint16, 8000, "HuggingFaceTokenizer")


def test_files_written_elsewhere_are_scanned_once_and_cached(tmp_path):
    prefix = str(tmp_path / "megatron_text_document")
    _write(prefix, [[1, 2, 300]])
    os.remove(stats_path(prefix))  # as Megatron-LM's own preprocessing leaves it
    assert max_token_id(prefix, np.uint16) == 300
    assert json.load(open(stats_path(prefix)))["max_token_id"] == 300
    np.array([1, 2, 900], dtype=np.uint16).tofile(prefix + ".bin")  # rewritten .bin: the cache is stale
    os.utime(prefix + ".bin", ns=(1, 1))
    assert max_token_id(prefix, np.uint16) == 900


def test_pretrain_refuses_wrong_tokenizer_before_training_once(tmp_path):
    """examples/pretrain_gpt.py: the two numbers and the file, one line, exit 2, no training."""
    import subprocess

    prefix = str(tmp_path / "bpe_text_document")
    _write(prefix, [list(range(0, 4000, 7))] * 4)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *TINY,
                           "--data-path", prefix, "--train-iters", "2"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("error:") == 1 and "holds token id 3997 but the vocabulary has 257 ids" in proc.stderr
    assert "iteration" not in proc.stdout


def test_readme_flag_table_matches_the_parser():
    """Every flag README's Megatron table lists is one this parser knows (supported, accepted or refused)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    table = text[text.index("### Megatron-LM flags"):text.index("Every interval logs")]
    flags = set(re.findall(r"(--[a-z][a-z0-9_-]*[a-z0-9])(?!\*)", table)) - {"--moe"}
    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert len(flags) > 80 and flags <= known, sorted(flags - known)
    for row in table.splitlines():
        if row.endswith("refused: use `--bf16` |") or "| refused:" not in row:
            continue
        for flag in re.findall(r"`(--[a-z][a-z0-9_-]*[a-z0-9])`", row.split("|")[1]):
            if flag in REFUSED:
                with pytest.raises(ArgumentError, match="not supported"):
                    _validate([flag])


def test_rampup_with_train_samples_trains_to_the_end_on_the_samples_it_consumes():
    """Issue 30 item 2: the dataset was sized train_iters x the ramp's first batch, so the run ran out of data."""
    from functools import partial
    from gpt_harness import FAMILIES, SEQ, VOCAB, TokenDataset

    from parallel3d.training import gpt
    from parallel3d.training import pretrain
    from parallel3d.training.megatron_args import samples_consumed
    from parallel3d.tensor_parallel import model_parallel_cuda_manual_seed

    argv = FAMILIES["gpt2"][:1] + ["2"] + FAMILIES["gpt2"][2:] + [
        "--seq-length", str(SEQ), "--vocab-size", str(VOCAB), "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-samples", "100", "--rampup-batch-size", "2", "2", "24", "--lr-decay-samples", "80",
        "--log-interval", "1000", "--eval-interval", "1000", "--no-progress-bar"]
    args = validate_args(parse_args(argv, extra_args_provider=gpt.add_sampling_args), 1)
    requested, read = [], set()

    class Counted(TokenDataset):  # exactly as many samples as asked for, as GPTDataset may give
        def __getitem__(self, i):
            read.add(i)
            return super().__getitem__(i)

    def datasets(num_samples):
        requested.append(num_samples[0])
        return Counted(num_samples[0]), None, None

    config = gpt.transformer_config_from_args(args)
    partition = gpt.layer_partition(args, config)
    model_parallel_cuda_manual_seed(args.seed)  # what training.initialize_distributed seeds
    result = pretrain(args, partial(gpt.model_provider, config, partition),
                      partial(gpt.forward_step, False), datasets, model_config=config)
    # batches 2,2,2,2 (8 samples), 4,4 (16), 6,6 (28), then 8 x 9: 100 samples in 17 iterations
    assert (args.train_iters, result["iteration"]) == (17, 17)
    assert samples_consumed(args, args.train_iters) == 100 == len(read) and requested == [100]
