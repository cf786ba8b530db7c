"""The simulator against hand-computed timelines of the lowered action lists."""

from __future__ import annotations

import pytest

from varuna.errors import ScheduleError
from varuna.planner.simulator import Sharing, Span, StageCost, simulate, simulate_lowered
from varuna.schedule import build_schedule, pull_ahead_room

U = StageCost(forward_s=1.0, backward_s=2.0)


def compute(spans: list[Span]) -> list[tuple[str, float, float]]:
    return [(f"{sp.kind}{sp.microbatch}", sp.start, sp.end) for sp in spans if sp.kind in ("F", "B", "R")]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P, M", [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (5, 3)])
def test_uniform_bubble_is_exactly_the_textbook_value(name: str, P: int, M: int) -> None:
    t = simulate(name, P, M, [U] * P)  # type: ignore[arg-type]
    assert t.step_s == (M + P - 1) * 3.0
    assert abs(t.bubble_fraction - (P - 1) / (M + P - 1)) < 1e-12
    assert t.busy_s == [M * 3.0] * P
    assert t.idle_s == [(P - 1) * 3.0] * P


def test_gpipe_and_1f1b_hold_what_the_planner_expects() -> None:
    assert simulate("gpipe", 3, 5, [U] * 3).peak_inflight == [5, 5, 5]
    assert simulate("1f1b", 3, 5, [U] * 3).peak_inflight == [3, 2, 1]
    assert simulate("1f1b", 4, 2, [U] * 4).peak_inflight == [2, 2, 2, 1]


def test_slow_stage_is_the_bottleneck_1f1b() -> None:
    slow = StageCost(forward_s=3.0, backward_s=6.0)
    t = simulate("1f1b", 3, 4, [U, slow, U])
    # stage 1 works without a gap from 1 (stage 0's F0) to 37; stage 0's last backward takes 2 more
    assert t.step_s == 1 + 4 * 9 + 2 == 39.0
    assert t.idle_s == [27.0, 3.0, 27.0]
    assert compute(t.spans[1]) == [
        ("F0", 1, 4),
        ("F1", 4, 7),
        ("B0", 7, 13),
        ("F2", 13, 16),
        ("B1", 16, 22),
        ("F3", 22, 25),
        ("B2", 25, 31),
        ("B3", 31, 37),
    ]


def test_slow_stage_is_the_bottleneck_gpipe() -> None:
    slow = StageCost(forward_s=3.0, backward_s=6.0)
    t = simulate("gpipe", 3, 4, [U, slow, U])
    # stage 1 forwards [1, 13], waits for stage 2's F3 + B0 (3 s), backwards [16, 40]; stage 0 B3 [40, 42]
    assert t.step_s == 42.0
    assert compute(t.spans[1])[3:5] == [("F3", 10, 13), ("B0", 16, 22)]
    assert compute(t.spans[0])[-1] == ("B3", 40, 42)
    p2 = simulate("gpipe", 2, 2, [U, slow])
    assert p2.step_s == 2 * 9 + 3 == 21.0


def test_communication_adds_exactly_where_expected() -> None:
    t = simulate("gpipe", 2, 1, [U, U], comm=[0.5], allreduce_s=[0.25, 0.5], final_allreduce_s=0.1)
    assert t.spans[1][0] == Span("RECV_F", 0, 0.0, 1.5)  # F0 ends at 1, plus 0.5 on the wire
    assert compute(t.spans[1]) == [("F0", 1.5, 2.5), ("B0", 2.5, 4.5)]
    assert t.spans[0][2] == Span("RECV_B", 0, 1.0, 5.0)  # the gradient leaves at 4.5
    assert compute(t.spans[0]) == [("F0", 0, 1), ("B0", 5, 7)]
    assert t.spans[0][-1] == Span("ALLREDUCE", None, 7.0, 7.25)
    assert t.spans[1][-1] == Span("ALLREDUCE", None, 4.5, 5.0)
    assert t.step_s == pytest.approx(7.35)
    assert t.allreduce_s == [0.25, 0.5]


def test_back_to_back_sends_queue_on_the_link() -> None:
    fast = StageCost(forward_s=1.0, backward_s=1.0)
    t = simulate("gpipe", 2, 2, [fast, fast], comm=[2.0])
    # F1's activation waits for F0's transfer (arrives 3), then takes 2 more
    assert t.spans[1][2] == Span("RECV_F", 1, 4.0, 5.0)


