"""Draw a pipeline schedule's per-rank timeline (from simulate()) as a PNG or a text table.

    python -m parallel3d.pipeline.visualize --schedule interleaved-1f1b --stages 4 \\
        --microbatches 8 --chunks 2 --out timeline.png [--text] [--forward-time 1 --backward-time 2]
    python -m parallel3d.pipeline.visualize --schedule zb-v --stages 4 --microbatches 8 \\
        --forward-time 1 --backward-time 1 --weight-time 1 --text

W (weight-gradient) steps of the zero-bubble schedules are drawn light and dotted.

The PNG needs matplotlib (``pip install matplotlib``); ``--text`` needs nothing.
"""
from __future__ import annotations

import argparse
import math
import sys
from fractions import Fraction
from math import gcd, lcm

from parallel3d.pipeline.registry import build_schedule
from parallel3d.pipeline.registry import SCHEDULE_NAMES
from parallel3d.pipeline.simulate import SimResult, simulate


def _title(schedule, result: SimResult, args: argparse.Namespace) -> str:
    return (f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_microbatches} microbatches, "
            f"{schedule.num_model_chunks} chunk(s)/rank; F={args.forward_time:g} B={args.backward_time:g} "
            f"W={args.weight_time:g} comm={args.comm_time:g}; makespan {result.makespan:g}, "
            f"bubble overhead {result.bubble_overhead:.3f} (idle/busy)")


def _time_slot(result: SimResult, max_slots: int = 400) -> Fraction:
    """Largest step that every start/end time is a whole multiple of (coarser if that is tiny)."""
    times = [Fraction(t).limit_denominator(1000) for tl in result.timelines for s, e, _ in tl for t in (s, e)]
    den = lcm(*(t.denominator for t in times)) if times else 1
    slot = Fraction(gcd(*(int(t * den) for t in times)), den) if times else Fraction(0)
    if slot == 0:
        return Fraction(1)
    makespan = Fraction(result.makespan).limit_denominator(1000)
    if makespan / slot > max_slots:
        slot = Fraction(makespan / max_slots).limit_denominator(1000)
    return slot


def text_timeline(result: SimResult) -> str:
    """Rank rows x time-slot columns; a cell shows the compute running at the slot's start, '.' if idle."""
    slot = _time_slot(result)
    num_slots = math.ceil(Fraction(result.makespan).limit_denominator(1000) / slot)
    cells = [["."] * num_slots for _ in result.timelines]
    for rank, tl in enumerate(result.timelines):
        for start, end, action in tl:
            first = math.ceil(Fraction(start).limit_denominator(1000) / slot)
            stop = math.ceil(Fraction(end).limit_denominator(1000) / slot)
            for k in range(first, min(stop, num_slots)):
                cells[rank][k] = str(action)
    width = max([len(c) for row in cells for c in row] + [len(f"{float(slot * num_slots):g}")])
    header = "time     " + " ".join(f"{float(slot * k):<{width}g}" for k in range(num_slots))
    rows = [f"rank {rank:<3} " + " ".join(f"{c:<{width}}" for c in row) for rank, row in enumerate(cells)]
    return "\n".join([header] + rows)


def draw_timeline(schedule, result: SimResult, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle

    P, M = schedule.num_stages, schedule.num_microbatches
    cmap = plt.get_cmap("tab20" if M > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.28), 0.7 * P + 1.6))
    for rank, tl in enumerate(result.timelines):
        y = P - 1 - rank  # rank 0 on top
        for start, end, a in tl:
            color = cmap(a.microbatch % cmap.N)
            if a.kind == "B":  # backward: darker and hatched
                color = tuple(0.6 * c for c in to_rgb(color))
            elif a.kind == "W":  # weight gradient: lighter and dotted
                color = tuple(0.5 + 0.5 * c for c in to_rgb(color))
            ax.add_patch(Rectangle((start, y + 0.1), end - start, 0.8, facecolor=color, edgecolor="black",
                                   linewidth=0.6, hatch={"B": "//", "W": ".."}.get(a.kind)))
            ax.text((start + end) / 2, y + 0.5, str(a), ha="center", va="center", fontsize=7,
                    color="white" if a.kind == "B" else "black")
    ax.set_xlim(0, result.makespan)
    ax.set_ylim(0, P)
    ax.set_yticks([P - 1 - r + 0.5 for r in range(P)], [f"rank {r}" for r in range(P)])
    ax.set_xlabel("time (idle = white gaps); label = F/B microbatch.chunk")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(facecolor="lightgray", edgecolor="black", label="forward"),
                       Patch(facecolor="dimgray", edgecolor="black", hatch="//", label="backward (B)"),
                       Patch(facecolor="whitesmoke", edgecolor="black", hatch="..", label="weight gradient (W)")],
              loc="upper right", bbox_to_anchor=(1.0, -0.12), ncol=3, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b")
    parser.add_argument("--stages", type=int, default=4, help="pipeline size P")
    parser.add_argument("--microbatches", type=int, default=8, help="M")
    parser.add_argument("--chunks", type=int, default=None,
                        help="model chunks per rank V (default 2 for zb-v and dualpipev, else 1)")
    parser.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", "--microbatch-group-size-per-vp-stage",
                        dest="microbatch_group_size_per_vp_stage", type=int, default=None)
    parser.add_argument("--forward-time", type=float, default=1.0)
    parser.add_argument("--backward-time", type=float, default=2.0)
    parser.add_argument("--weight-time", type=float, default=0.0,
                        help="weight-gradient time W (part of the backward for schedules without W steps)")
    parser.add_argument("--comm-time", type=float, default=0.0)
    parser.add_argument("--out", help="PNG file to write (needs matplotlib)")
    parser.add_argument("--text", action="store_true", help="print the timeline as a table")
    args = parser.parse_args(argv)
    if not args.text and not args.out:
        parser.error("give --out FILE.png, --text, or both")

    kw = {}
    if args.microbatch_group_size_per_vp_stage is not None:
        kw["microbatch_group_size_per_vp_stage"] = args.microbatch_group_size_per_vp_stage
    try:
        schedule = build_schedule(args.schedule, args.stages, args.microbatches, args.chunks, **kw)
        result = simulate(schedule, args.forward_time, args.backward_time, args.comm_time,
                          weight_time=args.weight_time)
    except ValueError as e:
        parser.error(str(e))
    title = _title(schedule, result, args)

    if args.text:
        print(title)
        print(text_timeline(result))
    if args.out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("drawing a PNG needs matplotlib: pip install matplotlib (or use --text)", file=sys.stderr)
            return 2
        draw_timeline(schedule, result, args.out, title)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
