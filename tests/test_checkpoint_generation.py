"""tools/generate.py and parallel3d.models.generation on converted checkpoints, against transformers; training -> HF.

One launch of 4 gloo processes generates from every layout of tests/hf_checkpoints.py (with and
without sequence parallelism), comparing with transformers' own greedy generate and log-probabilities.
"""
import importlib
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from parallel3d.models import GPTModel
from parallel3d.models.config import gpt2_config, llama_config
from parallel3d.models.gpt import InferenceParams
from parallel3d import parallel_state as ps
from parallel3d.training.checkpointing import LATEST_FILE
from parallel3d.models.generation import check_generation_args, generate, sample_token
from parallel3d.testing import run_distributed

from hf_checkpoints import LAYOUTS, NEW_TOKENS, PROMPT, ROOT, _hf_class, _hf_logprobs
from parallel3d.data import build_tokenizer
from parallel3d.tools import generate as generate_tool
from test_megatron_flags import gpt2_files  # noqa: F401 - a fixture: GPT-2 BPE files
from parallel3d.tools.convert_checkpoint import convert


# ------------------------------------------------------------------------------------ generation


def test_kv_cache_decoding_equals_the_full_forward():
    for make in (gpt2_config, llama_config):
        for backend in ("sdpa", "local"):
            cfg = make("tiny", hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend)
            model = GPTModel(cfg).eval()
            ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
            cache = InferenceParams(2, 12)
            with torch.no_grad():
                full = model(ids, None)
                steps = [model(ids[:, :5], None, inference_params=cache)]
                cache.sequence_len_offset = 5
                for t in range(5, 12):
                    steps.append(model(ids[:, t:t + 1], None, inference_params=cache))
                    cache.sequence_len_offset += 1
            assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5, (make.__name__, backend)


def test_sampling_options():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    g = torch.Generator().manual_seed(0)
    assert {sample_token(logits, top_k=2, generator=g) for _ in range(200)} == {1, 2}
    assert {sample_token(logits, top_p=0.3, generator=g) for _ in range(50)} == {1}
    assert len({sample_token(logits, temperature=5.0, generator=g) for _ in range(400)}) == 5
    cfg = gpt2_config("tiny", seq_length=16)
    for args, kwargs, message in (([[]], {}, "the prompt is empty"),
                                  ([[1, 1000]], {}, r"prompt ids \[1000\] are outside the model's vocabulary"),
                                  ([[1] * 10, 8], {}, "needs 17 positions, more than max_position_embeddings"),
                                  ([[1], 2], {"greedy": False, "temperature": 0.0}, "temperature must be > 0"),
                                  ([[1], 2], {"greedy": False, "top_p": 1.5}, r"top_p must be in \[0, 1\]")):
        args = args + [1] if len(args) == 1 else args
        with pytest.raises(ValueError, match=message):
            check_generation_args(args[0], args[1], cfg, **kwargs)


def _generate_everywhere(rank, world_size, cases):
    out = []
    for i, (family, path, tp, pp, vp, sp) in enumerate(cases):
        ps.initialize_model_parallel(tp, pp, vp)
        try:
            chunks, _ = generate_tool.load_model(path, sequence_parallel=sp)
            greedy = generate(chunks, PROMPT, NEW_TOKENS)
            sampled = generate(chunks, PROMPT, 6, greedy=False, temperature=0.9, top_k=50, top_p=0.95, seed=3)
            top1 = generate(chunks, PROMPT, 4, greedy=False, top_k=1, seed=5) if i % 3 == 0 else None
            scored = generate(chunks, greedy[0], 0)
        finally:
            ps.destroy_model_parallel()
        out.append({"greedy": greedy, "sampled": sampled, "top1": top1, "scored": scored})
    return out


