"""Pipeline schedules: builders, validator, simulator and the timeline CLI (pure Python)."""
import itertools
import sys

import pytest

from parallel3d.pipeline.builders import interleaved_microbatch_groups, num_warmup_microbatches
from parallel3d.pipeline.schedules import Action, Schedule, ScheduleError
from parallel3d.pipeline.registry import SCHEDULE_NAMES, build_schedule
from parallel3d.pipeline.simulate import simulate, validate
from parallel3d.pipeline import visualize


# The schedules without W actions, whose bubble is SC21's; the zero-bubble ones: test_zero_bubble.py.
CLASSIC = ("no-pipelining", "gpipe", "1f1b", "interleaved-1f1b")


def _sweep():
    """(name, P, V, M) for P in {1,2,3,4,8}, V in {1,2,4}, M in {P,2P,4P}, minus invalid combos."""
    for name, P, V, k in itertools.product(CLASSIC, (1, 2, 3, 4, 8), (1, 2, 4), (1, 2, 4)):
        M = k * P
        if name == "no-pipelining" and (P > 1 or V > 1):
            continue
        if name in ("gpipe", "1f1b") and V > 1:
            continue
        if name == "interleaved-1f1b" and (V < 2 or P < 2):
            continue
        yield name, P, V, M


SWEEP = list(_sweep())


def _expected_overhead(name, P, V, M):
    return {"no-pipelining": 0.0, "gpipe": (P - 1) / M, "1f1b": (P - 1) / M,
            "interleaved-1f1b": (P - 1) / (V * M)}[name]


def test_sweep_is_not_empty():
    names = {name for name, *_ in SWEEP}
    assert names == set(CLASSIC) and set(CLASSIC) < set(SCHEDULE_NAMES) and len(SWEEP) > 40


@pytest.mark.parametrize("name,P,V,M", SWEEP)
def test_sweep_valid_and_bubble_matches_sc21_formula(name, P, V, M):
    schedule = build_schedule(name, P, M, V)
    validate(schedule)
    for forward_time, backward_time in ((1.0, 1.0), (1.0, 2.0)):
        result = simulate(schedule, forward_time, backward_time)
        assert result.bubble_overhead == pytest.approx(_expected_overhead(name, P, V, M), abs=1e-12)
        assert result.busy_time == [pytest.approx(V * M * (forward_time + backward_time))] * P
        # idle = (P-1)(f+b) per rank, i.e. makespan = (V*M + P - 1)(f+b)
        assert result.makespan == pytest.approx((V * M + P - 1) * (forward_time + backward_time))
    if name == "gpipe":
        assert result.peak_inflight[0] == M
    if name == "1f1b":
        assert result.peak_inflight[0] == min(P, M)
        assert result.peak_inflight == [min(P - r, M) for r in range(P)]
    if name == "no-pipelining":
        assert result.peak_inflight == [1]


def _forwards_before_first_backward(actions):
    count = 0
    for a in actions:
        if a.kind == "B":
            return count
        count += a.kind == "F"
    return count


@pytest.mark.parametrize("name,P,V,M", [c for c in SWEEP if c[0] in ("1f1b", "interleaved-1f1b")])
def test_warmup_counts(name, P, V, M):
    schedule = build_schedule(name, P, M, V)
    total = M * V
    for rank in range(P):
        if name == "1f1b":
            expected = min(P - rank - 1, M)
        else:
            expected = min((P - rank - 1) * 2 + (V - 1) * P, total)
        assert num_warmup_microbatches(name, rank, P, M, V) == expected
        # the steady phase opens with one more forward before the first backward
        assert _forwards_before_first_backward(schedule.actions[rank]) == min(expected + 1, total)


@pytest.mark.parametrize("P,V,M", [(4, 2, 5), (4, 2, 6), (4, 2, 7), (4, 2, 9), (4, 4, 11), (3, 2, 4),
                                   (2, 2, 3), (2, 4, 5), (8, 2, 9), (8, 4, 13), (3, 3, 8)])
def test_interleaved_any_microbatch_count(P, V, M):
    schedule = build_schedule("interleaved-1f1b", P, M, V)
    validate(schedule)
    for forward_time, backward_time in ((1.0, 1.0), (1.0, 2.0)):
        overhead = simulate(schedule, forward_time, backward_time).bubble_overhead
        interleaved_formula, gpipe = (P - 1) / (V * M), (P - 1) / M
        assert interleaved_formula - 1e-12 <= overhead <= gpipe + 1e-12
        # folding the remainder into the first group keeps the ideal bubble
        assert overhead == pytest.approx(interleaved_formula, abs=1e-12)