@pytest.mark.parametrize("in_order", [True, False])
def test_a_link_shared_with_other_replicas_stays_busy_longer_than_one_transfer(in_order: bool) -> None:
    """`link_busy`: another replica's transfer shares the link, so each transfer keeps it busy 4 s
    though it takes 2: the first activation still arrives at 3, the second starts when the link is
    free (5) and arrives at 7."""
    fast = StageCost(forward_s=1.0, backward_s=1.0)
    schedule = build_schedule("gpipe", 2, 2)
    t = simulate_lowered(schedule, [fast, fast], comm=[2.0], link_busy=[4.0], in_order=in_order)
    assert t.spans[1][0] == Span("RECV_F", 0, 0.0, 3.0)
    assert t.spans[1][2] == Span("RECV_F", 1, 4.0, 7.0)
    alone = simulate_lowered(schedule, [fast, fast], comm=[2.0], in_order=in_order)
    assert alone.step_s < t.step_s
    assert simulate_lowered(schedule, [fast, fast], comm=[2.0], link_busy=[2.0]).step_s == alone.step_s
    with pytest.raises(
        ScheduleError, match=r"link_busy = \[1.0\]: each boundary's must be at least its comm"
    ):
        simulate_lowered(schedule, [fast, fast], comm=[2.0], link_busy=[1.0])


def test_message_costs_occupy_the_stages_and_delay_the_activation() -> None:
    costs = {"SEND_F": 0.1, "RECV_F": 0.2, "SEND_B": 0.05, "RECV_B": 0.15, "DELAY_F": 0.3}
    t = simulate("gpipe", 2, 1, [U, U], comm=[0.5], message_s=costs)
    assert t.spans[0][1] == Span("SEND_F", 0, 1.0, 1.1)  # the sender encodes and posts
    # on the wire 0.5 from 1.1, 0.3 later than a bare tensor, then 0.2 to fetch the data
    assert t.spans[1][0] == Span("RECV_F", 0, 0.0, pytest.approx(2.1))
    assert compute(t.spans[1]) == [
        ("F0", pytest.approx(2.1), pytest.approx(3.1)),
        ("B0", pytest.approx(3.1), pytest.approx(5.1)),
    ]
    assert t.spans[1][-2] == Span("SEND_B", 0, pytest.approx(5.1), pytest.approx(5.15))
    # the gradient leaves at 5.15, 0.5 on the wire (no DELAY_B), 0.15 to receive
    assert t.spans[0][2] == Span("RECV_B", 0, pytest.approx(1.1), pytest.approx(5.8))
    assert t.step_s == pytest.approx(7.8)
    assert simulate("gpipe", 2, 1, [U, U], comm=[0.5], message_s={}).step_s == 7.0


def test_a_transport_that_never_reports_arrival_steers_the_pull_ahead() -> None:
    kw = {"recompute": False}
    # gloo: the runtime's readiness check always says "not there": stage 0 pulls every forward
    # ahead of its first RECV_B (even when the gradient is long there), the others never pull
    blind = simulate("varuna", 3, 4, [U] * 3, sees_arrivals=False, **kw)  # type: ignore[arg-type]
    assert [f"{sp.kind}{sp.microbatch}" for sp in blind.spans[0] if sp.kind in "FB"] == [
        "F0",
        "F1",
        "F2",
        "F3",
        "B0",
        "B1",
        "B2",
        "B3",
    ]
    plain = simulate("varuna", 3, 4, [U] * 3, opportunistic=False, **kw)  # type: ignore[arg-type]
    assert [sp.kind for sp in blind.spans[1]] == [sp.kind for sp in plain.spans[1]]
    assert [sp.kind for sp in blind.spans[2]] == [sp.kind for sp in plain.spans[2]]
    seeing = simulate("varuna", 3, 4, [U] * 3, **kw)  # type: ignore[arg-type]
    assert [sp.kind for sp in seeing.spans[1]] != [sp.kind for sp in plain.spans[1]]  # pulls F2, F3


def test_varuna_recomputes_just_in_time() -> None:
    r = StageCost(forward_s=1.0, backward_s=2.0, recompute_s=0.5)
    t = simulate("varuna", 2, 1, [r, r])
    assert compute(t.spans[0]) == [("F0", 0, 1), ("R0", 1, 1.5), ("B0", 4, 6)]
    assert compute(t.spans[1]) == [("F0", 1, 2), ("B0", 2, 4)]  # the last stage never recomputes
    assert t.busy_s == [3.5, 3.0] and t.step_s == 6.0
    # recompute on the critical path costs its time: 1f1b with recompute, P=2, M=1
    assert simulate("1f1b", 2, 1, [r, r], recompute=True, comm=[0.0]).step_s == 6.0
    assert simulate("gpipe", 1, 2, [r], recompute=True).busy_s == [6.0]