def test_generation_matches_transformers_in_every_layout(hf, checkpoints):
    cases = [(family, checkpoints[family][name], tp, pp, vp, False)
             for family in ("gpt2", "llama") for name, tp, pp, vp in LAYOUTS]
    cases += [("gpt2", checkpoints["gpt2"]["tp2pp2"], 2, 2, None, True),  # sequence parallel: padded steps
              ("llama", checkpoints["llama"]["tp4pp1"], 4, 1, None, True)]
    results = run_distributed(_generate_everywhere, 4, args=(cases,), timeout=300)
    assert all(r == results[0] for r in results), "ranks disagree"
    sampled_by_family = {}
    for case, got in zip(cases, results[0]):
        family = case[0]
        _, model, tokens, logprobs = hf[family]
        where = f"{family} TP={case[2]} PP={case[3]} V={case[4]} SP={case[5]}"
        assert got["greedy"][0] == tokens, where
        assert len(got["greedy"][1]) == len(tokens) - 1
        assert max(abs(a - b) for a, b in zip(got["greedy"][1], logprobs)) < 1e-4, where
        assert got["scored"] == (tokens, got["scored"][1])
        assert max(abs(a - b) for a, b in zip(got["scored"][1], logprobs)) < 1e-4, where
        assert got["top1"] is None or got["top1"][0] == tokens[:len(PROMPT) + 4], where
        sampled, sampled_lp = got["sampled"]
        assert sampled[:len(PROMPT)] == PROMPT and len(sampled) == len(PROMPT) + 6
        assert max(abs(a - b) for a, b in zip(sampled_lp, _hf_logprobs(model, sampled))) < 1e-4, where
        sampled_by_family.setdefault(family, set()).add(tuple(sampled))
    # the same seed draws the same tokens in every layout, and not just the greedy ones
    for family, seqs in sampled_by_family.items():
        assert len(seqs) == 1, (family, seqs)
        assert list(next(iter(seqs))) != hf[family][2][:len(PROMPT) + 6], family


def test_generate_cli_under_torchrun(hf, tmp_path):
    """The one torchrun launch: a TP1xPP2 conversion, a text prompt with the byte tokenizer."""
    ckpt = str(tmp_path / "pp2")
    convert("hf", "parallel3d", hf["gpt2"][0], ckpt, target_pipeline_parallel_size=2)
    out = str(tmp_path / "out.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "tools", "generate.py"), "--load", ckpt, "--prompt", "hi!", "--tokenizer-type", "byte",
           "--max-new-tokens", "5", "--greedy", "--output-json", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(out))
    prompt = list(b"hi!")
    model = hf["gpt2"][1]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)[0].tolist()
    assert result["tokens"] == want
    assert max(abs(a - b) for a, b in zip(result["logprobs"], _hf_logprobs(model, want))) < 1e-4
    assert "wrote 8 tokens (5 generated) and 7 log-probabilities" in proc.stdout
    assert proc.stdout.startswith("hi!")


def test_generate_cli_in_one_process_scores_and_samples(hf, tmp_path, monkeypatch):
    """Without torchrun (TP = PP = 1): --score-only, and seeded sampling that repeats itself."""
    ckpt = str(tmp_path / "one")
    convert("hf", "parallel3d", hf["llama"][0], ckpt)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tokens, logprobs = hf["llama"][2], hf["llama"][3]
    out = str(tmp_path / "score.json")
    with redirect_stdout(io.StringIO()):
        generate_tool.main(["--load", ckpt, "--prompt-ids", ",".join(map(str, tokens)), "--score-only",
                            "--output-json", out])
    scored = json.load(open(out))
    assert scored["tokens"] == tokens and max(abs(a - b) for a, b in zip(scored["logprobs"], logprobs)) < 1e-4
    runs = []
    for _ in range(2):
        with redirect_stdout(io.StringIO()):
            runs.append(generate_tool.main(["--load", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
                                            "--temperature", "1.5", "--top-p", "0.9", "--seed", "11",
                                            "--output-json", out]))
    assert runs[0] == runs[1] == json.load(open(out)) and len(runs[0]["tokens"]) == 9


def _generate_cli_error(argv, world_size, monkeypatch) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as info:
        generate_tool.main(argv)
    assert info.value.code == 2
    return err.getvalue()


def test_generate_cli_errors(checkpoints, tmp_path, monkeypatch):
    load = ["--load", checkpoints["gpt2"]["tp2pp2"], "--output-json", str(tmp_path / "o.json")]
    for argv, world, message in (
        (["--prompt-ids", "1,2", "--max-new-tokens", "2"], 2,
         r"world size \(2\) must be the checkpoint's TP \(2\) x PP \(2\) = 4, or 1"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "2", "--greedy", "--temperature", "0.7"], 4,
         "--greedy excludes --temperature"),
        (["--prompt", "hello", "--max-new-tokens", "2"], 4, "--prompt needs --tokenizer-type"),
        (["--prompt-ids", "1,2"], 4, "--max-new-tokens is required"),
        (["--prompt-ids", "1,900", "--score-only"], 4, r"prompt ids \[900\] are outside the model's vocabulary"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "60"], 4, "more than max_position_embeddings"),
    ):
        text = _generate_cli_error(load + argv, world, monkeypatch)
        assert text.startswith("error: ") and re.search(message, text), (argv, text)
    assert "holds no checkpoint" in _generate_cli_error(
        ["--load", str(tmp_path), "--prompt-ids", "1", "--score-only", "--output-json", "x"], 1, monkeypatch)