def test_interleaved_groups_fold_small_remainder_into_first_group():
    assert [len(g) for g in interleaved_microbatch_groups(9, 4)] == [5, 4]
    assert [len(g) for g in interleaved_microbatch_groups(8, 4)] == [4, 4]
    assert [len(g) for g in interleaved_microbatch_groups(6, 4)] == [6]
    # a remainder of at least P runs as its own last group (Megatron's behaviour)
    assert [len(g) for g in interleaved_microbatch_groups(11, 2, 3)] == [3, 3, 3, 2]
    assert [len(g) for g in interleaved_microbatch_groups(10, 4, 6)] == [6, 4]
    assert [len(g) for g in interleaved_microbatch_groups(7, 4, 6)] == [7]


@pytest.mark.parametrize("P,V,M,G", [(2, 2, 6, 3), (4, 2, 8, 8), (4, 2, 10, 5), (3, 2, 6, 6), (4, 3, 11, 6)])
def test_interleaved_microbatch_group_size(P, V, M, G):
    schedule = build_schedule("interleaved-1f1b", P, M, V, microbatch_group_size_per_vp_stage=G)
    validate(schedule)
    overhead = simulate(schedule, 1.0, 2.0).bubble_overhead
    assert (P - 1) / (V * M) - 1e-12 <= overhead <= (P - 1) / M + 1e-12


def test_1f1b_steady_state_fuses_send_forward_recv_backward():
    schedule = build_schedule("1f1b", 4, 8)
    batches = [[a.kind for a in step] for step in schedule.steps(1) if isinstance(step, list)]  # one p2p batch each
    assert ["SEND_F", "RECV_B"] in batches  # Megatron's send_forward_recv_backward
    assert ["SEND_B", "RECV_F"] in batches  # ... and send_backward_recv_forward


def test_action_and_schedule_printing():
    assert str(Action("SEND_F", 3, 1, peer=2)) == "SEND_F3.1"
    assert str(Action("B", 3, 1)) == "B3.1"
    text = str(build_schedule("1f1b", 2, 2))
    assert "rank 0: F0.0 [SEND_F0.0>1] F1.0 [SEND_F1.0>1 RECV_B0.0<1] B0.0" in text
    assert text.count("\nrank ") == 2
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("X", 0, 0)
    with pytest.raises(ValueError, match="needs a peer"):
        Action("RECV_F", 0, 0)


@pytest.mark.parametrize("args,kw,match", [
    (("zb-h3", 2, 4), {}, r"unknown pipeline schedule 'zb-h3'; valid names: no-pipelining, gpipe, 1f1b, interleaved-1f1b, zb-h1"),
    (("1f1b", 0, 4), {}, r"num_stages .* must be >= 1, got 0"),
    (("gpipe", 2, 0), {}, r"num_microbatches must be >= 1, got 0"),
    (("1f1b", 2, 4, 2), {}, r"'1f1b' uses one model chunk per rank, got num_model_chunks=2; use 'interleaved-1f1b'"),
    (("gpipe", 2, 4, 3), {}, r"num_model_chunks=3"),
    (("interleaved-1f1b", 2, 4, 1), {}, r"needs num_model_chunks >= 2, got 1; use '1f1b'"),
    (("interleaved-1f1b", 1, 4, 2), {}, r"needs num_stages >= 2, got 1"),
    (("no-pipelining", 2, 4), {}, r"num_stages must be 1, got 2; use 'gpipe', '1f1b' or 'interleaved-1f1b'"),
    (("interleaved-1f1b", 4, 3, 2), {}, r"num_microbatches=3 < num_stages=4\. Any num_microbatches >= 4 works"),
    (("interleaved-1f1b", 4, 8, 2), {"microbatch_group_size_per_vp_stage": 3}, r"in \[num_stages, num_microbatches\] = \[4, 8\], got 3"),
    (("1f1b", 4, 8), {"microbatch_group_size_per_vp_stage": 4}, r"only applies to 'interleaved-1f1b'"),
])
def test_build_schedule_errors(args, kw, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args, **kw)


def test_build_schedule_rejects_unknown_kwargs():
    with pytest.raises(TypeError, match="microbatch_group_size_per_vp_stage"):
        build_schedule("1f1b", 2, 4, group=3)


# --- the validator catches planted bugs ---------------------------------------------------------

def _acts(text):
    """'F0.0 SEND_F0.0>1 RECV_B0.0<1' -> actions (peer after > or <)."""
    out = []
    for tok in text.split():
        peer = None
        for sep in "<>":
            if sep in tok:
                tok, peer = tok.split(sep)
                peer = int(peer)
        kind = tok.rstrip("0123456789.")
        mb, chunk = tok[len(kind):].split(".")
        out.append(Action(kind, int(mb), int(chunk), peer))
    return out


