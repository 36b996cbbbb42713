"""parallel3d: Megatron-style 3D-parallel training for PyTorch."""
import importlib.machinery as _machinery
import os as _os
import sys as _sys

__version__ = "0.1.0"

# The repository keeps `models/` and `tools/` at its top level, and an install maps them to
# parallel3d.models / parallel3d.tools (pyproject's package-dir). Run from a checkout without an
# install (python3 examples/pretrain_gpt.py, python3 tools/x.py), this package's directory has no
# such subpackages: a finder placed right after the path finder finds those two (and nothing else of the
# checkout) there, so an installed copy always wins; only beside the checkout's pyproject.toml.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


class _CheckoutFinder:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        ours = fullname in (f"{__name__}.models", f"{__name__}.tools")
        return _machinery.PathFinder.find_spec(fullname, [_checkout]) if ours else None


if (not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "models"))
        and _os.path.isfile(_os.path.join(_checkout, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_checkout, "models", "__init__.py"))):
    _sys.meta_path.insert(_sys.meta_path.index(_machinery.PathFinder) + 1, _CheckoutFinder)
