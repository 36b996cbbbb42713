"""FP8 against bf16 on real text: the same GPT-2-small-shape run, same seed and data, in each precision.

    python3 bench/fp8_convergence.py [--out DIR] [--train-iters 2000]          # one GPU, both runs, then the plot
    python3 bench/fp8_convergence.py --plot DIR/fp8_convergence.json --png docs/fp8_convergence.png
    python3 bench/fp8_convergence.py --cpu-smoke --out DIR                      # the harness on a CPU, tiny model

Each run is examples/pretrain_gpt.py under torchrun on one GPU, the training application as users
run it: GPT-2 small's shape (12 layers, hidden 768, 12 heads, 512 tokens), bf16, Adam with cosine
decay; the FP8 runs add Megatron's flags of ``gpt_bench.FP8_RECIPES``. ``--seed`` is the same, so
both start from the same weights and read the same batches in the same order.

Data: byte-level tokens (the library's default tokenizer; no GPT-2 BPE files travel to the GPU machine)
of Python source that every machine running this has: the standard library's files and the installed
torch package's (``--corpus python``), code and English docstrings. A run must not read its training split
more than once, or the curves compare memorisation (the first 2,000-step run read a 10 MB standard
library, a distribution's without its tests, 2.3 times: training loss 0.68 against validation 0.89); the
harness refuses such a run before training (``check_no_repeat``). The demo's corpus (pydoc_data,
``--corpus pydoc``) is 0.47 MB: for the CPU smoke run. The standard library alone is ``--corpus stdlib``.
The dataset is written once under ``--data-dir``.

Result: OUT/fp8_convergence.json with each run's training loss every ``--log-interval`` steps (the mean
of those steps, from ``--log-json``), its validation losses, and per FP8 recipe the relative difference
of the final loss (the mean of the last ``--log-interval`` steps) from bf16's; OUT/fp8_convergence.png
where matplotlib is present; each run's output and --log-json file in OUT/logs. Every run is bounded by
``--timeout``; a run cut short keeps its curve so far.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from launch import bounded  # noqa: E402

GOAL = 0.01  # issue 28: FP8's final loss within 1% of bf16's
MODEL = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "512",
         "--max-position-embeddings", "512"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64"]


def stdlib_files() -> list[str]:
    """The standard library's .py files in a fixed order (installed packages excluded)."""
    return python_files(sysconfig.get_paths()["stdlib"])


def python_files(top: str) -> list[str]:
    """The .py files under ``top`` in a fixed order (installed packages and caches excluded)."""
    found = []
    for d, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs if not x.endswith("-packages") and x != "__pycache__")
        found += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return found


def build_corpus(corpus: str, data_dir: str, max_mb: float) -> tuple[str, dict]:
    """(dataset prefix, what it holds): one document per file (python, stdlib) or paragraph (pydoc), byte tokens."""
    import torch

    from parallel3d.data import IndexedDatasetBuilder, best_fitting_dtype, build_tokenizer

    tokenizer = build_tokenizer("byte")
    prefix = os.path.join(data_dir, f"{corpus}_{max_mb:g}mb_byte_text_document")
    info_path = prefix + ".corpus.json"
    if os.path.exists(prefix + ".idx") and os.path.exists(info_path):
        return prefix, json.load(open(info_path))
    if corpus in ("stdlib", "python"):
        files = stdlib_files() + (python_files(os.path.dirname(torch.__file__)) if corpus == "python" else [])
        texts = (open(p, encoding="utf-8", errors="replace").read() for p in files)
    else:
        from pydoc_data.topics import topics
        texts = (p.strip() for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip())
    os.makedirs(data_dir, exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=best_fitting_dtype(tokenizer.vocab_size))
    documents = tokens = 0
    for text in texts:
        ids = tokenizer.tokenize(text) + [tokenizer.eod]
        builder.add_document(ids, [len(ids)])
        documents, tokens = documents + 1, tokens + len(ids)
        if tokens >= max_mb * 2 ** 20:
            break
    builder.finalize(prefix + ".idx")
    info = {"corpus": corpus, "documents": documents, "tokens": tokens, "python": sys.version.split()[0],
            "torch": torch.__version__}
    with open(info_path, "w") as f:
        json.dump(info, f)
    return prefix, info


