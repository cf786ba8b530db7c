"""Passes over schedules: recompute, communication, the all-reduce, the split backward, lowering."""

from __future__ import annotations

from collections.abc import Iterable

from varuna.errors import ScheduleError
from varuna.schedule.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    WEIGHT_KIND,
    Action,
    Schedule,
    Span,
    format_grid,
)

__all__ = [
    "add_recompute",
    "add_communication",
    "add_allreduce",
    "split_backwards",
    "releasing",
    "peak_inflight",
    "lower",
    "compute_actions",
    "last_stage",
]


def _stage_count(schedule: Schedule, what: str) -> int:
    if sorted(schedule) != list(range(len(schedule))):
        raise ScheduleError(
            f"{what}: stages must be numbered 0..P-1, got keys {sorted(schedule)}\n{format_grid(schedule)}"
        )
    return len(schedule)


def add_recompute(schedule: Schedule, stages: Iterable[int]) -> Schedule:
    """Insert R(m) just before each B(m) (before its RECV_B in lowered form) of the given (virtual)
    `stages`; a new Schedule."""
    chosen = set(stages)
    present = {a.stage for actions in schedule.values() for a in actions if a.microbatch is not None}
    unknown = sorted(chosen - present)
    if unknown:
        raise ScheduleError(
            f"add_recompute: stages {unknown} are not in the schedule (it has {sorted(present)})"
        )
    result: Schedule = {}
    for s, actions in schedule.items():
        done = {(a.stage, a.microbatch) for a in actions if a.kind == "R"}
        out: list[Action] = []
        for a in actions:
            if a.stage in chosen and a.kind == "B" and (a.stage, a.microbatch) not in done:
                recv = Action(a.stage, "RECV_B", a.microbatch)
                at = len(out) - 1 if out and out[-1] == recv else len(out)
                out.insert(at, Action(a.stage, "R", a.microbatch))
            out.append(a)
        result[s] = out
    return result


def last_stage(schedule: Schedule) -> int:
    """The last virtual stage a schedule names (P-1 with one chunk per rank)."""
    return max(
        (a.stage for actions in schedule.values() for a in actions if a.microbatch is not None), default=0
    )


def several_chunks(schedule: Schedule) -> bool:
    """Whether some rank runs another virtual stage than its own (several chunks per rank)."""
    return any(a.stage != s for s, actions in schedule.items() for a in actions if a.microbatch is not None)


def add_communication(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule: RECV_F/SEND_F around each F and RECV_B/SEND_B around each B
    (by virtual stage: the first receives no activation, the last sends none)."""
    _stage_count(schedule, "add_communication")
    last = last_stage(schedule)
    result: Schedule = {}
    for s, actions in schedule.items():
        out: list[Action] = []
        for a in actions:
            if a.kind in COMM_KINDS:
                raise ScheduleError(
                    f"add_communication expects a compute-only schedule, but stage {s} already has {a}; "
                    f"lower a schedule once (pass it through compute_actions first to re-lower)"
                )
            v = a.stage
            if a.kind == "F" and v > 0:
                out.append(Action(v, "RECV_F", a.microbatch))
            if a.kind == "B" and v < last:
                out.append(Action(v, "RECV_B", a.microbatch))
            out.append(a)
            if a.kind == "F" and v < last:
                out.append(Action(v, "SEND_F", a.microbatch))
            if a.kind == "B" and v > 0:
                out.append(Action(v, "SEND_B", a.microbatch))
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
        backwards: dict[int, list[int | None]] = {}
        for a in actions:
            if a.kind == "B" and a.stage > 0:
                backwards.setdefault(a.stage, []).append(a.microbatch)
        if backwards and not any(a.kind == "SEND_B" for a in actions):
            raise ScheduleError("split_backwards expects a lowered schedule (pass it through lower first)")
        ends = {(v, m) for v, mbs in backwards.items() for m in (mbs[0], mbs[-1])}
        out: list[Action] = []
        for a in actions:
            out.append(a)
            if a.kind == "SEND_B" and (a.stage, a.microbatch) in ends:
                out.append(Action(a.stage, WEIGHT_KIND, a.microbatch))
        result[s] = out
    return result


def releasing(spans: Iterable[Span]) -> set[tuple[str, int | None, int | None]]:
    """(kind, micro-batch, virtual stage) of the spans of one rank after which a micro-batch's saved
    activations are gone: its B, or its W where that backward was split. The stage is the span's
    (None with one chunk per rank)."""
    spans = list(spans)
    split = {(sp.microbatch, sp.stage) for sp in spans if sp.kind == WEIGHT_KIND}
    return {
        (WEIGHT_KIND if (sp.microbatch, sp.stage) in split else "B", sp.microbatch, sp.stage)
        for sp in spans
        if sp.kind == "B"
    }


def peak_inflight(spans: Iterable[Span]) -> int:
    """The most micro-batches one rank's spans hold activations of at once: from each forward to the
    end of its backward (of its W, where that backward was split; `releasing`)."""
    spans = list(spans)
    frees = releasing(spans)
    held = peak = 0
    for sp in spans:
        held += (sp.kind == "F") - ((sp.kind, sp.microbatch, sp.stage) in frees)
        peak = max(peak, held)
    return peak


def lower(schedule: Schedule) -> Schedule:
    """Return the schedule the runtime executes: `add_allreduce(add_communication(schedule))`."""
    return add_allreduce(add_communication(schedule))


def compute_actions(actions: list[Action]) -> list[Action]:
    """Keep only the compute actions (F, B, R) of one stage's list."""
    return [a for a in actions if a.kind in COMPUTE_KINDS]
