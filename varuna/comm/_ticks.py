"""When each message of a step crosses between ranks on the serial links (`varuna.comm.serial`).

NCCL pairs a rank pair's messages on one communicator by posting order, and (at the least it
promises) runs a rank's operations one after another. Two ranks' batches then pair only if both
post them in one order. torch.distributed.pipelining's schedules are tables of time steps for
that reason: at step t each rank runs its action and exchanges, in one batch, what it made at t
and what its neighbours made at t. Varuna's schedules are per-rank lists; `exchange_ticks` turns
them into such a table without changing any rank's order:

    tick 0, 1, 2, ...: each rank runs its next compute action (F, B, R, W) once the messages it
    needs (its RECV_F / RECV_B before that action) were made at an earlier tick; a SEND after a
    compute action makes its message at that action's tick.

A message's tick is where both ends exchange it: the sender's batch of that tick holds the send,
the receiver's the receive, in the sender's action order. Every rank posts its batches in tick
order, and batch t of one rank pairs only with batch t of its peers, so the batches of all ranks
complete tick by tick whatever the timing (each rank posts batch t once it needs a message of a
later tick, or at the end of its actions). The times are unit costs, as torch's tables are: the
table decides the pairing, not the speed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from varuna.errors import ScheduleError
from varuna.schedule.actions import WORK_KINDS

__all__ = ["Message", "exchange_ticks"]

Message = tuple[str, int, int]
"""("F", v, m): micro-batch m's activation into virtual stage v; ("B", v, m): the gradient of the
activation virtual stage v sent for m, coming back to it."""


def message(action: Any) -> Message | None:
    """The message a SEND_* or RECV_* action moves (None for other kinds)."""
    kind, v, m = action.kind, action.stage, action.microbatch
    if kind == "SEND_F":
        return ("F", v + 1, m)
    if kind == "RECV_F":
        return ("F", v, m)
    if kind == "SEND_B":
        return ("B", v - 1, m)
    if kind == "RECV_B":
        return ("B", v, m)
    return None


def exchange_ticks(
    schedule: Mapping[int, Sequence[Any]], rank_of: Callable[[int], int]
) -> dict[Message, tuple[int, int]]:
    """Every message between two pipeline positions: (its tick, the sending position). Messages
    between two chunks of one rank are not exchanged and not listed. ScheduleError if the lists
    wait for each other (`validate` rejects such lists first)."""
    steps: dict[int, list[tuple[list[Message], list[Message]]]] = {}  # position -> (needs, makes)
    for p, actions in schedule.items():
        segments: list[tuple[list[Message], list[Message]]] = []
        needs: list[Message] = []
        for a in actions:
            msg = message(a)
            if a.kind in WORK_KINDS:
                segments.append((needs, []))
                needs = []
            elif msg is None:
                continue
            elif a.kind.startswith("RECV") and rank_of(msg[1] + (-1 if msg[0] == "F" else 1)) != p:
                needs.append(msg)
            elif a.kind.startswith("SEND") and rank_of(msg[1]) != p:
                if not segments:
                    raise ScheduleError(f"position {p} sends {a} before any compute action")
                segments[-1][1].append(msg)
        steps[p] = segments
    made: dict[Message, tuple[int, int]] = {}
    at = dict.fromkeys(steps, 0)
    tick = 0
    while any(at[p] < len(steps[p]) for p in steps):
        ran = []
        for p, segments in steps.items():
            if at[p] < len(segments) and all(made.get(m, (tick, 0))[0] < tick for m in segments[at[p]][0]):
                ran.append(p)
        if not ran:
            stuck = {p: steps[p][at[p]][0] for p in steps if at[p] < len(steps[p])}
            raise ScheduleError(f"the stages wait for each other at tick {tick}: waiting for {stuck}")
        for p in ran:
            for m in steps[p][at[p]][1]:
                made[m] = (tick, p)
            at[p] += 1
        tick += 1
    return made