TRAIN_SHARE = 0.95  # --split 95,5,0


def check_no_repeat(a: argparse.Namespace, corpus: dict) -> None:
    """Refuse a run that would read its training split more than once (its loss would measure memorisation)."""
    model = TINY if a.cpu_smoke else MODEL
    needed = a.train_iters * a.global_batch_size * (int(model[model.index("--seq-length") + 1]) + 1)
    held = int(corpus["tokens"] * TRAIN_SHARE)
    if needed > held:
        raise SystemExit(f"fp8_convergence: --train-iters {a.train_iters} x --global-batch-size {a.global_batch_size} "
                         f"reads {needed:,} tokens, but the {corpus['corpus']} corpus's training split holds "
                         f"{held:,}: the run would repeat it. Use --corpus python, a larger --corpus-mb, or fewer "
                         "iterations")


def train_args(a: argparse.Namespace, prefix: str, log_json: str) -> list[str]:
    return (TINY if a.cpu_smoke else MODEL) + [
        "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size", str(a.global_batch_size),
        "--train-iters", str(a.train_iters), "--lr", str(a.lr), "--min-lr", str(a.lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(a.train_iters // 20), "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(a.seed),
        "--bf16", "--data-path", prefix, "--split", f"{round(100 * TRAIN_SHARE)},{round(100 * (1 - TRAIN_SHARE))},0",
        "--tokenizer-type", "byte",
        "--log-interval", str(a.log_interval), "--eval-interval", str(a.eval_interval), "--eval-iters", "10",
        "--log-json", log_json, "--no-progress-bar",
    ]


def train(name: str, flags: list[str], a: argparse.Namespace, prefix: str) -> dict:
    """One pretrain_gpt.py run; its curves from its --log-json (what it logged before any timeout)."""
    from parallel3d.tools.plot_log import read_log

    log_json = os.path.join(a.out, "logs", f"fp8_convergence_{name}.jsonl")  # logs/: run_gpu_benches.sh packs it
    if os.path.exists(log_json):
        os.remove(log_json)  # --log-json appends
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(ROOT, "examples", "pretrain_gpt.py")] + train_args(a, prefix, log_json) + flags
    env = {**os.environ, **({"PARALLEL3D_DEVICE": "cpu"} if a.cpu_smoke else {})}
    t0, status = time.monotonic(), "finished"
    with open(os.path.join(a.out, "logs", f"fp8_convergence_{name}.log"), "w") as log:
        code = bounded(cmd, a.timeout, stdout=log, stderr=subprocess.STDOUT, env=env)
        if code is None:
            status = f"cut at the {a.timeout} s timeout"
        elif code:
            status = f"failed (exit {code})"
    try:
        train_loss, valid_loss = read_log(log_json)
    except (OSError, ValueError):
        train_loss, valid_loss = {}, {}
    times = []
    if os.path.exists(log_json):
        with open(log_json) as f:
            times = [r["iteration_time_s"] for r in map(json.loads, f) if r.get("type") == "train"]
    print(f"{name}: {status} in {time.monotonic() - t0:.0f} s, {max(train_loss, default=0)} iterations logged, "
          f"final loss {train_loss[max(train_loss)] if train_loss else float('nan'):.4f}", flush=True)
    return {"flags": flags, "status": status, "wall_s": time.monotonic() - t0,
            "median_iteration_s": sorted(times)[len(times) // 2] if times else None,
            "train_loss": {str(k): v for k, v in sorted(train_loss.items())},
            "valid_loss": {str(k): v for k, v in sorted(valid_loss.items())}}


def compare(result: dict) -> dict:
    """Per FP8 run: final loss (the last logged interval's mean) against bf16's at the same iteration."""
    runs, out = result["runs"], {}
    base = runs.get("bf16", {}).get("train_loss", {})
    for name, r in runs.items():
        if name == "bf16" or not r["train_loss"]:
            continue
        last = max(r["train_loss"], key=int)
        if last in base:
            rel = (r["train_loss"][last] - base[last]) / base[last]
            out[name] = {"iteration": int(last), "bf16": base[last], "fp8": r["train_loss"][last],
                         "relative_difference": rel, "within_goal": abs(rel) <= GOAL}
    return out


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    base = result["runs"].get("bf16", {}).get("train_loss", {})
    for name, r in result["runs"].items():
        its = sorted(int(k) for k in r["train_loss"])
        line, = ax.plot(its, [r["train_loss"][str(i)] for i in its], label=f"{name} training")
        valid = sorted(int(k) for k in r["valid_loss"])
        if valid:
            ax.plot(valid, [r["valid_loss"][str(i)] for i in valid], "o--", color=line.get_color(), ms=4,
                    label=f"{name} validation")
        if name != "bf16":
            both = [i for i in its if str(i) in base]
            dx.plot(both, [100 * (r["train_loss"][str(i)] / base[str(i)] - 1) for i in both], color=line.get_color(),
                    label=name)
    info = result["corpus"]
    ax.set_ylabel("loss (nats per byte)")
    text = {"stdlib": "Python standard library source", "python": "Python source (standard library and torch)",
            "pydoc": "Python documentation (pydoc_data)"}[info["corpus"]]
    ax.set_title(f"FP8 against bf16: GPT-2-small shape, {result['settings']['train_iters']:,} steps\n"
                 f"{info['tokens'] / 2**20:.0f} MB of {text} as bytes, read once")
    ax.grid(alpha=0.3)
    ax.legend()
    dx.axhspan(-100 * GOAL, 100 * GOAL, color="0.9")
    dx.axhline(0, color="0.5", lw=0.8)
    dx.set_ylabel("training loss vs bf16 (%)")
    dx.set_xlabel("iteration")
    dx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def report(result: dict) -> str:
    lines = [f"{name}: iteration {c['iteration']}, mean loss of the last interval {c['fp8']:.4f} against bf16 "
             f"{c['bf16']:.4f}: {100 * c['relative_difference']:+.2f}% ({'within' if c['within_goal'] else 'OUTSIDE'} "
             f"{100 * GOAL:.0f}%)" for name, c in result["final"].items()]
    return "\n".join(lines) or "no FP8 run reached a logged iteration that bf16 also logged"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    p.add_argument("--recipes", nargs="+", default=["tensorwise"], help="FP8 recipes (gpt_bench.FP8_RECIPES)")
    p.add_argument("--train-iters", type=int, default=2000)
    p.add_argument("--micro-batch-size", type=int, default=24)
    p.add_argument("--global-batch-size", type=int, default=24)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--eval-interval", type=int, default=500)
    p.add_argument("--timeout", type=int, default=240, help="seconds per run before it is killed")
    p.add_argument("--corpus", choices=("python", "stdlib", "pydoc"), default="python")
    p.add_argument("--corpus-mb", type=float, default=64.0, help="at most this many MB of the corpus")
    p.add_argument("--data-dir", default="/tmp/fp8_convergence_data")
    p.add_argument("--plot", default=None, help="only draw this fp8_convergence.json (to --png) and report it")
    p.add_argument("--png", default=None, help="the plot's file (default: OUT/fp8_convergence.png)")
    p.add_argument("--cpu-smoke", action="store_true", help="the harness on CPU processes: tiny model, 20 steps")
    a = p.parse_args(argv)
    if a.plot:
        with open(a.plot) as f:
            result = json.load(f)
        plot(result, a.png or os.path.splitext(a.plot)[0] + ".png")
        print(report(result))
        return 0
    if a.cpu_smoke:
        a.train_iters, a.micro_batch_size, a.global_batch_size, a.log_interval, a.eval_interval, a.corpus_mb = \
            20, 4, 4, 5, 10, 1.0
    from gpt_bench import FP8_RECIPES

    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    prefix, corpus = build_corpus(a.corpus, a.data_dir, a.corpus_mb)
    print(f"corpus: {corpus}", flush=True)
    check_no_repeat(a, corpus)
    result = {"corpus": corpus, "settings": {k: v for k, v in vars(a).items() if k not in ("plot", "png")},
              "runs": {"bf16": train("bf16", [], a, prefix)}}
    for recipe in a.recipes:
        result["runs"][f"fp8 {recipe}"] = train(f"fp8_{recipe}", FP8_RECIPES[recipe], a, prefix)
    result["final"] = compare(result)
    path = os.path.join(a.out, "fp8_convergence.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, a.png or os.path.join(a.out, "fp8_convergence.png"))
    except ImportError:
        print(f"no matplotlib here: draw it elsewhere with --plot {path}", flush=True)
    print(report(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
