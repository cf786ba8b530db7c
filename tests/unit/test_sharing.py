"""Ranks sharing a host's cores (`varuna.planner.sharing`): the tables, and what they do to a simulated step."""

from __future__ import annotations

import pytest

from varuna.errors import ScheduleError
from varuna.planner.sharing import Sharing
from varuna.planner.simulator import Span, StageCost, simulate

U = StageCost(forward_s=1.0, backward_s=2.0)


def compute(spans: list[Span]) -> list[tuple[str, float, float]]:
    return [(f"{sp.kind}{sp.microbatch}", sp.start, sp.end) for sp in spans if sp.kind in ("F", "B", "R")]


def test_tables_interpolate_in_the_busy_count() -> None:
    delivery = {
        1: {"F": 1.0, "B": 0.5, "SEND_F": 0.1, "SEND_B": 0.2},
        3: {"F": 3.0, "B": 0.5, "SEND_F": 0.3, "SEND_B": 0.2},
    }
    sharing = Sharing(slowdown={1: 1.0, 2: 1.1, 4: 2.3}, delivery=delivery)
    assert sharing.factor(2) == 1.1 and sharing.factor(3) == pytest.approx(1.7)  # between 2 and 4
    assert sharing.delay("F", 2) == pytest.approx(2.0) and sharing.delay("B", 7) == 0.5
    assert sharing.send("SEND_F", 2) == pytest.approx(0.2) and sharing.send("SEND_B", 3) == 0.2
    # without send costs in every entry the table has none: the caller falls back to message_s
    assert Sharing(delivery={1: {"F": 0.0, "B": 0.0}}).send("SEND_F", 1) is None
    assert Sharing().send("SEND_F", 1) is None


def test_an_oversubscribed_host_shares_its_cores_fairly_beyond_the_counts_measured() -> None:
    assert Sharing(slowdown={1: 1.0, 2: 1.1, 4: 2.3}).factor(8) == pytest.approx(4.6)
    assert Sharing(slowdown={1: 1.0, 2: 1.0}).factor(5) == 1.0  # a core per rank there: flat
    assert Sharing().factor(3) == 1.0


def test_matters_only_when_a_reachable_count_changes_something() -> None:
    assert not Sharing().matters(4)
    assert not Sharing(slowdown={1: 1.0, 2: 1.0}).matters(2)
    assert Sharing(slowdown={2: 1.5}).matters(2)
    assert not Sharing(slowdown={2: 1.5}).matters(1)  # one stage, one replica: never two busy
    assert Sharing(replicas=2, slowdown={2: 1.5}).matters(1)  # ... but two replicas are
    same = {
        1: {"F": 0.5, "B": 0.5, "SEND_F": 0.1, "SEND_B": 0.1},
        2: {"F": 0.5, "B": 0.5, "SEND_F": 0.1, "SEND_B": 0.1},
    }
    assert not Sharing(delivery=same).matters(2)
    sends = {1: same[1], 2: same[2] | {"SEND_F": 0.4}}
    assert Sharing(delivery=sends).matters(2)
    # two ranks on two cores: only a third thing to run, a message's CPU work, needs a core
    cores = {1: 1.0, 2: 1.0, 3: 1.5}
    assert not Sharing(slowdown=cores).matters(2)
    assert Sharing(slowdown=cores, message_cpu_s=[1e-3]).matters(2)
    assert not Sharing(slowdown=cores, message_cpu_s=[1e-3]).matters(1)  # no stage boundary


def test_delivery_waits_longer_while_more_ranks_compute() -> None:
    delivery = {1: {"F": 0.5, "B": 0.25}, 2: {"F": 1.0, "B": 1.0}}
    t = simulate("gpipe", 2, 2, [U, U], sharing=Sharing(delivery=delivery))
    # F0 leaves at 1 with stage 1 idle (n = 1): there at 1.5; F1 leaves at 2 while stage 1 runs F0
    # (n = 2): there at 3; B0 leaves at 6 with stage 0 waiting: 6.25; B1 at 8 while stage 0 runs B0: 9
    assert compute(t.spans[1]) == [("F0", 1.5, 2.5), ("F1", 3.0, 4.0), ("B0", 4.0, 6.0), ("B1", 6.0, 8.0)]
    assert compute(t.spans[0])[2:] == [("B0", 6.25, 8.25), ("B1", 9.0, 11.0)]
    assert t.step_s == 11.0
    # a measured delivery table replaces the fixed DELAY_F / DELAY_B
    fixed = {"DELAY_F": 5.0, "DELAY_B": 5.0}
    assert simulate("gpipe", 2, 2, [U, U], sharing=Sharing(delivery=delivery), message_s=fixed).step_s == 11.0


