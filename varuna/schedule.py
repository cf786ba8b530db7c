"""Pipeline schedules as data: each stage's ordered list of actions, made by pure functions.

The runtime interprets these lists, the planner's simulator times them and the widgets draw them,
so all three agree on what a step does. `SCHEDULES` holds each schedule's behaviour; `make_schedule`
gives the compute order; passes rewrite it (`add_recompute`, `add_communication`, `add_allreduce`,
`lower`); `validate` checks the invariants (on failure, the grid with the failing cell marked).

1F1B for P=3 stages, M=4 micro-batches (one column per time slot, uniform costs; `.` is bubble):

    stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

    make_schedule("1f1b", 3, 4)[0]  ->  0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3

Varuna's schedule is that order with just-in-time recompute (`R` right before the backward).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from varuna.errors import ScheduleError

__all__ = [
    "ScheduleSpec",
    "SCHEDULES",
    "schedule_spec",
    "build_schedule",
    "Action",
    "Span",
    "COMPUTE_KINDS",
    "WEIGHT_KIND",
    "WORK_KINDS",
    "COMM_KINDS",
    "KINDS",
    "SCHEDULES",
    "ScheduleName",
    "Schedule",
    "make_schedule",
    "add_recompute",
    "add_communication",
    "add_allreduce",
    "split_backwards",
    "releasing",
    "lower",
    "compute_actions",
    "validate",
    "format_grid",
    "bubble_fraction",
]

COMPUTE_KINDS = ("F", "B", "R")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
WEIGHT_KIND = "W"
"""A split backward's weight half (see `split_backwards`); B(m) is then only the input gradient."""
WORK_KINDS = COMPUTE_KINDS + (WEIGHT_KIND,)
"""The kinds that keep a stage's processor busy."""
KINDS = COMPUTE_KINDS + COMM_KINDS + ("ALLREDUCE", WEIGHT_KIND)
ScheduleName = Literal["gpipe", "1f1b", "varuna"]

_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+)(\d*)$")


class Span(NamedTuple):
    """One executed (runtime) or simulated (planner) action: kind, micro-batch, start and end seconds."""

    kind: str
    microbatch: int | None
    start: float
    end: float


