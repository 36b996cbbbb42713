#!/usr/bin/env python3
"""Verify a parallel3d checkpoint: every file against the checksum its save recorded.

    python tools/verify_checkpoint.py --load ckpt                  # the latest iteration
    python tools/verify_checkpoint.py --load ckpt --iteration 2000

Checks each file's size and SHA-256 against metadata.json, that every file the layout
implies (a model shard and optimizer state per (TP, PP) rank, an RNG state per rank) is
there, and that nothing unrecorded lies in the directory. Prints one line per bad file and
exits 1 if any (a symlink leaving the checkpoint is one, and nothing about its target is
printed); 2 when the checkpoint cannot be read at all (no tracker, a metadata.json that is
malformed, edited since saved, or names a file outside the iteration directory). A checkpoint saved before checksums were kept gets a warning, and each of
its files is opened instead. Reads every byte once: run it on a copy you are about to
trust (after a transfer, before deleting older checkpoints).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

if __package__ in (None, ""):
    # run as a script: make the repo importable without installing it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from parallel3d.bootstrap import reexec_unless_ready  # noqa: E402
    reexec_unless_ready(__file__)  # this Python lacks torch & co: run inside .venv, as the demo does

from parallel3d.training.checkpointing import CheckpointError, verify_checkpoint  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the checkpoint directory (--save of the training run)")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest checkpointed iteration")
    args = p.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ckpt_dir, problems = verify_checkpoint(args.load, args.iteration)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr, flush=True)
    for problem in problems:
        print(f"bad: {problem}", file=sys.stderr, flush=True)
    if problems:
        print(f"{ckpt_dir}: {len(problems)} bad file(s)", file=sys.stderr, flush=True)
        return 1
    verdict = "every file opens (no checksums recorded to verify)" if caught else "every file matches its checksum"
    print(f"{ckpt_dir}: {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
