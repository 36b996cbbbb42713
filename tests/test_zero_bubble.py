"""Zero-bubble schedules (ZB-H1, ZB-H2, ZB-V, DualPipeV, auto): builders, validator, simulator (pure Python)."""
import itertools

import pytest

from parallel3d.pipeline import visualize
from parallel3d.pipeline.auto_schedule import paper_costs
from parallel3d.pipeline.registry import build_schedule
from parallel3d.pipeline.schedules import Action, Schedule, ScheduleError
from parallel3d.pipeline.simulate import simulate, validate

ZB = ("zb-h1", "zb-h2", "zb-v", "dualpipev")


@pytest.mark.parametrize("P,k", itertools.product((2, 4, 8), (1, 2, 3, 4)))
@pytest.mark.parametrize("h,s", [(1.0, 1.0), (3.0, 1.0), (1.0, 5.0), (4096.0, 2048.0)])
def test_table2_of_the_zero_bubble_paper(P, k, h, s):
    """Qi et al., ICLR 2024, Table 2, with T_F:T_B:T_W = (24h+4s):(24h+8s):24h and no communication.

    Bubble = the most idle time of a stage between its first and last action (SimResult.bubble),
    in the paper's model where a send never waits for its receiver (sends_block=False).
    Asserted, for P in {2, 4, 8} and M in {P, 2P, 3P, 4P}:
    - 1F1B:  bubble (P-1)(T_F+T_B+T_W)  (its backward runs B and W together), peak memory P M_B;
    - ZB-H1: bubble (P-1)(T_F+T_B-T_W), peak memory P M_B (1F1B's);
    - ZB-H2: bubble (P-1)(T_F+T_B-2T_W), peak memory (2P-1) M_B, for M >= 2P (it needs 2P-1
      microbatches to fill its warm-up; at M = P it is ZB-H1: bubble (P-1)(T_F+T_B-T_W)).
    """
    M = k * P
    F, B, W, MB, MW = paper_costs(h, s)
    expected = {"1f1b": ((P - 1) * (F + B + W), P * MB), "zb-h1": ((P - 1) * (F + B - W), P * MB),
                "zb-h2": ((P - 1) * (F + B - 2 * W), (2 * P - 1) * MB) if M >= 2 * P
                else ((P - 1) * (F + B - W), P * MB)}
    for name, (bubble, memory) in expected.items():
        schedule = build_schedule(name, P, M)
        validate(schedule)
        result = simulate(schedule, F, B, weight_time=W, activation_memory=MB, weight_memory=MW,
                          sends_block=False)
        assert result.bubble == pytest.approx(bubble, rel=1e-12), name
        assert max(result.peak_memory) == pytest.approx(memory, rel=1e-12), name
        assert result.busy_time == [pytest.approx(M * (F + B + W))] * P


@pytest.mark.parametrize("name,P,M", [(n, P, k * P) for n, P, k in itertools.product(ZB, (2, 3, 4, 8), (1, 2, 3, 4))
                                      if not (n == "dualpipev" and k < 2)] + [("zb-h1", 4, 5), ("zb-v", 4, 6)])
def test_every_zero_bubble_schedule_is_valid(name, P, M):
    schedule = build_schedule(name, P, M)
    validate(schedule)
    V = schedule.num_model_chunks
    assert V == (2 if name in ("zb-v", "dualpipev") else 1) and schedule.splits_backward
    for rank, actions in enumerate(schedule.actions):
        counts = {kind: sum(a.kind == kind for a in actions) for kind in "FBW"}
        assert counts == {"F": M * V, "B": M * V, "W": M * V}, (rank, counts)
    # Sends never waiting (the paper's model) can only make it faster.
    blocking = simulate(schedule, 1.0, 1.0, weight_time=1.0, sends_block=True)
    assert simulate(schedule, 1.0, 1.0, weight_time=1.0).makespan <= blocking.makespan + 1e-9


@pytest.mark.parametrize("P", (2, 4, 8))
def test_v_schedules_hold_first_and_last_stage_on_rank_0(P):
    for name in ("zb-v", "dualpipev"):
        schedule = build_schedule(name, P, 2 * P)
        assert schedule.placement == "v"
        assert [schedule.virtual_stage(0, c) for c in (0, 1)] == [0, 2 * P - 1]
        assert [schedule.virtual_stage(P - 1, c) for c in (0, 1)] == [P - 1, P]
        # The V's turn needs no message: rank P-1 never sends to itself.
        assert all(a.peer != P - 1 for a in schedule.actions[P - 1] if a.is_comm)