class Action(NamedTuple):
    """One step of one stage: `Action(1, "F", 0)` is stage 1's forward of micro-batch 0, text `1F0`."""

    stage: int
    kind: str
    microbatch: int | None  # None only for ALLREDUCE

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse the compact form `"{stage}{kind}{microbatch}"`, e.g. `"0B3"`, `"1SEND_F0"`, `"2ALLREDUCE"`."""
        match = _ACTION_RE.match(text)
        if match is None or match.group(2) not in KINDS:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected '<stage><kind><microbatch>' like '1F0' or "
                f"'0ALLREDUCE', with kind one of {', '.join(KINDS)}"
            )
        stage, kind, mb = match.groups()
        if (kind == "ALLREDUCE") != (mb == ""):
            need = "takes no micro-batch" if kind == "ALLREDUCE" else "needs a micro-batch number"
            raise ScheduleError(f"cannot parse action {text!r}: kind {kind} {need}")
        return cls(int(stage), kind, int(mb) if mb else None)


Schedule = dict[int, list[Action]]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ScheduleError(
            f"num_stages must be at least 1 (given {num_stages}); set the pipeline depth P >= 1"
        )
    if num_microbatches < 1:
        raise ScheduleError(
            f"num_microbatches must be at least 1 (given {num_microbatches}); "
            "give each replica at least one micro-batch per step"
        )


def _gpipe(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    return [Action(stage, kind, m) for kind in "FB" for m in range(num_microbatches)]


def _one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    warmup = min(num_stages - 1 - stage, num_microbatches)
    actions = [Action(stage, "F", m) for m in range(warmup)]
    next_f, next_b = warmup, 0
    while next_f < num_microbatches:
        actions += [Action(stage, "F", next_f), Action(stage, "B", next_b)]
        next_f, next_b = next_f + 1, next_b + 1
    actions += [Action(stage, "B", m) for m in range(next_b, num_microbatches)]
    return actions


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a schedule is. The engine, the runtime, the simulator, the planner and morphing read
    these fields; nothing compares a schedule's name. Adding a schedule is one `SCHEDULES` entry
    and its order function."""

    order: Callable[[int, int, int], list[Action]]
    """(stage, P, M) -> that stage's forwards and backwards in order."""
    recompute: bool = False
    """Non-last stages recompute each micro-batch just before its backward (`recompute=None`)."""
    pull_ahead: bool = False
    """The runtime (and the simulator) pulls the next forward ahead while a gradient is late."""
    split_backward: bool = True
    """Stages after the first may compute their first and last backward in two halves (B, then W);
    the engine's `split_backward` option turns it off for every schedule."""
    chunks_per_rank: int = 1
    """Model chunks a rank holds (virtual stages); 1 for every schedule so far."""
    about: str = ""
    """One line for people."""


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(order=_gpipe, about="all forwards, then all backwards"),
    "1f1b": ScheduleSpec(
        order=_one_f_one_b, about="one forward, one backward: at most P micro-batches in flight"
    ),
    "varuna": ScheduleSpec(
        order=_one_f_one_b,
        recompute=True,
        pull_ahead=True,
        about="1F1B that recomputes activations just in time and pulls forwards into its bubbles",
    ),
}
"""Every schedule by name."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The registry entry of `name`; ScheduleError naming the choices for an unknown one."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(map(repr, SCHEDULES))}")
    return spec


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    recompute: bool | None = None,
    split_backward: bool = True,
) -> Schedule:
    """The lowered, validated action lists the runtime executes and the simulator times (compute,
    recompute, communication, all-reduce, split backward): the one place they are assembled."""
    spec = schedule_spec(name)
    lowered = lower(make_schedule(name, num_stages, num_microbatches, recompute=recompute))  # type: ignore[arg-type]
    if split_backward and spec.split_backward:
        lowered = split_backwards(lowered)
    validate(lowered, num_stages, num_microbatches)
    return lowered


def make_schedule(
    name: ScheduleName, num_stages: int, num_microbatches: int, *, recompute: bool | None = None
) -> Schedule:
    """Return each stage's compute order (F, B, R) for one step of schedule `name`.

    `recompute=None` means the schedule's default (`ScheduleSpec.recompute`); when True, every
    non-last stage recomputes micro-batch m (`R`) immediately before its backward `B`.

        >>> [str(a) for a in make_schedule("1f1b", 2, 4)[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0F3', '0B2', '0B3']
    """
    spec = schedule_spec(name)
    _check_sizes(num_stages, num_microbatches)
    schedule: Schedule = {s: spec.order(s, num_stages, num_microbatches) for s in range(num_stages)}
    if recompute is None:
        recompute = spec.recompute
    return add_recompute(schedule, range(num_stages - 1)) if recompute else schedule


def _stage_count(schedule: Schedule, what: str) -> int:
    if sorted(schedule) != list(range(len(schedule))):
        raise ScheduleError(
            f"{what}: stages must be numbered 0..P-1, got keys {sorted(schedule)}\n{format_grid(schedule)}"
        )
    return len(schedule)


def add_recompute(schedule: Schedule, stages: Iterable[int]) -> Schedule:
    """Insert R(m) just before each B(m) (before its RECV_B in lowered form) on `stages`; a new Schedule."""
    chosen = set(stages)
    unknown = sorted(chosen - set(schedule))
    if unknown:
        raise ScheduleError(
            f"add_recompute: stages {unknown} are not in the schedule (it has {sorted(schedule)})"
        )
    result: Schedule = {}
    for s, actions in schedule.items():
        done = {a.microbatch for a in actions if a.kind == "R"}
        out: list[Action] = []
        for a in actions:
            if s in chosen and a.kind == "B" and a.microbatch not in done:
                at = len(out) - 1 if out and out[-1] == Action(s, "RECV_B", a.microbatch) else len(out)
                out.insert(at, Action(s, "R", a.microbatch))
            out.append(a)
        result[s] = out
    return result


def add_communication(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule: RECV_F/SEND_F around each F and RECV_B/SEND_B around each B."""
    last = _stage_count(schedule, "add_communication") - 1
    result: Schedule = {}
    for s, actions in schedule.items():
        out: list[Action] = []
        for a in actions:
            if a.kind in COMM_KINDS:
                raise ScheduleError(
                    f"add_communication expects a compute-only schedule, but stage {s} already has {a}; "
                    f"lower a schedule once (pass it through compute_actions first to re-lower)"
                )
            if a.kind == "F" and s > 0:
                out.append(Action(s, "RECV_F", a.microbatch))
            if a.kind == "B" and s < last:
                out.append(Action(s, "RECV_B", a.microbatch))
            out.append(a)
            if a.kind == "F" and s < last:
                out.append(Action(s, "SEND_F", a.microbatch))
            if a.kind == "B" and s > 0:
                out.append(Action(s, "SEND_B", a.microbatch))
        result[s] = out
    return result


def add_allreduce(schedule: Schedule) -> Schedule:
    """Append each stage's data-parallel gradient all-reduce, `Action(s, "ALLREDUCE", None)`."""
    for s, actions in schedule.items():
        if any(a.kind == "ALLREDUCE" for a in actions):
            raise ScheduleError(f"add_allreduce: stage {s} already ends with an all-reduce; add it once")
    return {s: [*actions, Action(s, "ALLREDUCE", None)] for s, actions in schedule.items()}


def split_backwards(schedule: Schedule) -> Schedule:
    """Give the first and the last backward of each stage after the first a separate weight half
    `W m`, right after its SEND_B: B(m) then computes only the gradient of the stage's input,
    SEND_B(m) sends it, and W(m) computes the weight gradients. A lowered schedule in, a new one out.

    The previous stage waits for that input gradient at both ends of the step: in GPipe it starts
    its backwards on the first one, and in every schedule the drain is a chain in which each stage
    waits for the next one's last. The weight half waits for nobody, so it leaves the critical path
    there. Only these two are split: the split costs a little (a second pass over part of the
    graph), and a W right after its SEND_B holds no activation longer than the plain backward.

        >>> [str(a) for a in split_backwards(lower(make_schedule("1f1b", 2, 3)))[1]]
        ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1W0', '1RECV_F1', '1F1', '1B1', '1SEND_B1', '1RECV_F2', '1F2', '1B2', '1SEND_B2', '1W2', '1ALLREDUCE']
    """
    result: Schedule = {}
    for s, actions in schedule.items():
        if any(a.kind == WEIGHT_KIND for a in actions):
            raise ScheduleError(f"split_backwards: stage {s} already has W actions; split a schedule once")
        backwards = [a.microbatch for a in actions if a.kind == "B"]
        if s > 0 and backwards and not any(a.kind == "SEND_B" for a in actions):
            raise ScheduleError("split_backwards expects a lowered schedule (pass it through lower first)")
        ends = {backwards[0], backwards[-1]} if s > 0 and backwards else set()
        out: list[Action] = []
        for a in actions:
            out.append(a)
            if a.kind == "SEND_B" and a.microbatch in ends:
                out.append(Action(s, WEIGHT_KIND, a.microbatch))
        result[s] = out
    return result


def releasing(spans: Iterable[Span]) -> set[tuple[str, int | None]]:
    """(kind, micro-batch) of the spans of one stage after which a micro-batch's saved activations
    are gone: its B, or its W where `split_backwards` split that backward."""
    spans = list(spans)
    split = {sp.microbatch for sp in spans if sp.kind == WEIGHT_KIND}
    return {(WEIGHT_KIND if sp.microbatch in split else "B", sp.microbatch) for sp in spans if sp.kind == "B"}


def lower(schedule: Schedule) -> Schedule:
    """Return the schedule the runtime executes: `add_allreduce(add_communication(schedule))`."""
    return add_allreduce(add_communication(schedule))


def compute_actions(actions: list[Action]) -> list[Action]:
    """Keep only the compute actions (F, B, R) of one stage's list."""
    return [a for a in actions if a.kind in COMPUTE_KINDS]


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """Draw one row per stage, columns by position; the `mark=(stage, index)` cell is shown `[like this]`.

    A mark one past the end of a row points at something missing and is drawn `[?]`.
    """
    if not schedule:
        return "(empty schedule)"
    rows = {s: [str(a) for a in schedule[s]] for s in sorted(schedule)}
    if mark is not None and mark[0] in rows:
        cells = rows[mark[0]]
        if 0 <= mark[1] < len(cells):
            cells[mark[1]] = f"[{cells[mark[1]]}]"
        elif mark[1] == len(cells):
            cells.append("[?]")
    steps = max(len(cells) for cells in rows.values())
    header = [str(i) for i in range(steps)]
    widths = [max(len(c[i]) for c in [header, *rows.values()] if i < len(c)) for i in range(steps)]
    label_w = len(f"stage {max(rows)}")

    def row(prefix: str, label: str, cells: list[str]) -> str:
        body = " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False))
        return f"{prefix}{label.rjust(label_w)} | {body}"

    lines = [row("   ", "step", header)]
    lines += [
        row(">> " if mark and mark[0] == s else "   ", f"stage {s}", cells) for s, cells in rows.items()
    ]
    return "\n".join(line.rstrip() for line in lines)


def _fail(schedule: Schedule, mark: tuple[int, int] | None, message: str) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, mark)}")


