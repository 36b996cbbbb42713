"""Schedules by name: Megatron's (schedules.py), the zero-bubble ones (zero_bubble.py) and 'auto'
(auto_schedule.py, which picks among the others). The one module that imports all three, so none
of them imports another back.
"""
from __future__ import annotations

from .auto_schedule import auto_options, auto_schedule
from .schedules import Schedule, check_schedule_args, default_num_model_chunks
from .zero_bubble import build_named


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_model_chunks: int | None = None,
                   **kw) -> Schedule:
    """Build a schedule by name: 'no-pipelining', 'gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1',
    'zb-h2', 'zb-v', 'dualpipev' or 'auto'.

    num_model_chunks defaults to 2 for the V-shaped schedules ('zb-v', 'dualpipev'), else 1.
    Keyword options: microbatch_group_size_per_vp_stage (interleaved only; default num_stages);
    hidden_size and seq_length, the model's shape, which only 'auto' uses (auto_options); for
    'auto' also those of :func:`parallel3d.pipeline.auto_schedule.auto_schedule` (measured times,
    memory limit), which win over the shape's.
    """
    V = default_num_model_chunks(name) if num_model_chunks is None else num_model_chunks
    shape = kw.pop("hidden_size", None), kw.pop("seq_length", None)
    group_size = kw.pop("microbatch_group_size_per_vp_stage", None)
    if name == "auto":
        check_schedule_args(name, num_stages, num_microbatches, V, group_size)
        return auto_schedule(num_stages, num_microbatches, V, **{**auto_options(*shape), **kw})
    if kw:
        raise TypeError(f"build_schedule got unexpected keyword arguments {sorted(kw)}; "
                        f"the only option is microbatch_group_size_per_vp_stage")
    return build_named(name, num_stages, num_microbatches, V, group_size)