def test_send_costs_by_busy_count_keep_the_sender_busy() -> None:
    delivery = {
        1: {"F": 0.0, "B": 0.0, "SEND_F": 0.1, "SEND_B": 0.2},
        2: {"F": 0.0, "B": 0.0, "SEND_F": 0.5, "SEND_B": 0.7},
    }
    slow = StageCost(forward_s=2.0, backward_s=2.0)
    t = simulate("gpipe", 2, 2, [U, slow], sharing=Sharing(delivery=delivery), message_s={"SEND_F": 9.0})
    sends = [
        (sp.kind, sp.microbatch, sp.start, sp.end) for st in t.spans for sp in st if sp.kind[:4] == "SEND"
    ]
    # SEND_F0 at 1 with stage 1 idle (n = 1): 0.1, so stage 1 runs F0 from 1.1 to 3.1; SEND_F1 at
    # 2.1 overlaps it (n = 2): 0.5. The table replaces message_s's fixed SEND_F.
    assert sends[:2] == [("SEND_F", 0, 1.0, pytest.approx(1.1)), ("SEND_F", 1, 2.1, pytest.approx(2.6))]
    # stage 1: F1 3.1-5.1, B0 5.1-7.1; SEND_B0 while stage 0 waits (n = 1): 0.2
    assert sends[2] == ("SEND_B", 0, pytest.approx(7.1), pytest.approx(7.3))
    # without send costs in the table, message_s applies
    plain = {n: {"F": d["F"], "B": d["B"]} for n, d in delivery.items()}
    t = simulate("gpipe", 2, 1, [U, U], sharing=Sharing(delivery=plain), message_s={"SEND_F": 0.25})
    assert [sp.end - sp.start for sp in t.spans[0] if sp.kind == "SEND_F"] == [0.25]


ONE = StageCost(forward_s=1.0, backward_s=1.0)
TWO_ON_ONE_CORE = Sharing(replicas=1, slowdown={1: 1.0, 2: 2.0})


def test_shared_cores_stretch_only_what_overlaps() -> None:
    # no two stages ever compute at once in a 2-stage pipeline of one micro-batch: nothing changes
    alone = simulate("gpipe", 2, 1, [U, U], sharing=TWO_ON_ONE_CORE)
    assert alone.step_s == 6.0
    # GPipe, P=2, M=2, f=b=1; stage 0's F1 and stage 1's F0 both start at 1 and share the core, so
    # both end at 3; stage 1's F1 runs alone [3,4], B0 [4,5]; stage 0's B0 and stage 1's B1 share
    # [5,7]; stage 0's B1 alone [7,8]
    t = simulate("gpipe", 2, 2, [ONE, ONE], sharing=TWO_ON_ONE_CORE)
    near = pytest.approx
    assert compute(t.spans[0]) == [
        ("F0", 0, 1),
        ("F1", 1, near(3)),
        ("B0", near(5), near(7)),
        ("B1", near(7), near(8)),
    ]
    assert compute(t.spans[1]) == [
        ("F0", 1, near(3)),
        ("F1", near(3), near(4)),
        ("B0", near(4), near(5)),
        ("B1", near(5), near(7)),
    ]
    assert t.step_s == pytest.approx(8.0)


def test_messages_cpu_work_slows_the_stages_computing_meanwhile() -> None:
    # one core; GPipe, P=2, M=1, f=1, b=2; each message costs 0.5 s of CPU. F0 is sent at 1 while
    # stage 1 starts its F0: two things share the core until the message's work is done at 2, so
    # F0 ends at 2.5 (0.5 of it done by 2); B0 [2.5, 4.5]; its gradient's 0.5 s shares the core
    # with stage 0's B0 from 4.5, which ends at 7. Every second of work on the one core: 1+1+2+2+0.5+0.5.
    sharing = Sharing(slowdown={1: 1.0, 2: 2.0}, message_cpu_s=[0.5])
    t = simulate("gpipe", 2, 1, [U, U], sharing=sharing)
    near = pytest.approx
    assert compute(t.spans[1]) == [("F0", 1.0, near(2.5)), ("B0", near(2.5), near(4.5))]
    assert compute(t.spans[0]) == [("F0", 0.0, 1.0), ("B0", near(4.5), near(7.0))]
    assert t.step_s == near(7.0)
    # with a core to spare (2 cores) the message's work costs the stages nothing
    spare = Sharing(slowdown={1: 1.0, 2: 1.0, 3: 1.5}, message_cpu_s=[0.5])
    assert simulate("gpipe", 2, 1, [U, U], sharing=spare).step_s == near(6.0)
    with pytest.raises(
        ScheduleError, match=r"message_cpu_s = \[0.5\]: give 2 seconds >= 0, one per stage boundary"
    ):
        simulate("gpipe", 3, 1, [U, U, U], sharing=sharing)


def test_replicas_share_the_cores_too() -> None:
    # two replicas of one stage: every action has its twin running, so twice as long
    t = simulate("1f1b", 1, 3, [U], sharing=Sharing(replicas=2, slowdown={2: 2.0}), update_s=[0.5])
    assert t.step_s == pytest.approx(2 * 9.0 + 2 * 0.5)
    # the updates start together: both stages run at half speed until stage 0's (1 s) is done at 2,
    # then stage 1 finishes its last second alone
    two = simulate("gpipe", 2, 1, [U, U], update_s=[1.0, 2.0], sharing=TWO_ON_ONE_CORE)
    assert two.update_s == pytest.approx([2.0, 3.0]) and two.step_s == pytest.approx(6.0 + 3.0)
