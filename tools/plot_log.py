#!/usr/bin/env python3
"""Plot the loss curves of a training run from its --log-json file.

    python3 tools/plot_log.py train_log.jsonl --out loss.png [--log-y]

Draws the training loss of every logged interval and the validation loss of every evaluation
(records with ``"type": "eval"`` but not the final test set's, ``"split": "test"``; older logs are told
apart by their ``eval_loss`` key), against
the iteration. A resumed run appends to the same file: each iteration keeps its last record.
Needs matplotlib (``pip install parallel3d[plot]``).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def read_log(path: str) -> tuple[dict[int, float], dict[int, float]]:
    """({iteration: training loss}, {iteration: validation loss}) from a --log-json file."""
    train: dict[int, float] = {}
    valid: dict[int, float] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno} is not JSON ({e.msg}): a --log-json file?") from None
            if (record.get("type") == "eval" or "eval_loss" in record) and record.get("split") != "test":
                valid[int(record["iteration"])] = float(record["eval_loss"])
            elif "loss" in record:
                train[int(record["iteration"])] = float(record["loss"])
    if not train and not valid:
        raise ValueError(f"{path} holds no training or evaluation records")
    return train, valid


def plot(train: dict[int, float], valid: dict[int, float], out: str, title: str, log_y: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window: works over ssh and in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot(sorted(train), [train[i] for i in sorted(train)], label="training loss")
    if valid:
        ax.plot(sorted(valid), [valid[i] for i in sorted(valid)], "o-", label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats per token)")
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Plot training and validation loss from a --log-json file.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("log", help="the --log-json file of a training run")
    p.add_argument("--out", default="loss.png", help="image file to write (its extension picks the format)")
    p.add_argument("--title", default=None, help="plot title (default: the log's file name)")
    p.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    args = p.parse_args(argv)
    try:
        train, valid = read_log(args.log)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        plot(train, valid, args.out, args.title or args.log, args.log_y)
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib (or parallel3d[plot])", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {len(train)} training and {len(valid)} validation points")
    return 0


cli = main

if __name__ == "__main__":
    sys.exit(main())