def test_a_recomputing_stage_forwards_without_autograd_at_its_own_cost() -> None:
    # its F runs under no_grad (the profile's nograd_forward_s); the last stage, which keeps its
    # activations, forwards with autograd
    r = StageCost(forward_s=1.0, backward_s=2.0, recompute_s=0.5, nograd_forward_s=0.75)
    t = simulate("varuna", 2, 1, [r, r], comm=[0.0])
    assert compute(t.spans[0])[:2] == [("F0", 0, 0.75), ("R0", 0.75, 1.25)]
    assert compute(t.spans[1]) == [("F0", 0.75, 1.75), ("B0", 1.75, 3.75)]
    assert simulate("1f1b", 2, 1, [r, r], comm=[0.0]).spans[0][0].end == 1.0  # no recompute: with autograd
    # the planner's fast path prices it alike
    from varuna.planner.fast import lowered, run_in_order

    spans = run_in_order(lowered("varuna", 2, 1, recompute=True), [r, r], [0.0], [0.0, 0.0], {})
    assert compute(spans[0])[:2] == [("F0", 0, 0.75), ("R0", 0.75, 1.25)]


def test_pull_ahead_fills_the_wait_for_a_late_gradient() -> None:
    even = StageCost(forward_s=1.0, backward_s=1.0)
    kw = {"comm": [2.0], "recompute": False}
    plain = simulate("varuna", 2, 3, [even, even], opportunistic=False, **kw)  # type: ignore[arg-type]
    ahead = simulate("varuna", 2, 3, [even, even], **kw)  # type: ignore[arg-type]
    # without pull-ahead stage 0 idles in RECV_B0 [2, 7] before it may send F2; with it, F2 runs at 2
    assert [f"{sp.kind}{sp.microbatch}" for sp in plain.spans[0] if sp.kind in "FB"] == [
        "F0",
        "F1",
        "B0",
        "F2",
        "B1",
        "B2",
    ]
    assert compute(ahead.spans[0]) == [
        ("F0", 0, 1),
        ("F1", 1, 2),
        ("F2", 2, 3),
        ("B0", 7, 8),
        ("B1", 9, 10),
        ("B2", 11, 12),
    ]
    assert (plain.step_s, ahead.step_s) == (16.0, 12.0)
    assert (sum(plain.idle_s), sum(ahead.idle_s)) == (20.0, 12.0)
    assert ahead.peak_inflight == [3, 1]  # pulling ahead holds one more micro-batch


def test_pull_ahead_waits_for_the_forward_input() -> None:
    slow_f = StageCost(forward_s=4.0, backward_s=1.0)
    even = StageCost(forward_s=1.0, backward_s=1.0)
    slow_b = StageCost(forward_s=1.0, backward_s=10.0)
    t = simulate("varuna", 3, 3, [slow_f, even, slow_b], recompute=False)
    # at 9 stage 1 lacks gradient 0 (arrives 16) but F2's input arrives only at 12: it waits for B0
    assert compute(t.spans[1]) == [
        ("F0", 4, 5),
        ("F1", 8, 9),
        ("B0", 16, 17),
        ("F2", 17, 18),
        ("B1", 27, 28),
        ("B2", 38, 39),
    ]
    assert t.step_s == 40.0


def test_pull_ahead_on_uniform_stages_keeps_the_step_but_holds_more() -> None:
    t = simulate("eager-1f1b", 3, 4, [U] * 3)
    assert t.step_s == simulate("1f1b", 3, 4, [U] * 3).step_s == 18.0
    # a value arriving exactly when a stage looks counts as there, so stage 1 pulls F2 ahead; F3
    # would hold a fourth micro-batch, one more than pull_ahead_room(1, 3) = 1F1B's 2 plus one
    assert [f"{sp.kind}{sp.microbatch}" for sp in t.spans[1] if sp.kind in "FB"][:5] == [
        "F0",
        "F1",
        "F2",
        "B0",
        "F3",
    ]
    assert t.peak_inflight == [4, 3, 1]


