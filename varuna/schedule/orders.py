"""The schedules by name: each one's order function and what it is (`ScheduleSpec`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from varuna.errors import ScheduleError
from varuna.schedule.actions import Action, check_sizes

__all__ = ["ScheduleSpec", "SCHEDULES", "ScheduleName", "schedule_spec", "bubble_fraction"]

ScheduleName = Literal["gpipe", "1f1b", "varuna"]


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


def bubble_fraction(name: ScheduleName, num_stages: int, num_microbatches: int) -> float:
    """Theoretical idle fraction of a step, (P-1)/(M+P-1), the same for gpipe, 1f1b and varuna.

    Assumes uniform stage costs and zero communication. Forward and backward time are both counted:
    each stage works M*(f+b) in a step of (M+P-1)*(f+b). The schedules differ in memory, not in
    this bubble; recompute's extra forward is left out (the planner's simulator times it).
    """
    schedule_spec(name)
    check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
