"""Schedules by name: one ScheduleRecord each (what it runs, the chunks and microbatches it needs, its
builder): Megatron's (builders.py), the zero-bubble ones (zero_bubble.py) and 'auto' (auto_schedule.py,
which picks among the others). Everything else asks this table, so adding a schedule is one builder
plus one record. The one module that imports all three, so none of them imports another back.
"""
from __future__ import annotations

from typing import Optional

from .auto_schedule import auto_options, auto_schedule
from .builders import build_1f1b, build_gpipe, build_interleaved, build_no_pipelining, check_megatron_args
from .schedules import ANY_CHUNKS, Schedule, ScheduleRecord
from .zero_bubble import build_dualpipev, build_zb_h1, build_zb_h2, build_zb_v, check_zero_bubble_args

_V = range(2, 3)  # a rank's two chunks in a V
SCHEDULES: dict[str, ScheduleRecord] = {r.name: r for r in (
    ScheduleRecord("no-pipelining", build_no_pipelining, check_megatron_args),
    ScheduleRecord("gpipe", build_gpipe, check_megatron_args),
    ScheduleRecord("1f1b", build_1f1b, check_megatron_args, auto_candidate=True),
    ScheduleRecord("interleaved-1f1b", build_interleaved, check_megatron_args, chunks=ANY_CHUNKS,
                   min_microbatches=lambda P: P),
    ScheduleRecord("zb-h1", build_zb_h1, check_zero_bubble_args, splits_backward=True, auto_candidate=True),
    ScheduleRecord("zb-h2", build_zb_h2, check_zero_bubble_args, splits_backward=True, auto_candidate=True),
    ScheduleRecord("zb-v", build_zb_v, check_zero_bubble_args, chunks=_V, placement="v", splits_backward=True,
                   auto_candidate=True),
    ScheduleRecord("dualpipev", build_dualpipev, check_zero_bubble_args, chunks=_V, placement="v",
                   splits_backward=True, min_microbatches=lambda P: 2 * P, auto_candidate=True),
    ScheduleRecord("auto", None, check_zero_bubble_args, chunks=range(1, 3), placement=None, splits_backward=True),
)}
SCHEDULE_NAMES = tuple(SCHEDULES)
ZERO_BUBBLE = tuple(name for name, r in SCHEDULES.items() if r.splits_backward)
V_SHAPED = tuple(name for name, r in SCHEDULES.items() if r.placement == "v")


def splits_backward(name: Optional[str], num_stages: int) -> bool:
    """Whether a run of ``num_stages`` pipeline stages with --pipeline-schedule ``name`` splits each backward into
    B and a later W (a zero-bubble schedule, 'auto' among them; one stage runs no schedule)."""
    return num_stages > 1 and name in ZERO_BUBBLE


def schedule_record(name: str) -> ScheduleRecord:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}")
    return SCHEDULES[name]


def auto_candidates(P: int, M: int, V: int) -> list[str]:
    """The named schedules 'auto' simulates for these sizes."""
    return [name for name, r in SCHEDULES.items()
            if r.auto_candidate and V in r.chunks and M >= r.min_microbatches(P)]


def placement_of(name: Optional[str], num_model_chunks: int = 1) -> str:
    """Where a schedule puts each rank's chunks: what the model must be built for ('loop' for no name).

    'auto' places them as the schedules it picks among (the V-shaped ones over two chunks)."""
    record = SCHEDULES.get(name)
    if record is None:
        return "loop"
    if record.placement is not None:
        return record.placement
    return next((r.placement for r in SCHEDULES.values() if r.auto_candidate and num_model_chunks in r.chunks), "loop")


def check_schedule_args(name: str, num_stages: int, num_microbatches: int, num_model_chunks: int,
                        group_size: int | None) -> None:
    """The schedule's rules (its stage, microbatch and chunk counts): a ValueError naming them, else None."""
    record = schedule_record(name)
    for arg, value in (("num_stages (pipeline size)", num_stages), ("num_microbatches", num_microbatches),
                       ("num_model_chunks", num_model_chunks)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{arg} must be >= 1, got {value}")
    record.check(record, num_stages, num_microbatches, num_model_chunks, group_size)


def build_named(name: str, P: int, M: int, V: int, group_size: int | None = None) -> Schedule:
    """Any schedule but 'auto' by name, its arguments checked first."""
    check_schedule_args(name, P, M, V, group_size)
    record = SCHEDULES[name]
    return Schedule(name, P, M, V, record.build(P, M, V, group_size), placement_of(name, V))


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
    V = schedule_record(name).chunks[0] if num_model_chunks is None else num_model_chunks
    shape = kw.pop("hidden_size", None), kw.pop("seq_length", None)
    group_size = kw.pop("microbatch_group_size_per_vp_stage", None)
    if schedule_record(name).build is None:
        check_schedule_args(name, num_stages, num_microbatches, V, group_size)
        named = [build_named(n, num_stages, num_microbatches, V)
                 for n in auto_candidates(num_stages, num_microbatches, V)]
        return auto_schedule(num_stages, num_microbatches, V, named=named, **{**auto_options(*shape), **kw})
    if kw:
        raise TypeError(f"build_schedule got unexpected keyword arguments {sorted(kw)}; "
                        f"the only option is microbatch_group_size_per_vp_stage")
    return build_named(name, num_stages, num_microbatches, V, group_size)
