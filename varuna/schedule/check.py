"""`validate`: a schedule's invariants, checked; a failure shows the grid with the failing cell marked."""

from __future__ import annotations

from varuna.errors import ScheduleError
from varuna.schedule.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    KINDS,
    WEIGHT_KIND,
    Action,
    Schedule,
    check_sizes,
    format_grid,
)
from varuna.schedule.chunked import Placement, rank_of
from varuna.schedule.passes import add_communication, compute_actions

__all__ = ["validate"]


def _fail(schedule: Schedule, mark: tuple[int, int] | None, message: str) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, mark)}")


def validate(
    schedule: Schedule,
    num_stages: int,
    num_microbatches: int,
    *,
    chunks: int = 1,
    placement: Placement = "loop",
) -> None:
    """Raise ScheduleError, with the grid and the failing cell marked, unless `schedule` is sound.

    `num_stages` is the number of ranks (the lists' keys); with `chunks` per rank each action names
    one of the P x chunks virtual stages, held by the rank `placement` says. Accepts compute-only and
    lowered schedules. Checks stage numbering, one F and one B per micro-batch and virtual stage,
    ascending F and B orders, F(m) < R(m) < B(m), communication exactly where `add_communication`
    puts it, and that executing the lists cannot deadlock.
    """
    check_sizes(num_stages, num_microbatches)
    if sorted(schedule) != list(range(num_stages)):
        raise _fail(schedule, None, f"expected stages 0..{num_stages - 1} as keys, got {sorted(schedule)}")
    lowered = any(a.kind in COMM_KINDS for actions in schedule.values() for a in actions)
    virtual = num_stages * chunks
    for s, actions in schedule.items():
        mine = [v for v in range(virtual) if rank_of(v, num_stages, chunks, placement) == s]
        _check_stage(schedule, s, actions, num_microbatches, mine, virtual, lowered)
    if lowered:
        _check_communication(schedule)
    _check_deadlock(schedule, virtual)


def _check_stage(
    schedule: Schedule,
    s: int,
    actions: list[Action],
    num_microbatches: int,
    mine: list[int],
    virtual: int,
    lowered: bool,
) -> None:
    # virtual stage -> kind -> (mb, index in the rank's list)
    seen: dict[int, dict[str, list[tuple[int, int]]]] = {v: {k: [] for k in COMPUTE_KINDS} for v in mine}
    for i, a in enumerate(actions):
        if a.kind == "ALLREDUCE":
            if a.microbatch is not None or i != len(actions) - 1 or a.stage != s:
                raise _fail(
                    schedule, (s, i), f"{a} must be the last action of stage {s}, once, with no micro-batch"
                )
            continue
        if a.stage not in seen:
            held = "stage" if len(mine) == 1 else "virtual stages"
            raise _fail(
                schedule,
                (s, i),
                f"action {a} sits in stage {s}'s list but names stage {a.stage} ({s} holds {held} "
                f"{', '.join(map(str, mine))} of {virtual})",
            )
        if a.kind not in KINDS:
            raise _fail(
                schedule, (s, i), f"unknown action kind {a.kind!r} at stage {s}; valid: {', '.join(KINDS)}"
            )
        if a.microbatch is None or not 0 <= a.microbatch < num_microbatches:
            raise _fail(
                schedule, (s, i), f"{a} has micro-batch {a.microbatch}, expected 0..{num_microbatches - 1}"
            )
        if a.kind == WEIGHT_KIND:  # after its input half: its SEND_B once lowered, its B before
            sent = Action(a.stage, "SEND_B" if lowered else "B", a.microbatch)
            if a.stage == 0 or sent not in actions[:i] or a in actions[:i]:
                raise _fail(
                    schedule,
                    (s, i),
                    f"{a}: a weight half runs once, on a stage after the first, after its {sent} "
                    "(see split_backwards)",
                )
            continue
        mine_seen = seen[a.stage]
        if a.kind in mine_seen:
            first = next((j for m, j in mine_seen[a.kind] if m == a.microbatch), None)
            if first is not None:
                raise _fail(schedule, (s, i), f"{a} appears twice on stage {s} (first at step {first})")
            mine_seen[a.kind].append((a.microbatch, i))
    for v, by_kind in seen.items():
        _check_orders(schedule, s, v, actions, by_kind, num_microbatches)