@pytest.mark.parametrize("P,k", itertools.product((2, 4, 8), (2, 4)))
def test_zb_v_at_equal_times_beats_1f1b_within_its_memory(P, k):
    """ZB-V: 1F1B's activation memory (2P half-size chunks); at T_F = T_B = T_W its bubble is
    about (P-1) chunk forwards (the last rank's unavoidable start; our greedy order leaves one
    more at P=4), against 1F1B's (P-1)(T_F+T_B+T_W) = 6(P-1) chunk forwards."""
    M, f = k * P, 1.0  # chunk times; a whole stage's are 2f
    zbv = simulate(build_schedule("zb-v", P, M), f, f, weight_time=f, activation_memory=0.5, sends_block=False)
    one = simulate(build_schedule("1f1b", P, M), 2 * f, 2 * f, weight_time=2 * f, sends_block=False)
    assert max(zbv.peak_memory) <= P + 1e-9
    assert zbv.bubble <= P * f + 1e-9 and 6 * zbv.bubble <= one.bubble + 6 * f
    assert zbv.makespan < one.makespan


@pytest.mark.parametrize("P", (2, 4))
def test_dualpipev_pairs_forward_and_backward_of_different_chunks(P):
    schedule = build_schedule("dualpipev", P, 4 * P)
    compute = [a for a in schedule.actions[0] if not a.is_comm]
    pairs = [(a, b) for a, b in zip(compute, compute[1:]) if a.kind == "F" and b.kind == "B" and a.chunk != b.chunk]
    assert len(pairs) >= 4 * P - 2 * P  # the main loop: one F/B pair per microbatch beyond the 2P warm-up


def test_zero_bubble_argument_errors():
    with pytest.raises(ValueError, match="'zb-v' runs 2 model chunk"):
        build_schedule("zb-v", 4, 8, 1)
    with pytest.raises(ValueError, match="needs num_stages >= 2"):
        build_schedule("zb-h1", 1, 8)
    with pytest.raises(ValueError, match=r"'dualpipev' needs num_microbatches >= 2 \* num_stages = 8"):
        build_schedule("dualpipev", 4, 7)


def test_validator_checks_w_actions():
    schedule = build_schedule("zb-h1", 2, 2)
    acts = [list(a) for a in schedule.actions]
    w = next(i for i, a in enumerate(acts[0]) if a.kind == "W")
    dropped = Schedule("x", 2, 2, 1, [acts[0][:w] + acts[0][w + 1:], acts[1]])
    with pytest.raises(ScheduleError, match="never runs W"):
        validate(dropped)
    b = next(i for i, a in enumerate(acts[1]) if a.kind == "B")
    early = Schedule("x", 2, 2, 1, [acts[0], acts[1][:b] + [Action("W", 0, 0)] + acts[1][b:]])
    with pytest.raises(ScheduleError, match="weight gradient before its backward"):
        validate(early)


def test_simulator_charges_w_to_the_backward_of_schedules_without_w():
    one = simulate(build_schedule("1f1b", 2, 4), 1.0, 1.0, weight_time=1.0)
    assert one.busy_time == [12.0, 12.0] and one.makespan == 15.0


@pytest.mark.parametrize("P,M,V", [(2, 8, 1), (4, 8, 1), (2, 8, 2), (4, 8, 2)])
def test_auto_schedule_is_the_fastest_candidate_within_memory(P, M, V):
    for sends_block in (True, False):
        results = {}
        schedule = build_schedule("auto", P, M, V, forward_time=1.0, backward_time=1.2, weight_time=0.8,
                                  comm_time=0.05, memory_limit=2 * P, sends_block=sends_block, results=results)
        validate(schedule)
        chosen = results[schedule.name[len("auto("):-1]]
        assert chosen.makespan == pytest.approx(min(r.makespan for r in results.values() if max(r.peak_memory) <= 2 * P))
    with pytest.raises(ValueError, match="memory_limit must be >= 1"):
        build_schedule("auto", P, M, V, memory_limit=0.5)


def test_auto_through_build_schedule_respects_a_tight_memory_limit():
    results = {}
    schedule = build_schedule("auto", 4, 16, forward_time=1.0, backward_time=1.0, weight_time=1.0,
                              memory_limit=4, sends_block=False, results=results)
    assert schedule.name != "auto(zb-h2)"  # ZB-H2 holds 2P-1 = 7 M_B
    assert max(results["zb-h2"].peak_memory) > 4


def test_visualizer_draws_w(capsys):
    assert visualize.main(["--schedule", "zb-v", "--stages", "2", "--microbatches", "4", "--forward-time", "1",
                           "--backward-time", "1", "--weight-time", "1", "--text"]) == 0
    out = capsys.readouterr().out
    assert "W=1" in out and "W0.1" in out and "F0.1" in out
