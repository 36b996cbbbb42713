"""Stand-in for Hugging Face ``datasets``, on sys.path only inside bench/torchtitan_bench.py.

Why: torchtitan 0.2.2's llama3 package imports ``torchtitan.hf_datasets.text_datasets``, which
imports ``Dataset`` and ``load_dataset`` at module level, but the benchmark trains on random tokens
(bench/titan_spec.py) and never builds that dataloader. The real package would have to travel as a
wheel with pins (dill<0.4.1, multiprocess<0.70.19, huggingface-hub<2, pyarrow>=21, httpx) that the
GPU machine's installed packages may not meet. Anything that does call into it fails loudly.
"""
from typing import Any, NoReturn


class Dataset:
    """Type placeholder: torchtitan only names it in annotations and isinstance checks."""


def load_dataset(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError("datasets is stubbed for the torchtitan benchmark (random tokens, no datasets)")
