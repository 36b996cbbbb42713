"""parallel3d: Megatron-style 3D-parallel training for PyTorch."""
import os as _os

__version__ = "0.1.0"

# The repository keeps `models/` and `tools/` at its top level, and an install maps them to
# parallel3d.models / parallel3d.tools (pyproject's package-dir). Run from a checkout without an
# install (python3 examples/pretrain_gpt.py, python3 tools/x.py), this package's directory has no
# such subpackages: look for them in the checkout too. Appended, so an installed copy always wins,
# and only beside the checkout's pyproject.toml, never in a site-packages holding someone's `models`.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "models"))
        and _os.path.isfile(_os.path.join(_checkout, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_checkout, "models", "__init__.py"))):
    __path__.append(_checkout)

