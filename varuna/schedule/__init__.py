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

Varuna's schedule is that order with just-in-time recompute (`R` right before the backward) and
forwards pulled ahead while a gradient is late; eager-1F1B pulls them ahead without recomputing
(one micro-batch's activations more than 1F1B at most: `pull_ahead_room`).

Where things are: `actions` (Action, kinds), `orders` (each schedule's order function and the
`SCHEDULES` registry), `passes` (recompute, communication, all-reduce, split backward, lowering),
`check` (`validate`) and `build` (`make_schedule`, `build_schedule`). Adding a
schedule is one `SCHEDULES` entry and its order function in `orders`.
"""

from __future__ import annotations

from varuna.schedule.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    KINDS,
    WEIGHT_KIND,
    WORK_KINDS,
    Action,
    Schedule,
    Span,
    format_grid,
)
from varuna.schedule.build import build_schedule, forward_only, make_schedule
from varuna.schedule.check import validate
from varuna.schedule.orders import (
    SCHEDULES,
    ScheduleName,
    ScheduleSpec,
    bubble_fraction,
    pull_ahead_room,
    schedule_spec,
)
from varuna.schedule.passes import (
    add_allreduce,
    add_communication,
    add_recompute,
    compute_actions,
    last_stage,
    lower,
    peak_inflight,
    releasing,
    several_chunks,
    split_backwards,
)

__all__ = [
    "ScheduleSpec",
    "SCHEDULES",
    "schedule_spec",
    "build_schedule",
    "forward_only",
    "Action",
    "Span",
    "COMPUTE_KINDS",
    "WEIGHT_KIND",
    "WORK_KINDS",
    "COMM_KINDS",
    "KINDS",
    "ScheduleName",
    "Schedule",
    "make_schedule",
    "add_recompute",
    "add_communication",
    "add_allreduce",
    "split_backwards",
    "releasing",
    "peak_inflight",
    "lower",
    "compute_actions",
    "last_stage",
    "several_chunks",
    "validate",
    "format_grid",
    "bubble_fraction",
    "pull_ahead_room",
]
