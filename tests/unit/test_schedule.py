"""Schedules as tables: each stage's action list, written in the compact text form."""

from __future__ import annotations

import re

import pytest

from varuna.errors import ScheduleError
from varuna.schedule import (
    COMM_KINDS,
    COMPUTE_KINDS,
    KINDS,
    SCHEDULES,
    WEIGHT_KIND,
    Action,
    Schedule,
    add_allreduce,
    add_communication,
    add_recompute,
    bubble_fraction,
    compute_actions,
    format_grid,
    lower,
    make_schedule,
    split_backwards,
    validate,
)


def text(schedule: Schedule) -> dict[int, list[str]]:
    return {s: [str(a) for a in actions] for s, actions in schedule.items()}


def parse(rows: dict[int, str]) -> Schedule:
    return {s: [Action.from_str(t) for t in row.split()] for s, row in rows.items()}


def grid_rows(message: str) -> dict[int, list[str]]:
    """Read the grid back out of an error message, dropping the mark."""
    rows: dict[int, list[str]] = {}
    for line in message.splitlines():
        found = re.match(r"^(?:>>)?\s*stage (\d+) \|(.*)$", line)
        if found:
            rows[int(found.group(1))] = (
                found.group(2).replace("[?]", "").replace("[", "").replace("]", "").split()
            )
    return rows


# --- Action -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (Action(1, "F", 0), "1F0"),
        (Action(0, "R", 3), "0R3"),
        (Action(2, "B", 7), "2B7"),
        (Action(1, "SEND_F", 0), "1SEND_F0"),
        (Action(0, "RECV_B", 2), "0RECV_B2"),
        (Action(0, "ALLREDUCE", None), "0ALLREDUCE"),
        (Action(12, "F", 34), "12F34"),
    ],
)
def test_action_text(action: Action, expected: str) -> None:
    assert str(action) == expected
    assert Action.from_str(expected) == action


@pytest.mark.parametrize("kind", KINDS)
def test_action_round_trips_every_kind(kind: str) -> None:
    action = Action(3, kind, None if kind == "ALLREDUCE" else 5)
    assert Action.from_str(str(action)) == action
    assert str(Action.from_str(str(action))) == str(action)


