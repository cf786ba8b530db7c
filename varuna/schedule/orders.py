"""The schedules by name: each one's order function and what it is (`ScheduleSpec`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from varuna.errors import ScheduleError
from varuna.schedule.actions import WEIGHT_KIND, Action, check_sizes
from varuna.schedule.chunked import (
    Costs,
    Placement,
    checked_costs,
    fuse_weights,
    interleaved_bubble,
    interleaved_order,
    rank_of,
    stages_of,
    zb_v_bubble,
    zb_v_order,
)

__all__ = [
    "ScheduleSpec",
    "SCHEDULES",
    "ScheduleName",
    "schedule_spec",
    "bubble_fraction",
    "pull_ahead_room",
]

ScheduleName = Literal["gpipe", "1f1b", "eager-1f1b", "varuna", "zb-h1", "interleaved-1f1b", "zb-v"]


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


def _zb_h1(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """ZB-H1 ("Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024): every backward in two halves,
    B (the input gradient, which the previous stage waits for) and W (the weight gradients, which
    nobody waits for). Tick x of stage s runs F x, B x-(P-1-s) and W x-(P-1), each where it exists:

        P=3, M=4  stage 0 | F0 F1 F2 B0 F3 B1 B2 B3                  (whole backwards: nobody waits on them)
                  stage 1 | F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3
                  stage 2 | F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3

    The forwards and backwards are 1F1B's, so no stage holds more than P micro-batches' activations
    (stage 0's 1F1B peak); the W that trail a stage's last B fill the drain, where 1F1B's stages wait
    on each other's backwards. With F, B and W equally long its bubble is a third of 1F1B's."""
    warmup = num_stages - 1 - stage
    actions: list[Action] = []
    for x in range(num_microbatches + num_stages - 1):
        if x < num_microbatches:
            actions.append(Action(stage, "F", x))
        if 0 <= x - warmup < num_microbatches:
            actions.append(Action(stage, "B", x - warmup))
        if stage > 0 and 0 <= x - (num_stages - 1) < num_microbatches:
            actions.append(Action(stage, WEIGHT_KIND, x - (num_stages - 1)))
    return actions


def _zb_h1_order(
    stage: int, num_stages: int, num_microbatches: int, costs: Sequence[Costs] | None = None
) -> list[Action]:
    """ZB-H1's order (`_zb_h1`); with `costs` (per stage: seconds of F, B, W and the whole
    backward) each W whose deferral shortens nothing on them is merged back into its B
    (`varuna.schedule.chunked.fuse_weights`): where a split costs more than a whole backward, as
    on CPU, only the W's that fill a wait stay split."""
    if costs is None:
        return _zb_h1(stage, num_stages, num_microbatches)
    return _zb_h1_fused(num_stages, num_microbatches, checked_costs(costs, num_stages))[stage]


@functools.lru_cache(maxsize=64)
def _zb_h1_fused(p: int, m: int, costs: tuple[Costs, ...]) -> list[list[Action]]:
    return fuse_weights([_zb_h1(s, p, m) for s in range(p)], costs)


def pull_ahead_room(stage: int, num_stages: int) -> int:
    """How many micro-batches' activations stage `stage` of `num_stages` may hold when it pulls a
    forward ahead (`ScheduleSpec.pull_ahead`): 1F1B's most, num_stages - stage, plus one. A stage
    that recomputes holds none from its forward to its recompute, so this never stops its pulls."""
    return num_stages - stage + 1


def _bubble_1f1b(num_stages: int, num_microbatches: int) -> float:
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def _bubble_zb_h1(num_stages: int, num_microbatches: int) -> float:
    # A stage works M(F+B+W) = 3M units. With M >= P-1 the drain costs P-1 units instead of 1F1B's
    # 3(P-1); with fewer micro-batches the chain F...F B...B (stage 0's B whole) is longer.
    p, m = num_stages, num_microbatches
    return 1 - 3 * m / max(3 * m + p - 1, 2 * (m + p) - 1)


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a schedule is. The engine, the runtime, the simulator, the planner and morphing read
    these fields; nothing compares a schedule's name. Adding a schedule is one `SCHEDULES` entry
    and its order function."""

    order: Callable[[int, int, int], list[Action]]
    """(rank, P, M) -> that rank's forwards and backwards in order (and weight halves W, where the
    schedule places them itself); each action names its virtual stage (the rank, with one chunk)."""
    recompute: bool = False
    """Non-last stages recompute each micro-batch just before its backward (`recompute=None`)."""
    pull_ahead: bool = False
    """The runtime (and the simulator) pulls the next forward ahead while a gradient is late, as long
    as the stage then holds no more activations than `pull_ahead_room` allows (a micro-batch counts
    from its forward to its backward, or to its W where that backward was split)."""
    split_backward: bool = True
    """Stages after the first may compute their first and last backward in two halves (B, then W;
    `varuna.schedule.split_backwards`); the engine's `split_backward` option turns it off. False for a
    schedule whose order places every W itself, and for interleaved-1f1b, whose drain is a chain of
    half-size chunks' backwards: there the split's second pass costs more than it takes off the
    drain (docs/benchmarks/findings.md has the simulated and measured steps)."""
    bubble: Callable[[int, int], float] = _bubble_1f1b
    """(P, M) -> the idle share of a step in theory: uniform stages, no communication, F = B = W
    (a B is then 2 units, or B and W one each where split)."""
    chunks_per_rank: int = 1
    """Model chunks a rank holds (virtual stages): the model is cut into P x chunks_per_rank stages."""
    placement: Placement = "loop"
    """Which rank holds which virtual stage (`varuna.schedule.chunked`)."""
    timed_order: bool = False
    """`order` also takes ``costs`` (per virtual stage: seconds of F, B, W) and fits the order to
    them (`make_schedule(..., costs=)`; the engine passes its profiled stage costs)."""
    rounds: bool = False
    """Micro-batches go through the ranks in rounds of P: M must be a multiple of P."""
    about: str = ""
    """One line for people."""

    def rank_of(self, stage: int, num_ranks: int) -> int:
        """The rank holding virtual stage `stage` in a pipeline of `num_ranks` ranks."""
        return rank_of(stage, num_ranks, self.chunks_per_rank, self.placement)

    def stages_of(self, rank: int, num_ranks: int) -> list[int]:
        """The virtual stages `rank` holds, in data-flow order."""
        return stages_of(rank, num_ranks, self.chunks_per_rank, self.placement)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(order=_gpipe, about="all forwards, then all backwards"),
    "1f1b": ScheduleSpec(
        order=_one_f_one_b, about="one forward, one backward: at most P micro-batches in flight"
    ),
    "eager-1f1b": ScheduleSpec(
        order=_one_f_one_b,
        pull_ahead=True,
        about="1F1B that runs its next forward while a gradient is late: one micro-batch more than 1F1B held",
    ),
    "varuna": ScheduleSpec(
        order=_one_f_one_b,
        recompute=True,
        pull_ahead=True,
        about="1F1B that recomputes activations just in time and pulls forwards into its bubbles",
    ),
    "zb-h1": ScheduleSpec(
        order=_zb_h1_order,
        split_backward=False,
        timed_order=True,
        pull_ahead=True,
        bubble=_bubble_zb_h1,
        about="ZB-H1: backwards split into B and W, the W filling the drain (on costs: where it pays); pulls forwards ahead",
    ),
    "interleaved-1f1b": ScheduleSpec(
        order=interleaved_order,
        split_backward=False,
        bubble=interleaved_bubble,
        chunks_per_rank=2,
        rounds=True,
        about="interleaved 1F1B: two chunks per rank round-robin, a V-th of 1F1B's bubble; M a multiple of P",
    ),
    "zb-v": ScheduleSpec(
        order=zb_v_order,
        split_backward=False,
        bubble=zb_v_bubble,
        chunks_per_rank=2,
        placement="v",
        timed_order=True,
        about="ZB-V: two chunks per rank in a V, backwards split into B and W (on costs: where it pays)",
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
    """Theoretical idle fraction of a step (`ScheduleSpec.bubble`): (P-1)/(M+P-1) for gpipe, 1f1b,
    eager-1f1b and varuna; for zb-h1 (P-1)/(3M+P-1) once M >= P-1.

    Assumes uniform stage costs, zero communication and F = B = W: each stage works M*(f+b) in a step
    of (M+P-1)*(f+b) under 1F1B. GPipe, 1F1B, eager-1F1B and Varuna's differ in memory, not in this
    bubble (eager-1F1B's pulls fill waits that uneven stages and late messages make);
    recompute's extra forward is left out (the planner's simulator times it).
    """
    spec = schedule_spec(name)
    check_sizes(num_stages, num_microbatches)
    return spec.bubble(num_stages, num_microbatches)
