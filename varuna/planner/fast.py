"""What lets the planner search thousands of GPUs quickly, each provably the same as the slow way.

- `lowered`: a schedule's lowered action lists, built once per (schedule, P, M, recompute, split)
  and shared by the de-duplication and the simulation. It is `build_schedule` without the final
  `validate` (the same passes, so the same lists; the schedule tests validate every shape).
- `inflight_in_order`: micro-batches each stage holds at its peak when it runs its list in order.
  That is exactly the simulated peak for a schedule without pull-ahead (every stage executes its
  list in order); with pull-ahead (Varuna's) the stages only move forwards earlier, which never
  lowers a prefix's count of held micro-batches, so it is a lower bound. Memory over the limit
  with it is over the limit in the simulation too: the search rejects without simulating.
- `run_in_order`: the simulation of a schedule without pull-ahead and without shared cores, by
  stage: each stage runs its list until it waits for a value not yet sent. Every action's times
  are the same arithmetic as `varuna.planner.simulator._Simulation` (a link carries the sends of
  one stage in list order, so the order in which stages advance cannot change a time), only
  without the bookkeeping for decisions that a fixed order never makes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from varuna.errors import ScheduleError
from varuna.schedule import (
    WEIGHT_KIND,
    Action,
    Schedule,
    Span,
    lower,
    make_schedule,
    schedule_spec,
    split_backwards,
)


class _Cost(Protocol):
    """What `run_in_order` needs of a stage's costs (`varuna.planner.simulator.StageCost`)."""

    def seconds(self, kind: str, *, split: bool = False, recomputes: bool = False) -> float: ...


__all__ = ["lowered", "inflight_in_order", "run_in_order"]


_LOWERED: dict[tuple[object, ...], Schedule] = {}
_LOWERED_MAX = 256


def lowered(name: str, stages: int, microbatches: int, *, recompute: bool, split: bool = True) -> Schedule:
    """`build_schedule(name, stages, microbatches, recompute=..., split_backward=split)` without
    validating, cached: callers must not change the lists. Schedules with the same order function
    share their lists (1F1B and Varuna's: the same order, Varuna's recomputes by default; what
    `make_schedule` and the passes do depends on nothing else)."""
    spec = schedule_spec(name)
    split = bool(split) and spec.split_backward
    key = (spec.order, stages, microbatches, bool(recompute), split)
    found = _LOWERED.get(key)
    if found is None:
        found = lower(make_schedule(name, stages, microbatches, recompute=bool(recompute)))  # type: ignore[arg-type]
        if split:
            found = split_backwards(found)
        if len(_LOWERED) >= _LOWERED_MAX:
            _LOWERED.clear()
        _LOWERED[key] = found
    return found