def test_kinds() -> None:
    assert KINDS == ("F", "B", "R", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE", "W")
    assert COMPUTE_KINDS + COMM_KINDS + ("ALLREDUCE", WEIGHT_KIND) == KINDS
    assert tuple(SCHEDULES) == ("gpipe", "1f1b", "eager-1f1b", "varuna", "zb-h1", "interleaved-1f1b", "zb-v")


def test_the_registry_holds_each_schedules_behaviour() -> None:
    """Behaviour is read from the entry, never from the name: a new schedule is one entry."""
    from varuna.schedule import ScheduleSpec, build_schedule, schedule_spec

    assert schedule_spec("varuna").recompute and schedule_spec("varuna").pull_ahead
    assert schedule_spec("eager-1f1b").pull_ahead and not schedule_spec("eager-1f1b").recompute
    assert not schedule_spec("1f1b").recompute and not schedule_spec("gpipe").pull_ahead
    assert schedule_spec("zb-h1").pull_ahead and not schedule_spec("zb-v").pull_ahead
    assert [n for n, s in SCHEDULES.items() if s.chunks_per_rank > 1] == ["interleaved-1f1b", "zb-v"]
    # zb-h1 and zb-v place W themselves; interleaved's drain gains less than the split costs
    assert [n for n, s in SCHEDULES.items() if not s.split_backward] == ["zb-h1", "interleaved-1f1b", "zb-v"]
    with pytest.raises(
        ScheduleError,
        match=r"unknown schedule 'zb'; choose one of 'gpipe', '1f1b', 'eager-1f1b', 'varuna', 'zb-h1', 'inter",
    ):
        schedule_spec("zb")

    # an entry is all it takes: 1F1B with one more forward in flight, registered for this test only
    def eager(stage: int, P: int, M: int) -> list[Action]:
        warmup = min(P - stage, M)
        out = [Action(stage, "F", m) for m in range(warmup)]
        for m in range(warmup, M):
            out += [Action(stage, "B", m - warmup), Action(stage, "F", m)]
        return out + [Action(stage, "B", m) for m in range(max(M - warmup, 0), M)]

    SCHEDULES["test-eager"] = ScheduleSpec(order=eager)
    try:
        assert [str(a) for a in make_schedule("test-eager", 2, 4)[0]][:4] == ["0F0", "0F1", "0B0", "0F2"]
        lowered = build_schedule("test-eager", 2, 4)
        assert sum(a.kind == "W" for a in lowered[1]) == 2  # the split backward applies to it too
    finally:
        del SCHEDULES["test-eager"]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("", "cannot parse action ''"),
        ("F0", "cannot parse action 'F0'"),
        ("1X0", r"cannot parse action '1X0'.*kind one of F, B, R, SEND_F"),
        ("1f0", "cannot parse action '1f0'"),
        ("1F0 ", "cannot parse action"),
        ("1F", "kind F needs a micro-batch number"),
        ("0ALLREDUCE3", "kind ALLREDUCE takes no micro-batch"),
    ],
)
def test_action_from_str_rejects(bad: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        Action.from_str(bad)


# --- make_schedule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "p", "m", "expected"),
    [
        ("1f1b", 1, 3, {0: ["0F0", "0B0", "0F1", "0B1", "0F2", "0B2"]}),
        (
            "1f1b",
            2,
            4,
            {
                0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
                1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"],
            },
        ),
        (
            "1f1b",
            3,
            4,
            {
                0: ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"],
                1: ["1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1B3"],
                2: ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"],
            },
        ),
        # fewer micro-batches than stages: warmup is capped at M, a bigger bubble but legal
        ("1f1b", 4, 2, {0: ["0F0", "0F1", "0B0", "0B1"], 3: ["3F0", "3B0", "3F1", "3B1"]}),
        (
            "gpipe",
            2,
            3,
            {0: ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"], 1: ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]},
        ),
        (
            "varuna",
            2,
            3,
            {
                0: ["0F0", "0F1", "0R0", "0B0", "0F2", "0R1", "0B1", "0R2", "0B2"],
                1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
            },
        ),
        (
            "varuna",
            3,
            3,
            {
                0: ["0F0", "0F1", "0F2", "0R0", "0B0", "0R1", "0B1", "0R2", "0B2"],
                1: ["1F0", "1F1", "1R0", "1B0", "1F2", "1R1", "1B1", "1R2", "1B2"],
                2: ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2"],
            },
        ),
        ("varuna", 1, 2, {0: ["0F0", "0B0", "0F1", "0B1"]}),
    ],
)
def test_make_schedule_table(name: str, p: int, m: int, expected: dict[int, list[str]]) -> None:
    got = text(make_schedule(name, p, m))  # type: ignore[arg-type]
    assert sorted(got) == list(range(p))
    for stage, row in expected.items():
        assert got[stage] == row


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_last_stage_of_1f1b_alternates(p: int, m: int) -> None:
    last = make_schedule("1f1b", p, m)[p - 1]
    assert [str(a) for a in last] == [f"{p - 1}{k}{i}" for i in range(m) for k in "FB"]


@pytest.mark.parametrize(
    ("name", "recompute", "stage0"),
    [
        ("gpipe", None, ["0F0", "0F1", "0B0", "0B1"]),
        ("gpipe", True, ["0F0", "0F1", "0R0", "0B0", "0R1", "0B1"]),
        ("1f1b", None, ["0F0", "0F1", "0B0", "0B1"]),
        ("1f1b", True, ["0F0", "0F1", "0R0", "0B0", "0R1", "0B1"]),
        ("varuna", None, ["0F0", "0F1", "0R0", "0B0", "0R1", "0B1"]),
        ("varuna", False, ["0F0", "0F1", "0B0", "0B1"]),
    ],
)
def test_recompute_flag(name: str, recompute: bool | None, stage0: list[str]) -> None:
    schedule = make_schedule(name, 2, 2, recompute=recompute)  # type: ignore[arg-type]
    assert text(schedule)[0] == stage0
    assert not any(a.kind == "R" for a in schedule[1]), "the last stage never recomputes"


def test_varuna_without_recompute_is_1f1b() -> None:
    assert make_schedule("varuna", 4, 6, recompute=False) == make_schedule("1f1b", 4, 6)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            ("pipedream", 2, 4),
            r"unknown schedule 'pipedream'; choose one of 'gpipe', '1f1b', 'eager-1f1b', 'varuna'",
        ),
        (("1f1b", 0, 4), r"num_stages must be at least 1 \(given 0\)"),
        (("gpipe", -2, 4), r"num_stages must be at least 1 \(given -2\)"),
        (("varuna", 2, 0), r"num_microbatches must be at least 1 \(given 0\)"),
    ],
)
def test_make_schedule_rejects(args: tuple[str, int, int], match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        make_schedule(*args)  # type: ignore[arg-type]


# --- passes -----------------------------------------------------------------------------------------


def test_add_recompute_is_pure_and_idempotent() -> None:
    base = make_schedule("1f1b", 2, 2)
    before = text(base)
    once = add_recompute(base, [0])
    assert text(base) == before
    assert text(once)[0] == ["0F0", "0F1", "0R0", "0B0", "0R1", "0B1"]
    assert add_recompute(once, [0]) == once
    assert add_recompute(base, []) == base


def test_add_recompute_on_lowered_goes_before_recv_b() -> None:
    lowered = add_communication(make_schedule("1f1b", 2, 1))
    assert text(add_recompute(lowered, [0]))[0] == ["0F0", "0SEND_F0", "0R0", "0RECV_B0", "0B0"]


def test_add_recompute_rejects_unknown_stage() -> None:
    with pytest.raises(ScheduleError, match=r"stages \[5\] are not in the schedule"):
        add_recompute(make_schedule("1f1b", 2, 2), [0, 5])


def test_lowered_1f1b_two_stages() -> None:
    assert text(lower(make_schedule("1f1b", 2, 2))) == {
        0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1", "0ALLREDUCE"],
        1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1", "1ALLREDUCE"],
    }


def test_lowered_varuna_three_stages() -> None:
    assert text(add_communication(make_schedule("varuna", 3, 1))) == {
        0: ["0F0", "0SEND_F0", "0R0", "0RECV_B0", "0B0"],
        1: ["1RECV_F0", "1F0", "1SEND_F0", "1R0", "1RECV_B0", "1B0", "1SEND_B0"],
        2: ["2RECV_F0", "2F0", "2B0", "2SEND_B0"],
    }


def test_single_stage_lowers_to_allreduce_only() -> None:
    assert text(lower(make_schedule("gpipe", 1, 2))) == {0: ["0F0", "0F1", "0B0", "0B1", "0ALLREDUCE"]}


def test_passes_do_not_mutate_and_compute_actions_inverts_lowering() -> None:
    base = make_schedule("varuna", 3, 5)
    before = text(base)
    lowered = lower(base)
    assert text(base) == before
    assert {s: compute_actions(actions) for s, actions in lowered.items()} == base


def test_passes_refuse_to_run_twice() -> None:
    lowered = lower(make_schedule("1f1b", 2, 2))
    with pytest.raises(
        ScheduleError, match="expects a compute-only schedule, but stage 0 already has 0SEND_F0"
    ):
        add_communication(lowered)
    with pytest.raises(ScheduleError, match="stage 0 already ends with an all-reduce"):
        add_allreduce(lowered)


def test_add_communication_needs_stages_numbered_from_zero() -> None:
    with pytest.raises(ScheduleError, match=r"stages must be numbered 0..P-1, got keys \[1, 2\]"):
        add_communication({1: [], 2: []})


# --- validate: every schedule passes ----------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("recompute", [None, True, False])
def test_validate_accepts_all_schedules(name: str, recompute: bool | None) -> None:
    spec = SCHEDULES[name]
    chunks = {"chunks": spec.chunks_per_rank, "placement": spec.placement}
    for p in range(1, 6):
        for m in range(1, 10):
            if name == "interleaved-1f1b" and m % p:
                continue  # rounds of P micro-batches (test_interleaved_needs_whole_rounds)
            schedule = make_schedule(name, p, m, recompute=recompute)  # type: ignore[arg-type]
            validate(schedule, p, m, **chunks)
            validate(add_communication(schedule), p, m, **chunks)
            validate(lower(schedule), p, m, **chunks)


# --- validate: failures, each with the grid and a marked cell --------------------------------------


@pytest.mark.parametrize(
    ("rows", "p", "m", "match", "marked"),
    [
        ({0: "0F0 0F1 0B0"}, 1, 2, r"stage 0 is missing 0B1", "[?]"),
        ({0: "0F0 0B0 0B1"}, 1, 2, r"stage 0 is missing 0F1", "[?]"),
        ({0: "0B0 0F0"}, 1, 1, r"0B0 runs before its forward 0F0 on stage 0", "[0B0]"),
        ({0: "0F1 0F0 0B0 0B1"}, 1, 2, r"stage 0 runs 0F0 after 0F1: F must run in ascending", "[0F0]"),
        ({0: "0F0 0F1 0B1 0B0"}, 1, 2, r"stage 0 runs 0B0 after 0B1: B must run in ascending", "[0B0]"),
        ({0: "0F0 0F0 0B0"}, 1, 1, r"0F0 appears twice on stage 0 \(first at step 0\)", "[0F0]"),
        ({0: "0R0 0F0 0B0"}, 1, 1, r"0R0 must run between 0F0 and 0B0", "[0R0]"),
        ({0: "0F0 0B0 0R0"}, 1, 1, r"0R0 must run between 0F0 and 0B0", "[0R0]"),
        ({0: "0F0 0R0 0R0 0B0"}, 1, 1, r"0R0 appears twice", "[0R0]"),
        ({0: "0F0 1B0"}, 1, 1, r"action 1B0 sits in stage 0's list but names stage 1", "[1B0]"),
        ({0: "0F0 0F5 0B0"}, 1, 1, r"0F5 has micro-batch 5, expected 0..0", "[0F5]"),
        ({0: "0F0 0ALLREDUCE 0B0"}, 1, 1, r"0ALLREDUCE must be the last action of stage 0", "[0ALLREDUCE]"),
        (
            {0: "0F0 0B0 0ALLREDUCE 0ALLREDUCE"},
            1,
            1,
            r"must be the last action of stage 0, once",
            "[0ALLREDUCE]",
        ),
        (
            {0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0"},
            2,
            1,
            r"stage 1 is missing 1SEND_B0 at step 3",
            "[?]",
        ),
        (
            {0: "0F0 0RECV_B0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"},
            2,
            1,
            r"stage 0 step 1: expected 0SEND_F0 but found 0RECV_B0",
            "[0RECV_B0]",
        ),
        (
            {0: "0RECV_F0 0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"},
            2,
            1,
            r"stage 0 step 0: expected 0F0 but found 0RECV_F0",
            "[0RECV_F0]",
        ),
        (
            {0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0 1SEND_B0"},
            2,
            1,
            r"stage 1 has extra 1SEND_B0 at step 4",
            "[1SEND_B0]",
        ),
    ],
)
def test_validate_rejects(rows: dict[int, str], p: int, m: int, match: str, marked: str) -> None:
    schedule = parse(rows)
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule, p, m)
    message = str(info.value)
    assert marked in message
    assert grid_rows(message) == text(schedule), "the whole grid is printed"
    assert sum(line.startswith(">> stage") for line in message.splitlines()) == 1


def test_validate_rejects_wrong_stage_keys() -> None:
    schedule = make_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match=r"expected stages 0..2 as keys, got \[0, 1\]") as info:
        validate(schedule, 3, 2)
    assert "stage 1 | 1F0" in str(info.value)


@pytest.mark.parametrize(
    ("args", "match"),
    [((0, 1), r"num_stages must be at least 1 \(given 0\)"), ((1, 0), r"num_microbatches .* \(given 0\)")],
)
def test_validate_rejects_bad_sizes(args: tuple[int, int], match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        validate({0: []}, *args)


def test_validate_finds_cross_stage_deadlock() -> None:
    # Stage 0 wants 0B0 before sending micro-batch 1 forward; stage 1 wants 1F1 before running 1B0.
    schedule = parse({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"})
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(schedule, 2, 2)
    message = str(info.value)
    assert "stage 0 waits at 0B0 for 1B0; stage 1 waits at 1F1 for 0F1" in message
    assert re.search(r">> stage 0 \| 0F0 \[0B0\]", message)
    # lowered, the same cycle is found through the communication actions
    with pytest.raises(ScheduleError, match="stage 0 waits at 0B0 for 1B0"):
        validate(lower(schedule), 2, 2)


def test_validate_finds_deadlock_three_stages() -> None:
    # Stage 1 runs 1B0 before forwarding micro-batch 1, but stage 2 wants 2F1 before its 2B0.
    schedule = make_schedule("1f1b", 3, 3)
    schedule |= parse({1: "1F0 1B0 1F1 1B1 1F2 1B2", 2: "2F0 2F1 2B0 2B1 2F2 2B2"})
    with pytest.raises(ScheduleError, match=r"stage 1 waits at 1B0 for 2B0.*stage 2 waits at 2F1 for 1F1"):
        validate(schedule, 3, 3)


# --- format_grid ------------------------------------------------------------------------------------


def test_format_grid_table() -> None:
    assert format_grid(make_schedule("1f1b", 2, 2), mark=(0, 2)).splitlines() == [
        "      step | 0   1   2     3",
        ">> stage 0 | 0F0 0F1 [0B0] 0B1",
        "   stage 1 | 1F0 1B0 1F1   1B1",
    ]


def test_format_grid_aligns_lowered_columns() -> None:
    lines = format_grid(lower(make_schedule("1f1b", 2, 1))).splitlines()
    assert lines == [
        "      step | 0        1        2        3        4",
        "   stage 0 | 0F0      0SEND_F0 0RECV_B0 0B0      0ALLREDUCE",
        "   stage 1 | 1RECV_F0 1F0      1B0      1SEND_B0 1ALLREDUCE",
    ]


def test_format_grid_edge_cases() -> None:
    assert format_grid({}) == "(empty schedule)"
    assert ">> stage 0 | 0F0 [?]" in format_grid(parse({0: "0F0"}), mark=(0, 1))
    assert "[" not in format_grid(parse({0: "0F0"}), mark=(3, 0))


# --- bubble_fraction --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "m", "expected"),
    [(1, 1, 0.0), (1, 8, 0.0), (2, 8, 1 / 9), (4, 4, 3 / 7), (4, 1, 3 / 4), (8, 32, 7 / 39)],
)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "varuna"])
def test_bubble_fraction(name: str, p: int, m: int, expected: float) -> None:
    assert bubble_fraction(name, p, m) == pytest.approx(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize(("p", "m"), [(1, 4), (2, 8), (4, 4), (4, 1), (4, 2), (6, 3), (8, 32)])
def test_zb_h1_bubble_is_its_simulated_one(p: int, m: int) -> None:
    """The theory (F = B = W, no communication) is what the simulator finds for ZB-H1's lists:
    a third of 1F1B's drain, (P-1)/(3M+P-1), once there are P-1 micro-batches or more."""
    from varuna.planner.simulator import StageCost, simulate

    cost = StageCost(forward_s=1.0, backward_s=2.0, input_share=0.5, weight_share=0.5)
    timeline = simulate("zb-h1", p, m, [cost] * p)
    busy = 3.0 * m
    assert 1 - busy / timeline.step_s == pytest.approx(bubble_fraction("zb-h1", p, m))
    if m >= p - 1:
        assert bubble_fraction("zb-h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
        one_f_one_b = simulate("1f1b", p, m, [cost] * p).step_s  # its idle time: 3(P-1) units
        assert 3 * (timeline.step_s - busy) == pytest.approx(one_f_one_b - busy)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("zero-bubble", 2, 2), "unknown schedule 'zero-bubble'"),
        (("1f1b", 0, 2), r"num_stages must be at least 1 \(given 0\)"),
        (("1f1b", 2, 0), r"num_microbatches must be at least 1 \(given 0\)"),
    ],
)
def test_bubble_fraction_rejects(args: tuple[str, int, int], match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        bubble_fraction(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", [n for n, spec in SCHEDULES.items() if spec.split_backward and spec.chunks_per_rank == 1]
)
@pytest.mark.parametrize(("P", "M"), [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_split_backwards_gives_the_first_and_last_backward_a_weight_half(name: str, P: int, M: int) -> None:
    lowered = lower(make_schedule(name, P, M))  # type: ignore[arg-type]
    split = split_backwards(lowered)
    validate(split, P, M)
    assert split[0] == lowered[0]  # the first stage sends no input gradient
    for s in range(1, P):
        backwards = [a.microbatch for a in lowered[s] if a.kind == "B"]
        weights = [a for a in split[s] if a.kind == WEIGHT_KIND]
        assert [a.microbatch for a in weights] == sorted({backwards[0], backwards[-1]})
        for w in weights:  # each right after its own SEND_B
            assert split[s][split[s].index(w) - 1] == Action(s, "SEND_B", w.microbatch)
        assert [a for a in split[s] if a.kind != WEIGHT_KIND] == lowered[s]
    with pytest.raises(ScheduleError, match="split a schedule once"):
        split_backwards(split)
    with pytest.raises(ScheduleError, match="expects a lowered schedule"):
        split_backwards(make_schedule(name, P, M))  # type: ignore[arg-type]


def test_validate_rejects_a_misplaced_weight_half() -> None:
    split = split_backwards(lower(make_schedule("1f1b", 2, 2)))
    early = {0: split[0], 1: [Action(1, WEIGHT_KIND, 1), *split[1]]}  # before its SEND_B
    with pytest.raises(ScheduleError, match=r"1W1: a weight half runs once, on a stage after the first"):
        validate(early, 2, 2)
    twice = {0: split[0], 1: [*split[1][:-1], Action(1, WEIGHT_KIND, 1), split[1][-1]]}
    with pytest.raises(ScheduleError, match=r"1W1: a weight half runs once"):
        validate(twice, 2, 2)
    first = {0: [Action(0, WEIGHT_KIND, 0), *split[0]], 1: split[1]}
    with pytest.raises(ScheduleError, match=r"0W0: a weight half runs once, on a stage after the first"):
        validate(first, 2, 2)
