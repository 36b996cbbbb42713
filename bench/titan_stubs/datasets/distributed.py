"""Stand-in for ``datasets.distributed`` (see the package docstring): imported, never called."""
from typing import Any, NoReturn


def split_dataset_by_node(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError("datasets is stubbed for the torchtitan benchmark (random tokens, no datasets)")