def _schedule(*rows, M=2, V=1):
    return Schedule("planted", len(rows), M, V, [_acts(r) for r in rows])


# A correct 1F1B for P=2, M=2, for reference.
RANK0 = "F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0"
RANK1 = "RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0"


def test_reference_schedule_is_the_built_one():
    validate(_schedule(RANK0, RANK1))
    assert build_schedule("1f1b", 2, 2).actions == _schedule(RANK0, RANK1).actions


def test_validator_catches_swapped_sends():
    # gpipe, rank 0 sends microbatch 3's output before microbatch 2's: rank 1 would get the wrong tensor
    good = build_schedule("gpipe", 2, 4)
    validate(good)
    rank0 = "F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 F2.0 F3.0 SEND_F3.0>1 SEND_F2.0>1 " \
            "RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0 RECV_B2.0<1 B2.0 RECV_B3.0<1 B3.0"
    bad = Schedule("planted", 2, 4, 1, [_acts(rank0), good.actions[1]])
    with pytest.raises(ScheduleError, match=r"rank 0 action #6 SEND_F3.0 .* matched by rank 1 action #\d+ "
                                            r"RECV_F2.0 .*wrong tensor"):
        validate(bad)


def test_validator_catches_missing_recv():
    rank1 = RANK1.replace("RECV_F1.0<0 ", "")
    with pytest.raises(ScheduleError, match=r"rank 1 action #4 F1.0: needs the output of virtual stage 0 "
                                            r"\(rank 0\), but no RECV_F1.0 precedes it"):
        validate(_schedule(RANK0, rank1))


def test_validator_catches_backward_before_forward():
    rank1 = "RECV_F0.0<0 B0.0 F0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0"
    with pytest.raises(ScheduleError, match=r"rank 1 action #1 B0.0: backward before its forward F0.0"):
        validate(_schedule(RANK0, rank1))


def test_validator_catches_deadlock():
    # 1F1B with Megatron's fused send_forward_recv_backward / send_backward_recv_forward split into
    # separate batches, each side receiving first: rank 0 waits for B0's gradient before sending F1's
    # input, rank 1 waits for F1's input before sending B0's gradient.
    rank0 = "F0.0 SEND_F0.0>1 F1.0 RECV_B0.0<1 B0.0 SEND_F1.0>1 RECV_B1.0<1 B1.0"
    rank1 = "RECV_F0.0<0 F0.0 RECV_F1.0<0 B0.0 SEND_B0.0>0 F1.0 B1.0 SEND_B1.0>0"
    with pytest.raises(ScheduleError, match=r"deadlocks") as err:
        validate(_schedule(rank0, rank1))
    msg = str(err.value)
    assert "rank 0 action #3 RECV_B0.0 waits for rank 1 #4 SEND_B0.0, but rank 1 is blocked at #2 RECV_F1.0" in msg
    assert "rank 1 action #2 RECV_F1.0 waits for rank 0 #5 SEND_F1.0, but rank 0 is blocked at #3 RECV_B0.0" in msg


def test_validator_catches_wrong_peer_and_unmatched_send():
    with pytest.raises(ScheduleError, match=r"rank 0 action #1 SEND_F0.0: peer is rank 2, but virtual stage 1 "
                                            r"lives on rank 1"):
        validate(_schedule(RANK0.replace("SEND_F0.0>1", "SEND_F0.0>2"), RANK1, "F0.0 B0.0"))
    with pytest.raises(ScheduleError, match=r"rank 1 action #4 RECV_F1.0: no matching send on rank 0 "
                                            r"\(1 sends from rank 0 to 1, 2 receives\)"):
        validate(_schedule(RANK0.replace(" SEND_F1.0>1", ""), RANK1))
    with pytest.raises(ScheduleError, match=r"rank 0 never runs B1.0"):
        validate(_schedule(RANK0.replace(" RECV_B1.0<1 B1.0", ""), RANK1.replace(" SEND_B1.0>0", "")))


def test_validator_catches_nccl_order_mismatch_between_directions():
    # P=2 interleaved: rank 1 receives a forward and a backward message from rank 0 in one batch; if
    # it posted them in the other order, NCCL (no tags) would swap the tensors.
    schedule = build_schedule("interleaved-1f1b", 2, 4, 2)
    validate(schedule)
    for rank, actions in enumerate(schedule.actions):
        for i, j in itertools.combinations(range(len(actions)), 2):
            a, b = actions[i], actions[j]
            if not all(x.is_comm for x in actions[i:j + 1]):
                continue  # not in one batch
            if a.kind == "RECV_F" and b.kind == "RECV_B" and a.peer == b.peer:
                swapped = [list(x) for x in schedule.actions]
                swapped[rank][i], swapped[rank][j] = b, a
                with pytest.raises(ScheduleError, match="wrong tensor would arrive"):
                    validate(Schedule("planted", 2, 4, 2, swapped))
                return
    pytest.fail("expected a batch with RECV_F and RECV_B from the same peer")


