"""Progress bars (tqdm: elapsed time, rate, ETA) on a terminal, plain log lines everywhere else.

Training, tools/preprocess_data.py and tools/convert_checkpoint.py draw a bar only when their
stream is a terminal: a log file or a CI job gets the same plain lines as before, never a
stream of carriage returns. ``PARALLEL3D_NO_PROGRESS=1`` (or training's --no-progress-bar)
turns bars off on a terminal too.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional, TextIO


def wants_bar(stream: TextIO) -> bool:
    """A bar only where a person watches: a terminal, and not switched off."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("PARALLEL3D_NO_PROGRESS") != "1"


def make_bar(total: Optional[float], desc: str, *, stream: Optional[TextIO] = None, unit: str = "it",
             initial: float = 0, unit_scale: bool = False) -> Optional[Any]:
    """A tqdm bar on ``stream`` (default stderr) if it is a terminal, else None (then print lines)."""
    stream = stream if stream is not None else sys.stderr
    if not wants_bar(stream):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale, file=stream,
                dynamic_ncols=True, leave=True)


def emit(bar: Optional[Any], line: str, stream: Optional[TextIO] = None) -> None:
    """Print one log line; above the bar when there is one, so the bar is redrawn below it."""
    stream = stream if stream is not None else sys.stdout
    if bar is not None:
        bar.write(line, file=stream)
    else:
        print(line, file=stream, flush=True)