def _check_orders(
    schedule: Schedule,
    s: int,
    v: int,
    actions: list[Action],
    seen: dict[str, list[tuple[int, int]]],
    num_microbatches: int,
) -> None:
    for kind in ("F", "B"):
        present = {m for m, _ in seen[kind]}
        for m in range(num_microbatches):
            if m not in present:
                raise _fail(schedule, (s, len(actions)), f"stage {s} is missing {Action(v, kind, m)}")
        for (prev, _), (m, i) in zip(seen[kind], seen[kind][1:], strict=False):
            if m < prev:
                raise _fail(
                    schedule,
                    (s, i),
                    f"stage {s} runs {actions[i]} after {Action(v, kind, prev)}: {kind} must run in ascending "
                    "micro-batch order, because the runtime matches messages first in, first out",
                )
    step = {(kind, m): i for kind, pairs in seen.items() for m, i in pairs}
    for m in range(num_microbatches):
        f, b = step[("F", m)], step[("B", m)]
        if b < f:
            raise _fail(schedule, (s, b), f"{actions[b]} runs before its forward {actions[f]} on stage {s}")
        r = step.get(("R", m))
        if r is not None and not f < r < b:
            raise _fail(
                schedule,
                (s, r),
                f"{actions[r]} must run between {actions[f]} and {actions[b]} (recompute feeds B)",
            )


def _check_communication(schedule: Schedule) -> None:
    expected = add_communication({s: compute_actions(actions) for s, actions in schedule.items()})
    for s, actions in schedule.items():
        want = expected[s] + [a for a in actions if a.kind == "ALLREDUCE"]
        actions = [a for a in actions if a.kind != WEIGHT_KIND]
        for i, (got, exp) in enumerate(zip(actions, want, strict=False)):
            if got != exp:
                raise _fail(
                    schedule,
                    (s, i),
                    f"stage {s} step {i}: expected {exp} but found {got}; "
                    "lowered schedules place communication exactly as add_communication does",
                )
        if len(actions) != len(want):
            i = min(len(actions), len(want))
            what = f"is missing {want[i]}" if len(actions) < len(want) else f"has extra {actions[i]}"
            raise _fail(schedule, (s, i), f"stage {s} {what} at step {i} (compare add_communication)")


def _check_deadlock(schedule: Schedule, num_stages: int) -> None:
    """`num_stages`: the virtual stages (P x chunks)."""
    # Comm actions are instantaneous here: only the cross-stage data dependencies can block.
    done: set[Action] = set()
    pos = dict.fromkeys(schedule, 0)

    def needs(a: Action) -> Action | None:
        if a.kind == "F" and a.stage > 0:
            dep = Action(a.stage - 1, "F", a.microbatch)
        elif a.kind == "B" and a.stage < num_stages - 1:
            dep = Action(a.stage + 1, "B", a.microbatch)
        else:
            return None
        return None if dep in done else dep

    progress = True
    while progress:
        progress = False
        for s, actions in schedule.items():
            while pos[s] < len(actions) and needs(actions[pos[s]]) is None:
                done.add(actions[pos[s]])
                pos[s] += 1
                progress = True
    stuck = [s for s in schedule if pos[s] < len(schedule[s])]
    if stuck:
        details = "; ".join(
            f"stage {s} waits at {schedule[s][pos[s]]} for {needs(schedule[s][pos[s]])}" for s in stuck
        )
        raise _fail(
            schedule,
            (stuck[0], pos[stuck[0]]),
            f"deadlock: no stage can advance ({details}); reorder so each wait is met by an earlier action",
        )
