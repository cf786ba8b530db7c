"""Ranks that share one host's cores: processor sharing and delivery delays, for `varuna.planner.simulator`.

On a host with fewer cores than ranks, a stage computes slower while others compute too. With D
replicas running the same schedule, n(t) = D x (stages computing at t) ranks are busy, and a compute
action of base cost w ends when the work done at rate 1 / slowdown(n(t)) reaches w (processor
sharing). The durations depend on the overlaps and the overlaps on the durations, so
`varuna.planner.simulator` repeats, each pass timing every action against the previous pass's overlaps, until
no duration changes (a fixed point; smaller steps towards the new durations if they start swinging
between two overlaps). The parameter updates all start together after the final all-reduce and share
the cores the same way. With `Sharing.delivery`, a value sent while n ranks compute (the sender
counted busy, the others as in the previous pass) arrives `delivery[n]` later than its transfer
time: on an oversubscribed host a waiting stage and the sender's transfer thread wait for a core
too; where the table has the send costs by busy count too (SEND_F / SEND_B), a send keeps its sender
busy that long. With `Sharing.message_cpu_s`, every message also does that much CPU work on the
host (the transport's threads on both sides): from its send on it counts as one more busy rank per
replica, for as long as that work takes at the host's rate, so the stages computing meanwhile slow
down (docs/benchmarks/planner.md shows what counting that work does to the planner's error).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from varuna.planner.costs import CostTable
from varuna.planner.network import slowdown_of
from varuna.schedule import WORK_KINDS, Span

__all__ = ["Sharing", "Delays", "stretch_all", "shared_updates"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Sharing:
    """Ranks that share one host's cores: how much slower each computes while n compute at once."""

    replicas: int = 1
    """D: replicas running the same schedule at the same time (each busy stage counts D times)."""
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """n busy ranks -> compute-time factor (`CostTable.compute_slowdown`); missing n interpolate."""
    delivery: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    """n busy ranks -> {"F": s, "B": s}, how much later than the transfer time an activation or a
    gradient reaches a waiting stage while n ranks compute, the sender among them, and optionally
    "SEND_F" / "SEND_B", how long a send keeps its sender busy (`NetworkCost.delivery_s`); {} means
    the fixed DELAY_F / DELAY_B (and SEND_F / SEND_B) of `message_s`."""

    message_cpu_s: Sequence[float] = ()
    """Per stage boundary, CPU seconds one message across it costs the host
    (`NetworkCost.message_cpu_time` of its bytes); () means none."""

    def factor(self, busy: int) -> float:
        """The compute-time factor with `busy` ranks computing at once (>= 1 means slower);
        beyond the counts measured, as `CostTable.slowdown`."""
        return CostTable.compute_factor_of(self.slowdown, busy)

    def delay(self, kind: str, busy: int) -> float:
        """The delivery delay of a value of `kind` ("F" or "B") sent while `busy` ranks compute."""
        return self._column(kind, busy)

    def send(self, kind: str, busy: int) -> float | None:
        """Seconds a send of `kind` ("SEND_F" or "SEND_B") keeps the sender busy while `busy` - 1
        other ranks compute; None where the delivery table does not say (then `message_s`)."""
        if not self.delivery or not all(kind in d for d in self.delivery.values()):
            return None
        return self._column(kind, busy)

    def _column(self, key: str, busy: int) -> float:
        """`delivery`'s `key` column interpolated in the busy count."""
        return slowdown_of({n: d[key] for n, d in self.delivery.items()}, busy, one=None)

    def matters(self, num_stages: int) -> bool:
        """Whether any reachable busy count changes a duration or a delivery."""
        extra = num_stages > 1 and any(w > 0 for w in self.message_cpu_s)
        counts = [self.replicas * k for k in range(1, num_stages + 1 + extra)]
        return any(self.factor(n) != 1.0 for n in counts) or (
            num_stages > 1
            and len(
                {
                    (self.delay("F", n), self.delay("B", n), self.send("SEND_F", n), self.send("SEND_B", n))
                    for n in counts
                }
            )
            > 1
        )


class _Computing:
    """Which stages compute at a time t, from each stage's compute spans (in order, disjoint)."""

    def __init__(self, spans: list[list[Span]]) -> None:
        self.stages = [
            (
                [sp.start for sp in stage if sp.kind in WORK_KINDS],
                [sp.end for sp in stage if sp.kind in WORK_KINDS],
            )
            for stage in spans
        ]

    def count(self, t: float, *, but: int | None = None) -> int:
        """How many stages (other than `but`) compute at t: start <= t < end."""
        n = 0
        for s, (starts, ends) in enumerate(self.stages):
            i = bisect.bisect_right(starts, t) - 1  # the last span starting by t: only it can hold t
            n += s != but and i >= 0 and t < ends[i]
        return n