def validate(schedule: Schedule, num_stages: int, num_microbatches: int) -> None:
    """Raise ScheduleError, with the grid and the failing cell marked, unless `schedule` is sound.

    Accepts compute-only and lowered schedules. Checks stage numbering, one F and one B per
    micro-batch, ascending F and B orders, F(m) < R(m) < B(m), communication exactly where
    `add_communication` puts it, and that executing the lists cannot deadlock.
    """
    _check_sizes(num_stages, num_microbatches)
    if sorted(schedule) != list(range(num_stages)):
        raise _fail(schedule, None, f"expected stages 0..{num_stages - 1} as keys, got {sorted(schedule)}")
    lowered = any(a.kind in COMM_KINDS for actions in schedule.values() for a in actions)
    for s, actions in schedule.items():
        _check_stage(schedule, s, actions, num_microbatches)
    if lowered:
        _check_communication(schedule)
    _check_deadlock(schedule, num_stages)


def _check_stage(schedule: Schedule, s: int, actions: list[Action], num_microbatches: int) -> None:
    seen: dict[str, list[tuple[int, int]]] = {kind: [] for kind in COMPUTE_KINDS}  # kind -> (mb, step)
    for i, a in enumerate(actions):
        if a.stage != s:
            raise _fail(schedule, (s, i), f"action {a} sits in stage {s}'s list but names stage {a.stage}")
        if a.kind not in KINDS:
            raise _fail(
                schedule, (s, i), f"unknown action kind {a.kind!r} at stage {s}; valid: {', '.join(KINDS)}"
            )
        if a.kind == "ALLREDUCE":
            if a.microbatch is not None or i != len(actions) - 1:
                raise _fail(
                    schedule, (s, i), f"{a} must be the last action of stage {s}, once, with no micro-batch"
                )
            continue
        if a.microbatch is None or not 0 <= a.microbatch < num_microbatches:
            raise _fail(
                schedule, (s, i), f"{a} has micro-batch {a.microbatch}, expected 0..{num_microbatches - 1}"
            )
        if a.kind == WEIGHT_KIND:
            sent = Action(s, "SEND_B", a.microbatch)
            if s == 0 or sent not in actions[:i] or a in actions[:i]:
                raise _fail(
                    schedule,
                    (s, i),
                    f"{a}: a weight half runs once, on a stage after the first, after its {sent} "
                    "(see split_backwards)",
                )
            continue
        if a.kind in seen:
            first = next((j for m, j in seen[a.kind] if m == a.microbatch), None)
            if first is not None:
                raise _fail(schedule, (s, i), f"{a} appears twice on stage {s} (first at step {first})")
            seen[a.kind].append((a.microbatch, i))
    for kind in ("F", "B"):
        present = {m for m, _ in seen[kind]}
        for m in range(num_microbatches):
            if m not in present:
                raise _fail(schedule, (s, len(actions)), f"stage {s} is missing {Action(s, kind, m)}")
        for (prev, _), (m, i) in zip(seen[kind], seen[kind][1:], strict=False):
            if m < prev:
                raise _fail(
                    schedule,
                    (s, i),
                    f"stage {s} runs {actions[i]} after {Action(s, kind, prev)}: {kind} must run in ascending "
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


def bubble_fraction(name: ScheduleName, num_stages: int, num_microbatches: int) -> float:
    """Theoretical idle fraction of a step, (P-1)/(M+P-1), the same for gpipe, 1f1b and varuna.

    Assumes uniform stage costs and zero communication. Forward and backward time are both counted:
    each stage works M*(f+b) in a step of (M+P-1)*(f+b). The schedules differ in memory, not in
    this bubble; recompute's extra forward is left out (the planner's simulator times it).
    """
    schedule_spec(name)
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