def inflight_in_order(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches forwarded and not yet released when it runs its list in
    order (as `Timeline.peak_inflight` counts them: a B releases its micro-batch, or its W where
    `split_backwards` split that backward)."""
    out = []
    for s in range(len(schedule)):
        actions = schedule[s]
        split = {a.microbatch for a in actions if a.kind == WEIGHT_KIND}
        held = peak = 0
        for a in actions:
            kind = a.kind
            if kind == "F":
                held += 1
                peak = max(peak, held)
            elif kind == WEIGHT_KIND or (kind == "B" and a.microbatch not in split):
                held -= 1
        out.append(peak)
    return out


def run_in_order(
    schedule: Schedule,
    costs: Sequence[_Cost],
    comm: Sequence[float],
    allreduce: Sequence[float],
    messages: Mapping[str, float],
    link_busy: Sequence[float] | None = None,
) -> list[list[Span]]:
    """The spans `_Simulation.run` gives for `schedule` without pull-ahead, shared cores or
    delivery delays by busy count (see the module docstring)."""
    num = len(schedule)
    busy = comm if link_busy is None else link_busy
    queues: list[list[Action]] = [schedule[s] for s in range(num)]
    work = []
    for s, c in enumerate(costs):
        split = {a.microbatch for a in queues[s] if a.kind == WEIGHT_KIND}
        recomputes = any(a.kind == "R" for a in queues[s])
        work.append(
            (
                c.seconds("F", recomputes=recomputes),
                c.seconds("B"),
                c.seconds("B", split=True),
                c.seconds("R"),
                c.seconds(WEIGHT_KIND),
                split,
            )
        )
    send_f, send_b = messages.get("SEND_F", 0.0), messages.get("SEND_B", 0.0)
    recv = {"RECV_F": messages.get("RECV_F", 0.0), "RECV_B": messages.get("RECV_B", 0.0)}
    delay_f, delay_b = messages.get("DELAY_F", 0.0), messages.get("DELAY_B", 0.0)
    arrival: dict[tuple[str, int, int], float] = {}
    link_free: dict[tuple[str, int], float] = {}
    spans: list[list[Span]] = [[] for _ in range(num)]
    pos, clock = [0] * num, [0.0] * num
    new = tuple.__new__  # Span(...) without the named tuple's Python-level constructor
    left = sum(len(q) for q in queues)
    while left:
        progressed = False
        for s in range(num):
            queue, i, t, out = queues[s], pos[s], clock[s], spans[s]
            f, b, b_split, r, w, split = work[s]
            while i < len(queue):
                a = queue[i]
                kind, m = a.kind, a.microbatch or 0
                if kind == "F":
                    end = t + f
                elif kind == "B":
                    end = t + (b_split if m in split else b)
                elif kind == "R":
                    end = t + r
                elif kind == WEIGHT_KIND:
                    end = t + w
                elif kind == "ALLREDUCE":
                    end = t + allreduce[s]
                elif kind == "RECV_F" or kind == "RECV_B":
                    there = arrival.get((kind[-1], s, m))
                    if there is None:
                        break
                    end = max(t, there) + recv[kind]
                else:  # SEND_F / SEND_B: queue on the link, arrive after the transfer
                    forward = kind == "SEND_F"
                    end = t + (send_f if forward else send_b)
                    to, boundary = (s + 1, s) if forward else (s - 1, s - 1)
                    link = (kind, boundary)
                    start = max(end, link_free.get(link, 0.0))
                    link_free[link] = start + busy[boundary]
                    arrival[(kind[-1], to, m)] = start + comm[boundary] + (delay_f if forward else delay_b)
                out.append(new(Span, (kind, a.microbatch, t, end, None)))
                t = end
                i += 1
            if i != pos[s]:
                left -= i - pos[s]
                progressed = True
            pos[s], clock[s] = i, t
        if left and not progressed:
            waiting = "; ".join(
                f"stage {s} at {queues[s][pos[s]]}" for s in range(num) if pos[s] < len(queues[s])
            )
            raise ScheduleError(f"simulation deadlocked: {waiting}; check the schedule with validate()")
    return spans


class StageQueue:
    """One stage's actions not yet run, for `varuna.planner.simulator._Simulation`: the head, the
    next forward and its neighbours found by index instead of by scanning and removing from a list
    (pull-ahead takes forwards out of the middle)."""

    __slots__ = ("actions", "done", "head", "forwards", "next_f", "left")

    def __init__(self, actions: Sequence[Action]) -> None:
        self.actions = list(actions)
        self.done = [False] * len(self.actions)
        self.head = 0
        self.forwards = [i for i, a in enumerate(self.actions) if a.kind == "F"]
        self.next_f = 0
        self.left = len(self.actions)

    def __bool__(self) -> bool:
        return self.left > 0

    def first(self) -> Action:
        """The next action in list order (the queue must not be empty)."""
        return self.actions[self.head]

    def take(self, i: int) -> Action:
        """Mark action `i` as run and return it."""
        self.done[i] = True
        self.left -= 1
        n, done = len(self.actions), self.done
        while self.head < n and done[self.head]:
            self.head += 1
        forwards = self.forwards
        while self.next_f < len(forwards) and done[forwards[self.next_f]]:
            self.next_f += 1
        return self.actions[i]

    def next_forward(self) -> int | None:
        """Index of the first forward not yet run."""
        return self.forwards[self.next_f] if self.next_f < len(self.forwards) else None

    def before(self, i: int) -> int | None:
        """Index of the last action not yet run before `i`."""
        j = i - 1
        while j >= self.head and self.done[j]:
            j -= 1
        return j if j >= self.head else None

    def after(self, i: int) -> int | None:
        """Index of the first action not yet run after `i`."""
        j, n = i + 1, len(self.actions)
        while j < n and self.done[j]:
            j += 1
        return j if j < n else None