class Delays:
    """Delivery delays from the busy stages of a previous pass (none yet: the sender alone)."""

    def __init__(self, sharing: Sharing, spans: list[list[Span]] | None) -> None:
        self.sharing = sharing
        self.busy = _Computing(spans or [])
        self.used: list[float] = []  # every delay handed out, in order: equal in two passes = settled

    def _count(self, sender: int, t: float) -> int:
        """Busy ranks at time t: the sender (counted busy) and the stages computing then, x D."""
        return self.sharing.replicas * (1 + self.busy.count(t, but=sender))

    def __call__(self, kind: str, sender: int, t: float) -> float:
        self.used.append(self.sharing.delay(kind, self._count(sender, t)))
        return self.used[-1]

    def send(self, kind: str, sender: int, t: float) -> float | None:
        """What a send of `kind` started at t costs the sender (`Sharing.send`), None: unmeasured."""
        cost = self.sharing.send(kind, self._count(sender, t))
        if cost is not None:
            self.used.append(cost)
        return cost


def _messages_busy(spans: list[list[Span]], busy: _Computing, sharing: Sharing) -> list[tuple[float, float]]:
    """When each sent message's CPU work (`Sharing.message_cpu_s`) occupies the host: from the
    send's start, for that work at the rate of the ranks computing then (`busy`) plus itself."""
    if not any(w > 0 for w in sharing.message_cpu_s):
        return []
    out = []
    for s, stage in enumerate(spans):
        for sp in stage:
            if sp.kind in ("SEND_F", "SEND_B"):
                v = s if sp.stage is None else sp.stage
                work = sharing.message_cpu_s[v if sp.kind == "SEND_F" else v - 1]
                computing = busy.count(sp.start)
                out.append((sp.start, sp.start + work * sharing.factor(sharing.replicas * (computing + 1))))
    return out


def stretch_all(
    spans: list[list[Span]], work: Callable[[int, str, int], float], sharing: Sharing
) -> dict[tuple[int, str, int], float]:
    """Each compute action's duration under processor sharing, against the overlaps in `spans`
    (the other stages' compute and the messages' CPU work); `work(stage, kind, microbatch)` is
    its lone-compute seconds."""
    busy = _Computing(spans)
    messages = _messages_busy(spans, busy, sharing)
    out = {}
    for s, stage in enumerate(spans):
        edges = _Edges(
            sorted(
                (t, d)
                for intervals in (*(zip(*iv) for o, iv in enumerate(busy.stages) if o != s), messages)
                for a, b in intervals
                for t, d in ((a, 1), (b, -1))
            )
        )
        for sp in stage:
            if sp.kind in WORK_KINDS:
                m = sp.microbatch or 0
                v = s if sp.stage is None else sp.stage  # the virtual stage, with several chunks
                out[(v, sp.kind, m)] = _finish(sp.start, work(v, sp.kind, m), edges, sharing)
    return out


class _Edges:
    """Sorted (time, +1 start / -1 end) edges of the intervals busy beside a stage, with the running
    count after each, so that the count at any time is one bisection away."""

    def __init__(self, edges: list[tuple[float, int]]) -> None:
        self.times = [t for t, _ in edges]
        self.after = list(itertools.accumulate(d for _, d in edges))

    def at(self, t: float) -> tuple[int, int]:
        """(index of the first edge after t, how many intervals are busy at t)."""
        i = bisect.bisect_right(self.times, t)
        return i, self.after[i - 1] if i else 0


def _finish(start: float, work: float, edges: _Edges, sharing: Sharing) -> float:
    """Seconds from `start` until `work` seconds of lone compute are done, while the other stages
    are busy as `edges` say and this one is busy throughout."""
    i, others = edges.at(start)
    times = edges.times
    t, left = start, work
    while True:
        rate = 1.0 / sharing.factor(sharing.replicas * (1 + others))
        nxt = times[i] if i < len(times) else float("inf")
        if left <= (nxt - t) * rate:
            return t + left / rate - start
        left -= (nxt - t) * rate
        t = nxt
        i, others = edges.at(t)


def shared_updates(updates: list[float], sharing: Sharing) -> list[float]:
    """When each stage's parameter update ends if all start at once and share the cores."""
    left = {s: w for s, w in enumerate(updates) if w > 0}
    done = [0.0] * len(updates)
    t = 0.0
    while left:
        rate = 1.0 / sharing.factor(sharing.replicas * len(left))
        s_min = min(left, key=left.__getitem__)
        dt = left[s_min] / rate
        t += dt
        for s in list(left):
            left[s] -= dt * rate
            if left[s] <= 1e-15 or s == s_min:
                done[s] = t
                del left[s]
    return done
