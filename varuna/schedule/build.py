"""From a schedule's name to the action lists: `make_schedule` (compute order) and `build_schedule`
(lowered and validated: what the runtime executes and the simulator times)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from varuna.schedule.actions import Action, Schedule, check_sizes
from varuna.schedule.check import validate
from varuna.schedule.chunked import Costs
from varuna.schedule.orders import ScheduleName, schedule_spec
from varuna.schedule.passes import add_communication, add_recompute, lower, split_backwards

__all__ = ["make_schedule", "build_schedule", "forward_only"]


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    recompute: bool | None = None,
    split_backward: bool = True,
    costs: Sequence[Costs] | None = None,
) -> Schedule:
    """The lowered, validated action lists the runtime executes and the simulator times (compute,
    recompute, communication, all-reduce, split backward): the one place they are assembled."""
    spec = schedule_spec(name)
    made = make_schedule(name, num_stages, num_microbatches, recompute=recompute, costs=costs)  # type: ignore[arg-type]
    lowered = lower(made)
    if split_backward and spec.split_backward:
        lowered = split_backwards(lowered)
    validate(lowered, num_stages, num_microbatches, chunks=spec.chunks_per_rank, placement=spec.placement)
    return lowered


def make_schedule(
    name: ScheduleName,
    num_stages: int,
    num_microbatches: int,
    *,
    recompute: bool | None = None,
    costs: Sequence[Costs] | None = None,
) -> Schedule:
    """Return each stage's compute order (F, B, R) for one step of schedule `name`.

    `recompute=None` means the schedule's default (`ScheduleSpec.recompute`); when True, every
    non-last stage recomputes micro-batch m (`R`) immediately before its backward `B`. `costs` (per
    virtual stage: seconds of F, B and W) fit the order of a schedule with `timed_order` to them;
    others ignore it.

        >>> [str(a) for a in make_schedule("1f1b", 2, 4)[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0F3', '0B2', '0B3']
    """
    spec = schedule_spec(name)
    check_sizes(num_stages, num_microbatches)
    order: Callable[..., list[Action]] = spec.order
    if costs is not None and spec.timed_order:
        order = functools.partial(spec.order, costs=costs)  # type: ignore[call-arg]
    schedule: Schedule = {s: order(s, num_stages, num_microbatches) for s in range(num_stages)}
    if recompute is None:
        recompute = spec.recompute
    last = num_stages * spec.chunks_per_rank - 1
    return add_recompute(schedule, range(last)) if recompute else schedule


def forward_only(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Evaluation's action lists (`Varuna.evaluate`): forwards only, with their receives and sends,
    micro-batch by micro-batch and, within one, each of a rank's chunks in data-flow order; sends do
    not block, so every receive's send comes earlier in some rank's list.

    >>> [str(a) for a in forward_only("1f1b", 2, 2)[1]]
    ['1RECV_F0', '1F0', '1RECV_F1', '1F1']
    """
    spec = schedule_spec(name)
    return add_communication(
        {
            p: [Action(v, "F", m) for m in range(num_microbatches) for v in spec.stages_of(p, num_stages)]
            for p in range(num_stages)
        }
    )
