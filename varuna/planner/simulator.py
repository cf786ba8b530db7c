"""Discrete-event simulation of the lowered action lists the runtime executes.

One source of truth for schedules: `simulate` times exactly `lower(make_schedule(...))`, the lists
`varuna.engine.runtime.StageRuntime` runs, with per-stage compute costs, a transfer time per stage boundary
and each stage's gradient all-reduce. Rules, as in the runtime:

    F, B, R      take the stage's forward / backward / recompute seconds (the F of a stage that
                 recomputes: its forward without autograd, `StageCost.nograd_forward_s`)
    W            a split backward's weight half (`split_backwards`): W(m) takes the stage's
                 `weight_share` of its backward seconds and B(m) then only `input_share`
    SEND_F/B     cost the sender `message_s[kind]` (the runtime's encoding and posting, default 0);
                 the value arrives after the boundary's transfer time plus `message_s["DELAY_F"]`
                 (or DELAY_B; default 0) (a link carries one transfer per direction at a time, so
                 back-to-back sends queue)
    RECV_F/B     complete at max(now, arrival) + `message_s[kind]` (fetching the data once it is
                 there, default 0); the wait is idle time
    ALLREDUCE    takes the stage's all-reduce seconds; the step ends when every stage is done,
                 plus one small all-reduce (`final_allreduce_s`), plus the slowest stage's
                 parameter update (`update_s`: gradient norm and optimizer step)
    opportunistic  (default for "varuna") when the next action is RECV_B(m), that gradient has not
                 arrived and the next forward's input has (stage 0: always), run that forward's
                 RECV_F, F, SEND_F first; a value arriving exactly when the stage looks counts as
                 there, and once the stage waits in RECV_B it waits until that gradient arrives;
                 with `sees_arrivals=False` (a transport whose receives only report completion
                 once waited for, as gloo's) the runtime's check never sees a value there: stage 0
                 pulls every next forward ahead, the other stages never do

For P=2, M=1, f=1, b=2 and a transfer of c on the boundary (times in the picture):

    stage 0 | F0 [0,1]  RECV_B0 waits [1, 4+2c]  B0 [4+2c, 6+2c]
    stage 1 | RECV_F0 waits [0, 1+c]  F0 [1+c, 2+c]  B0 [2+c, 4+c]      step = 6 + 2c

Shared cores (`Sharing`): on a host with fewer cores than ranks, busy stages slow each other down
and sent values can arrive later; the simulation then repeats until the durations settle (see
`varuna.planner.sharing`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from varuna.errors import ScheduleError
from varuna.planner.fast import StageQueue, run_in_order
from varuna.planner.sharing import Delays, Sharing, shared_updates, stretch_all
from varuna.planner.timeline import StageCost, Timeline
from varuna.schedule import (
    WEIGHT_KIND,
    WORK_KINDS,
    Action,
    Schedule,
    ScheduleName,
    Span,
    build_schedule,
    last_stage,
    peak_inflight,
    pull_ahead_room,
    schedule_spec,
    several_chunks,
)

__all__ = ["StageCost", "Sharing", "Span", "Timeline", "simulate", "simulate_lowered"]

_MAX_PASSES = 60
_MESSAGE_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "DELAY_F", "DELAY_B")
_SETTLED = 1e-6  # relative change of every duration that ends the passes


def _per_stage(values: Sequence[float] | None, n: int, what: str) -> list[float]:
    if values is None:
        return [0.0] * n
    out = [float(v) for v in values]
    if len(out) != n or any(v < 0 for v in out):
        raise ScheduleError(f"{what} needs {n} values >= 0 (one per {what.split()[-1]}), got {list(values)}")
    return out


def simulate(
    schedule_name: ScheduleName,
    num_stages: int,
    num_microbatches: int,
    stage_costs: Sequence[StageCost],
    *,
    comm: Sequence[float] | None = None,
    allreduce_s: Sequence[float] | None = None,
    final_allreduce_s: float = 0.0,
    update_s: Sequence[float] | None = None,
    sharing: Sharing | None = None,
    message_s: Mapping[str, float] | None = None,
    sees_arrivals: bool = True,
    recompute: bool | None = None,
    opportunistic: bool | None = None,
    split_backward: bool = False,
    link_busy: Sequence[float] | None = None,
) -> Timeline:
    """Time one step of `schedule_name` on P stages with M micro-batches.

    `stage_costs[s]` is stage s's per-micro-batch cost; `comm[s]` the seconds to move an activation
    (or its gradient) across the boundary between stages s and s+1 (P-1 values, default 0);
    `link_busy[s]` the seconds each such transfer keeps the boundary's link busy (default `comm`:
    more where other replicas' transfers share the link, so that the next one waits longer);
    `allreduce_s[s]` stage s's gradient all-reduce (default 0); `update_s[s]` its parameter update
    after the final all-reduce (default 0); `sharing` makes busy stages slow each other down (see
    the module docstring); `message_s` maps SEND_F, RECV_F, SEND_B, RECV_B to the seconds the
    runtime spends per message on top of the transfer (`NetworkCost.message_s`);
    `sees_arrivals` is `NetworkCost.reports_arrival` (see the module docstring). `recompute` goes
    to `make_schedule` (None: the schedule's `ScheduleSpec.recompute`); `opportunistic=None` means
    the schedule's `ScheduleSpec.pull_ahead`;
    `split_backward` times the lists `split_backwards` makes (as the engine runs by default).

        >>> t = simulate("gpipe", 2, 2, [StageCost(forward_s=1, backward_s=2)] * 2)
        >>> t.step_s, t.bubble_fraction
        (9.0, 0.33333333333333337)
    """
    spec = schedule_spec(schedule_name)  # zb-v: the order the engine runs, fitted to the costs
    costs = [c.order_costs() for c in stage_costs]
    fit = spec.timed_order and len(costs) == num_stages * spec.chunks_per_rank and min(map(min, costs)) > 0
    schedule = build_schedule(
        schedule_name,
        num_stages,
        num_microbatches,
        recompute=recompute,
        split_backward=split_backward,
        costs=costs if fit else None,
    )
    return simulate_lowered(
        schedule,
        stage_costs,
        comm=comm,
        allreduce_s=allreduce_s,
        final_allreduce_s=final_allreduce_s,
        update_s=update_s,
        sharing=sharing,
        message_s=message_s,
        sees_arrivals=sees_arrivals,
        link_busy=link_busy,
        opportunistic=spec.pull_ahead if opportunistic is None else opportunistic,
        name=schedule_name,
        num_microbatches=num_microbatches,
    )


def simulate_lowered(
    schedule: Schedule,
    stage_costs: Sequence[StageCost],
    *,
    comm: Sequence[float] | None = None,
    allreduce_s: Sequence[float] | None = None,
    final_allreduce_s: float = 0.0,
    update_s: Sequence[float] | None = None,
    sharing: Sharing | None = None,
    message_s: Mapping[str, float] | None = None,
    sees_arrivals: bool = True,
    opportunistic: bool = False,
    name: str = "custom",
    num_microbatches: int | None = None,
    in_order: bool = True,
    link_busy: Sequence[float] | None = None,
) -> Timeline:
    """Time any lowered schedule (as `varuna.schedule.lower` makes); see `simulate`. With several
    chunks per rank, `stage_costs` and `comm` are per virtual stage and boundary (a boundary between
    two chunks of one rank costs what the caller says: nothing is moved there), the all-reduce and
    update per rank. Without pull-ahead or shared cores it runs stage by stage
    (`varuna.planner.fast.run_in_order`, the same times); `in_order=False` always simulates event by
    event (the reference)."""
    num_stages = len(schedule)
    virtual = last_stage(schedule) + 1
    if len(stage_costs) != virtual:
        raise ScheduleError(
            f"stage_costs has {len(stage_costs)} entries but the schedule has {virtual} stages"
        )
    comm_s = _per_stage(comm, virtual - 1, "comm seconds per boundary")
    busy_s = (
        comm_s if link_busy is None else _per_stage(link_busy, virtual - 1, "link_busy seconds per boundary")
    )
    if any(b < c for b, c in zip(busy_s, comm_s, strict=True)):
        raise ScheduleError(
            f"link_busy = {busy_s}: each boundary's must be at least its comm seconds {comm_s}"
        )
    reduce_s = _per_stage(allreduce_s, num_stages, "allreduce_s per stage")
    updates = _per_stage(update_s, num_stages, "update_s per stage")
    messages = dict(message_s or {})
    if any(k not in _MESSAGE_KINDS or not v >= 0 for k, v in messages.items()):
        raise ScheduleError(
            f"message_s = {messages}: give seconds >= 0 for the kinds {', '.join(_MESSAGE_KINDS)}"
        )
    if sharing is not None and sharing.replicas < 1:
        raise ScheduleError(f"Sharing.replicas = {sharing.replicas}; it must be at least 1")
    if (
        sharing is not None
        and sharing.message_cpu_s
        and (len(sharing.message_cpu_s) != virtual - 1 or any(not w >= 0 for w in sharing.message_cpu_s))
    ):
        raise ScheduleError(
            f"Sharing.message_cpu_s = {list(sharing.message_cpu_s)}: give {virtual - 1} seconds >= 0, "
            "one per stage boundary, or () for none"
        )
    shared = sharing is not None and sharing.matters(num_stages)
    durations: dict[tuple[int, str, int], float] = {}
    change, step = float("inf"), 1.0
    delay = None
    if sharing is not None and sharing.delivery:
        messages = {k: v for k, v in messages.items() if not k.startswith("DELAY")}
        delay = Delays(sharing, None)
    previous_delays: list[float] | None = None
    chunked = several_chunks(schedule)  # the event simulation then (run_in_order: a stage per rank)
    if in_order and not opportunistic and not shared and delay is None and not chunked:  # by stage
        spans = run_in_order(schedule, stage_costs, comm_s, reduce_s, messages, busy_s)
        return _timeline(schedule, spans, name, num_microbatches, final_allreduce_s, updates)
    for _ in range(_MAX_PASSES if shared else 1):
        sim = _Simulation(
            schedule,
            stage_costs,
            comm_s,
            reduce_s,
            opportunistic,
            durations,
            messages,
            sees_arrivals,
            delay,
            busy_s,
        )
        sim.run()
        moved = False
        if delay is not None:
            assert sharing is not None
            used, delay = delay.used, Delays(sharing, sim.spans)
            moved = used != previous_delays
            previous_delays = used
        if not shared:
            break
        assert sharing is not None
        stretched = stretch_all(sim.spans, sim.work, sharing)
        last, change = (
            change,
            max(
                (abs(d - durations[k]) / max(d, 1e-12) if k in durations else float("inf"))
                for k, d in stretched.items()
            ),
        )
        if change <= _SETTLED and not moved:
            break
        if (
            change >= last and change > _SETTLED
        ):  # not shrinking: swinging between two overlaps; take smaller steps
            step = max(step / 2, 0.125)
        durations = {k: durations.get(k, d) + step * (d - durations.get(k, d)) for k, d in stretched.items()}
    update_end = shared_updates(updates, sharing) if shared and sharing is not None else updates
    return _timeline(schedule, sim.spans, name, num_microbatches, final_allreduce_s, update_end)


def _timeline(
    schedule: Schedule,
    spans_of: list[list[Span]],
    name: str,
    num_microbatches: int | None,
    final_allreduce_s: float,
    update_end: list[float],
) -> Timeline:
    num_stages = len(schedule)
    ends = [spans[-1].end if spans else 0.0 for spans in spans_of]
    step = max(ends, default=0.0) + final_allreduce_s + max(update_end, default=0.0)
    busy = [sum(sp.end - sp.start for sp in spans if sp.kind in WORK_KINDS) for spans in spans_of]
    reduce = [sum(sp.end - sp.start for sp in spans if sp.kind == "ALLREDUCE") for spans in spans_of]
    if num_microbatches is None:
        num_microbatches = sum(1 for a in schedule[0] if a.kind == "F")
    return Timeline(
        schedule=name,
        num_microbatches=num_microbatches,
        spans=spans_of,
        step_s=step,
        busy_s=busy,
        allreduce_s=reduce,
        idle_s=[step - b - r for b, r in zip(busy, reduce)],
        bubble_fraction=1.0 - sum(busy) / (num_stages * step) if step > 0 else 0.0,
        peak_inflight=[peak_inflight(spans) for spans in spans_of],
        update_s=update_end,
    )


class _Simulation:
    """Advances each stage through its list; a stage stops where it must wait for another one.

    A stage decides at its own clock t. "Has gradient m arrived by t?" is known once the sender has
    sent it, or once the sender's clock plus the transfer already passes t (it can only send later).
    Otherwise the stage is undecided and other stages run first. If every unfinished stage is
    blocked or undecided, nothing more can be sent before the earliest undecided clock, so that
    stage decides "not arrived": it pulls a forward whose input is here, or commits to its RECV_B.
    """

    def __init__(
        self,
        schedule: Schedule,
        costs: Sequence[StageCost],
        comm: list[float],
        allreduce: list[float],
        opportunistic: bool,
        durations: Mapping[tuple[int, str, int], float] | None = None,
        messages: Mapping[str, float] | None = None,
        sees_arrivals: bool = True,
        delay: Delays | None = None,
        link_busy: list[float] | None = None,
    ) -> None:
        self.messages = messages or {}
        self.delay = delay
        self.sees_arrivals = sees_arrivals
        self.queues = [StageQueue(schedule[s]) for s in range(len(schedule))]
        self.costs = costs
        self.durations = durations or {}
        self.comm = comm
        self.link_busy = comm if link_busy is None else link_busy
        self.allreduce = allreduce
        self.opportunistic = opportunistic
        self.clock = [0.0] * len(schedule)
        self.spans: list[list[Span]] = [[] for _ in schedule]
        self.arrival: dict[tuple[str, int, int], float] = {}  # (kind, receiving stage, mb) -> time
        self.link_free: dict[tuple[str, int], float] = {}
        self.committed: set[int] = set()  # stages decided to wait in their head RECV_B
        self.split = {
            (a.stage, a.microbatch) for actions in schedule.values() for a in actions if a.kind == WEIGHT_KIND
        }
        self.rank = {
            a.stage: s for s, actions in schedule.items() for a in actions if a.microbatch is not None
        }
        self.chunked = several_chunks(schedule)
        """Several chunks per rank: spans name their virtual stage."""
        self.virtual = last_stage(schedule) + 1
        self.held = [0] * self.virtual  # micro-batches whose activations each virtual stage holds
        self.recomputes = {a.stage for actions in schedule.values() for a in actions if a.kind == "R"}

    def work(self, v: int, kind: str, m: int) -> float:
        """Lone-compute seconds of (virtual) stage v's action `kind` on micro-batch m."""
        return self.costs[v].seconds(
            kind, split=kind == "B" and (v, m) in self.split, recomputes=v in self.recomputes
        )

    def run(self) -> None:
        while True:
            progressed, undecided = False, []
            for s in range(len(self.queues)):
                while self.queues[s]:
                    outcome = self._step(s, force=False)
                    if outcome == "undecided":
                        undecided.append(s)
                    if outcome != "done":
                        break
                    progressed = True
            if not any(self.queues):
                return
            if not progressed:
                if not undecided:
                    waiting = "; ".join(f"stage {s} at {q.first()}" for s, q in enumerate(self.queues) if q)
                    raise ScheduleError(
                        f"simulation deadlocked: {waiting}; check the schedule with validate()"
                    )
                first = min(undecided, key=lambda s: (self.clock[s], s))
                self._step(first, force=True)

    def _state(self, kind: str, s: int, m: int, t: float) -> str:
        """Whether value (kind, m) bound for stage s is there at time t: "yes", "no" or "unknown"."""
        key = (kind, s, m)
        if key in self.arrival:
            return "yes" if self.arrival[key] <= t else "no"
        sender, boundary = (s - 1, s - 1) if kind == "F" else (s + 1, s)
        return "no" if self.clock[self.rank[sender]] + self.comm[boundary] > t else "unknown"

    def _next_forward(self, s: int, t: float) -> tuple[str, list[int]]:
        """The runtime's `_forward_ready`: the next forward group (indices into the stage's
        queue) and whether its input is here."""
        queue = self.queues[s]
        i = queue.next_forward()
        if i is None:
            return "no", []
        group = [i]
        prev, after = queue.before(i), queue.after(i)
        if prev is not None and queue.actions[prev].kind == "RECV_F":
            group.insert(0, prev)
        if after is not None and queue.actions[after].kind == "SEND_F":
            group.append(after)
        first = queue.actions[i]
        if self.held[first.stage] >= pull_ahead_room(first.stage, self.virtual):
            return "no", []
        ready = "yes" if first.stage == 0 else self._state("F", first.stage, first.microbatch or 0, t)
        return ready, group

    def _step(self, s: int, *, force: bool) -> str:
        """Run stage s's next action (or pulled-ahead group): "done", "blocked" or "undecided"."""
        head, t = self.queues[s].first(), self.clock[s]
        if self.opportunistic and head.kind == "RECV_B" and s not in self.committed:
            grad = self._state("B", head.stage, head.microbatch or 0, t) if self.sees_arrivals else "no"
            if grad != "yes":
                ahead, group = self._next_forward(s, t)
                if not self.sees_arrivals and s > 0:
                    ahead = "no"
                if force:  # nothing unsent can arrive by t (see the class docstring)
                    grad, ahead = "no", "yes" if ahead == "yes" else "no"
                if ahead == "unknown" or (grad == "unknown" and ahead == "yes"):
                    return "undecided"
                if ahead == "yes":
                    for i in group:
                        self._execute(s, self.queues[s].take(i))
                    return "done"
                self.committed.add(s)
        if (
            head.kind in ("RECV_F", "RECV_B")
            and (head.kind[-1], head.stage, head.microbatch or 0) not in self.arrival
        ):
            return "blocked"
        self.committed.discard(s)
        self._execute(s, self.queues[s].take(self.queues[s].head))
        return "done"

    def _execute(self, s: int, a: Action) -> None:
        t = self.clock[s]
        m = a.microbatch or 0
        v = a.stage  # the virtual stage (s, the rank, with one chunk per rank)
        end = t
        if a.kind in WORK_KINDS:
            end = t + self.durations.get((v, a.kind, m), self.work(v, a.kind, m))
            held = a.kind == "R" or (a.kind == "F" and v not in self.recomputes)  # as the runtime's outputs
            # ... and weight halves: a split backward's micro-batch is held until its W
            released = a.kind == WEIGHT_KIND or (a.kind == "B" and (v, m) not in self.split)
            self.held[v] += 1 if held else -released
        elif a.kind == "ALLREDUCE":
            end = t + self.allreduce[s]
        elif a.kind in ("RECV_F", "RECV_B"):
            end = max(t, self.arrival[(a.kind[-1], v, m)]) + self.messages.get(a.kind, 0.0)
        else:  # SEND_F / SEND_B: queue on the link, arrive after the transfer
            cost = self.delay.send(a.kind, s, t) if self.delay is not None else None
            end = t + (self.messages.get(a.kind, 0.0) if cost is None else cost)
            to, boundary = (v + 1, v) if a.kind == "SEND_F" else (v - 1, v - 1)
            link = (a.kind, boundary)
            start = max(end, self.link_free.get(link, 0.0))
            self.link_free[link] = start + self.link_busy[boundary]
            if self.delay is not None:
                extra = self.delay(a.kind[-1], s, start)
            else:
                extra = self.messages.get("DELAY" + a.kind[-2:], 0.0)
            self.arrival[(a.kind[-1], to, m)] = start + self.comm[boundary] + extra
        stage = v if self.chunked and a.kind != "ALLREDUCE" else None
        self.spans[s].append(tuple.__new__(Span, (a.kind, a.microbatch, t, end, stage)))  # a Span, quicker
        self.clock[s] = end