def test_generate_in_one_process_from_any_layout_without_output_json(checkpoints, hf, monkeypatch, capsys):
    """Issue 30 item 9: generate.py needed exactly TP x PP processes and --output-json."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    tokens, logprobs = hf["gpt2"][2], hf["gpt2"][3]
    result = generate_tool.main(["--load", checkpoints["gpt2"]["tp2pp2"], "--prompt-ids", ",".join(map(str, tokens)),
                                 "--score-only"])
    printed = capsys.readouterr()
    assert "resharding" in printed.err and json.loads(printed.out) == result  # one JSON line on stdout
    assert result["tokens"] == tokens and max(abs(a - b) for a, b in zip(result["logprobs"], logprobs)) < 1e-4


def test_generate_takes_the_checkpoints_tokenizer_and_returns_text(tmp_path, monkeypatch, capsys):
    import gpt_harness as training

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = training.layout_args("gpt2", iters=2, extra=["--tokenizer-type", "byte"])
    args.save = str(tmp_path / "ckpt")
    training.train(args)
    result = generate_tool.main(["--load", args.save, "--prompt", "hi", "--max-new-tokens", "3"])
    assert result["tokens"][:2] == list(b"hi") and len(result["tokens"]) == 5
    assert result["text"].startswith("hi") and json.loads(capsys.readouterr().out)["text"] == result["text"]


# ------------------------------------------------------------------------------------ training -> HF


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_trained_checkpoint_exports_to_transformers_with_the_same_loss(family, tmp_path):
    import gpt_harness as training

    args = training.layout_args(family, iters=2)
    args.save = str(tmp_path / "ckpt")
    result = training.train(args)
    model = result["model"][0].module.eval()
    batch = [training.TokenDataset(8, seed=11)[i] for i in range(4)]
    tokens = torch.stack([b["tokens"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    with torch.no_grad():
        ours = model(tokens, None, labels=labels).mean().item()
    convert("parallel3d", "hf", args.save, str(tmp_path / "hf"))
    with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
        hf_model = _hf_class(family).from_pretrained(str(tmp_path / "hf")).eval()
    assert hf_model.config.vocab_size == training.VOCAB  # the TP padding (to 304) is gone
    with torch.no_grad():
        logits = hf_model(tokens).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1)).item()
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    assert open(os.path.join(args.save, LATEST_FILE)).read() == "2"


def _pretrain_with_sample(rank, world_size, argv):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    pretrain_gpt = importlib.import_module("pretrain_gpt")
    out = io.StringIO()
    with redirect_stdout(out):
        pretrain_gpt.main(argv)
    return out.getvalue()


def test_pretrain_gpt_sample_prompt_uses_the_generation_library(tmp_path):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
            "--pipeline-model-parallel-size", "2", "--log-interval", "1000", "--eval-interval", "1000",
            "--no-progress-bar", "--sample-prompt", "def f", "--sample-tokens", "20"]
    outs = run_distributed(_pretrain_with_sample, 2, args=(argv,), timeout=240,
                           env={"WORLD_SIZE": "2", "PARALLEL3D_CACHE": str(tmp_path)})
    assert "sample (greedy, 20 tokens):\ndef f" in outs[1], outs[1][-2000:]


def test_hf_export_carries_the_trained_tokenizer_and_its_eos(tmp_path, capsys, gpt2_files):
    """Issue 30 item 9: the export had no tokenizer files and `eos_token_id: null`."""
    pytest.importorskip("tokenizers")
    import gpt_harness as training

    vocab_file, merge_file, vocab = gpt2_files
    args = training.layout_args("gpt2", iters=2, extra=["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                                        vocab_file, "--merge-file", merge_file])
    args.save = str(tmp_path / "ckpt")
    training.train(args)
    convert("parallel3d", "hf", args.save, str(tmp_path / "hf"))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["eos_token_id"] == config["bos_token_id"] == vocab["<|endoftext|>"]
    assert open(tmp_path / "hf" / "vocab.json").read() == open(vocab_file).read()
    from transformers import AutoTokenizer

    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert theirs("hello world")["input_ids"] == ours.tokenize("hello world")

    args = training.layout_args("gpt2", iters=2, extra=["--tokenizer-type", "byte"])
    args.save = str(tmp_path / "byte")
    training.train(args)
    capsys.readouterr()
    convert("parallel3d", "hf", args.save, str(tmp_path / "hf_byte"))
    assert json.load(open(tmp_path / "hf_byte" / "config.json"))["eos_token_id"] == build_tokenizer("byte").eod
    assert "note: no tokenizer files in the export: the byte tokenizer has no Hugging Face" in capsys.readouterr().err