# --- simulate -----------------------------------------------------------------------------------

def test_simulate_stage_costs_and_comm_time():
    schedule = build_schedule("1f1b", 2, 4)
    # rank 1 twice as slow: it is the bottleneck, makespan = rank 0's F0 + 4 x (2 + 4) + rank 0's B3
    as_mapping = simulate(schedule, stage_costs={(0, 0): (1.0, 2.0), (1, 0): (2.0, 4.0)})
    as_lists = simulate(schedule, stage_costs=[[(1.0, 2.0)], [(2.0, 4.0)]])
    assert as_mapping.makespan == as_lists.makespan == 27.0
    assert as_mapping.timelines[1][0] == (1.0, 3.0, Action("F", 0, 0))

    one = simulate(build_schedule("gpipe", 2, 1), comm_time=0.5)
    assert [(s, e, str(a)) for s, e, a in one.timelines[0]] == [(0.0, 1.0, "F0.0"), (5.0, 7.0, "B0.0")]
    assert [(s, e, str(a)) for s, e, a in one.timelines[1]] == [(1.5, 2.5, "F0.0"), (2.5, 4.5, "B0.0")]
    with pytest.raises(ValueError, match="times must be >= 0"):
        simulate(schedule, forward_time=-1)
    with pytest.raises(ValueError, match="2 ranks x 1 chunks"):
        simulate(schedule, stage_costs=[[(1.0, 2.0)]])


def test_simulate_rejects_invalid_schedule():
    with pytest.raises(ScheduleError):
        simulate(_schedule(RANK0, RANK1.replace("RECV_F1.0<0 ", "")))


# --- visualize ----------------------------------------------------------------------------------

def test_text_timeline(capsys):
    assert visualize.main(["--schedule", "1f1b", "--stages", "2", "--microbatches", "2",
                           "--forward-time", "1", "--backward-time", "1", "--text"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "bubble overhead 0.500" in out[0]
    assert out[1].split() == ["time", "0", "1", "2", "3", "4", "5"]
    assert out[2].split() == ["rank", "0", "F0.0", "F1.0", ".", "B0.0", ".", "B1.0"]
    assert out[3].split() == ["rank", "1", ".", "F0.0", "B0.0", "F1.0", "B1.0", "."]


def test_text_timeline_interleaved_default_costs(capsys):
    assert visualize.main(["--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "8",
                           "--chunks", "2", "--text"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "makespan 57" in out[0] and "bubble overhead 0.188" in out[0]
    assert len(out) == 2 + 4 and len(out[1].split()) == 1 + 57
    assert out[2].split()[2:5] == ["F0.0", "F1.0", "F2.0"]


def test_visualize_bad_args(capsys):
    with pytest.raises(SystemExit):
        visualize.main(["--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "2",
                        "--chunks", "2", "--text"])
    assert "Any num_microbatches >= 4 works" in capsys.readouterr().err


def test_png_without_matplotlib_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert visualize.main(["--out", str(tmp_path / "t.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG path needs matplotlib (pip install matplotlib)")
    out = tmp_path / "timeline.png"
    assert visualize.main(["--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "8",
                           "--chunks", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validator_requires_one_batch_per_direction_on_both_sides():
    """Two activations sent in one batch but received in two: fine for a rendezvous, but shape
    headers sent ahead of the data would then interleave differently on the two sides (NCCL)."""
    A = Action
    rank0 = [A("F", 0, 0), A("F", 1, 0), A("SEND_F", 0, 0, 1), A("SEND_F", 1, 0, 1), A("RECV_B", 0, 0, 1),
             A("B", 0, 0), A("RECV_B", 1, 0, 1), A("B", 1, 0)]
    rank1 = [A("RECV_F", 0, 0, 0), A("F", 0, 0), A("RECV_F", 1, 0, 0), A("F", 1, 0), A("B", 0, 0),
             A("SEND_B", 0, 0, 0), A("B", 1, 0), A("SEND_B", 1, 0, 0)]
    with pytest.raises(ScheduleError, match="in the same direction"):
        validate(Schedule("split", 2, 2, 1, [rank0, rank1]))