def test_pull_ahead_holds_at_most_one_micro_batch_more_than_1f1b() -> None:
    # gloo: stage 0 never sees a gradient there, so it pulls whenever it may: with activations held
    # (eager-1f1b) one micro-batch ahead of 1F1B; recomputing (Varuna's) holds only inputs: every one
    blind = {"sees_arrivals": False}
    eager = simulate("eager-1f1b", 2, 8, [U] * 2, **blind)  # type: ignore[arg-type]
    assert [f"{sp.kind}{sp.microbatch}" for sp in eager.spans[0] if sp.kind in "FB"][:6] == [
        "F0",
        "F1",
        "F2",
        "B0",
        "F3",
        "B1",
    ]
    assert eager.peak_inflight == [pull_ahead_room(0, 2), 1] == [3, 1]
    assert simulate("1f1b", 2, 8, [U] * 2, **blind).peak_inflight == [2, 1]  # type: ignore[arg-type]
    varuna = simulate("varuna", 2, 8, [U] * 2, **blind)  # type: ignore[arg-type]
    assert [sp.kind for sp in varuna.spans[0] if sp.kind == "F" or sp.kind == "B"][:9] == ["F"] * 8 + ["B"]
    # the same bound where it decides by arrivals: a slow last stage makes every gradient late
    slow = StageCost(forward_s=1.0, backward_s=6.0)
    late = simulate("eager-1f1b", 3, 8, [U, U, slow])
    assert late.peak_inflight[:2] == [4, 3] and late.step_s <= simulate("1f1b", 3, 8, [U, U, slow]).step_s


def test_a_stage_that_decides_to_wait_stays_waiting() -> None:
    # regression: here every stage is stuck at once and the earliest must commit to its RECV_B;
    # the simulator used to re-ask it forever
    t = simulate("varuna", 8, 6, [U] * 8, comm=[0.0286] * 7, recompute=False)
    for spans in t.spans:
        assert sorted(f"{sp.kind}{sp.microbatch}" for sp in spans if sp.kind in "FB") == sorted(
            f"{k}{m}" for k in "FB" for m in range(6)
        )
    assert t.step_s >= simulate("1f1b", 8, 6, [U] * 8, comm=[0.0286] * 7).step_s


def test_events_are_plain_dicts() -> None:
    t = simulate("1f1b", 2, 2, [U, U])
    events = t.to_events()
    assert events[0] == {
        "stage": 0,
        "kind": "F",
        "microbatch": 0,
        "start": 0.0,
        "end": 1.0,
        "predicted": True,
    }
    assert len(events) == sum(len(s) for s in t.spans)
    kinds = {e["kind"] for e in t.to_events(include_comm=False)}
    assert kinds == {"F", "B", "ALLREDUCE"}


def test_parameter_update_ends_the_step() -> None:
    t = simulate("gpipe", 2, 1, [U, U], update_s=[0.5, 0.25])
    assert t.step_s == 6.0 + 0.5 and t.update_s == [0.5, 0.25]


def test_bad_input() -> None:
    with pytest.raises(ScheduleError, match="stage_costs has 1 entries but the schedule has 2 stages"):
        simulate("gpipe", 2, 2, [U])
    with pytest.raises(ScheduleError, match=r"comm seconds per boundary needs 1 values >= 0"):
        simulate("gpipe", 2, 2, [U, U], comm=[1.0, 2.0])
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        simulate("zb", 2, 2, [U, U])  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"update_s per stage needs 2 values >= 0"):
        simulate("gpipe", 2, 2, [U, U], update_s=[1.0])
    with pytest.raises(ScheduleError, match=r"message_s = \{'SEND_X': 1.0\}: give seconds >= 0"):
        simulate("gpipe", 2, 2, [U, U], message_s={"SEND_X": 1.0})
    with pytest.raises(ScheduleError, match=r"Sharing.replicas = 0; it must be at least 1"):
        simulate("gpipe", 2, 2, [U, U], sharing=Sharing(replicas=0, slowdown={2: 2.0}))


def test_a_split_backward_takes_the_weight_half_off_the_drain() -> None:
    # P=2, M=1, f=1, b=2, free comm. Plain: stage 1's B [2,4], then stage 0's B [4,6]: step 6.
    # Split: stage 1's B is the input half only, [2,3]; stage 0's B runs [3,5] while stage 1's
    # W runs [3,4]: step 5.
    cost = StageCost(forward_s=1, backward_s=2, input_share=0.5, weight_share=0.5)
    plain = simulate("1f1b", 2, 1, [cost, cost])
    split = simulate("1f1b", 2, 1, [cost, cost], split_backward=True)
    assert plain.step_s == 6 and split.step_s == 5
    assert [(s.kind, s.start, s.end) for s in split.spans[1] if s.kind in ("B", "W")] == [
        ("B", 2, 3),
        ("W", 3, 4),
    ]
    assert [(s.kind, s.start, s.end) for s in split.spans[0] if s.kind == "B"] == [("B", 3, 5)]
    assert split.busy_s == [3, 3] and split.peak_inflight == plain.peak_inflight == [1, 1]
    # the shares may add up to more than 1 (the split's own cost): stage 1 is busy for all of it
    dear = StageCost(forward_s=1, backward_s=2, input_share=0.6, weight_share=0.5)
    assert simulate("1f1b", 2, 1, [dear, dear], split_backward=True).busy_s[1] == pytest.approx(1 + 2 * 1.1)
