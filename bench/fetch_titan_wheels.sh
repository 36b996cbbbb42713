#!/usr/bin/env bash
# Fetch the wheels bench/torchtitan_bench.py installs on the GPU machine (which has no internet) into
# .whl/titan/ (git-ignored; it travels with each device call). All pure Python, ~1 MB in all.
# torchtitan 0.2.2, not 0.3.0: 0.3.0 needs torch nightly (see the driver's docstring).
# Not fetched: datasets (bench/titan_stubs stands in), wandb (imported lazily, off), tensorboard,
# tokenizers, einops, pillow, fsspec (already on the GPU machine).
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl/titan
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl/titan \
  torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
  typing_extensions==4.16.0
ls -l .whl/titan
