"""The controller's thread-safe store of a job's events, and the plain-data views drawn from it.

Events come in from the ZeroMQ receiver thread, from the run directory's logs (replay, and a
reconciliation when a launch ends, since messages queued in a dying worker may never leave it)
and from the controller itself; duplicates are dropped by (job, rank, seq). Views are dataclasses
and dicts (no plotting): `timeline`, `step_metrics`, `memory`, `ranks`, `chrome_trace`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "EventStore",
    "StoreViews",
    "SpanRecord",
    "TimelineRow",
    "Timeline",
    "StepMetrics",
    "StageMemory",
    "RankRow",
    "NoticeView",
]

LIFECYCLE = ("hello", "ready", "checkpoint_done", "exit", "error", "notice", "stop_decided")


@dataclass(slots=True)
class SpanRecord:
    """One executed action, wall-clock seconds."""

    kind: str
    microbatch: int | None
    start: float
    end: float
    step: int
    rank: int
    direction: str | None = None
    peer: int | None = None
    bytes: int | None = None
    vstage: int | None = None
    """The virtual stage it ran for, where a rank holds several chunks (interleaved-1f1b, zb-v)."""


@dataclass(slots=True)
class TimelineRow:
    """The spans of one rank: one row per (stage, replica)."""

    stage: int
    replica: int
    rank: int
    spans: list[SpanRecord] = field(default_factory=list)


@dataclass(slots=True)
class Timeline:
    """The measured pipeline of the last steps; `start` is the earliest span's start."""

    steps: list[int]
    rows: list[TimelineRow]
    start: float
    end: float


@dataclass(slots=True)
class StepMetrics:
    """One step over all ranks: the slowest rank's time sets the throughput."""

    step: int
    loss: float
    samples_per_s: float
    bubble: float
    time_s: float
    bubble_by_stage: dict[int, float]


@dataclass(slots=True)
class StageMemory:
    """The latest memory figures of one stage (the largest over its replicas), bytes."""

    stage: int
    step: int
    params: int
    grads: int
    optimizer: int
    activations: int
    peak_rss: int | None
    rss: int | None
    cuda_allocated: int | None = None
    cuda_peak: int | None = None


@dataclass(slots=True)
class RankRow:
    """One row of the ranks table."""

    rank: int
    stage: int | None
    replica: int | None
    state: str
    last_heartbeat: float | None
    steps: int
    host: str | None
    pid: int | None
    exit_code: int | None = None
    error: str | None = None


@dataclass(slots=True)
class NoticeView:
    """The preemption notice of the newest launch, and how the job met it (epoch seconds)."""

    job: str | None
    reason: str
    deadline: float
    hosts: list[str] | None
    """The hosts that go away (None: all)."""
    rank: int | None
    """The rank that reported it (rank 0 for a stop file; a SIGTERM reaches one host's ranks)."""
    seen_step: int | None
    """Steps done when the rank got it."""
    stop_step: int | None = None
    """The step after which the ranks stopped (None: still training)."""
    stop_seconds_left: float | None = None
    checkpoint_time: float | None = None
    """When the stop's checkpoint was committed."""
    exited: bool = False


class EventStore:
    """Every event of a job, indexed for the views; safe to use from several threads."""

    def __init__(self, keep_span_steps: int = 200) -> None:
        self.keep_span_steps = keep_span_steps
        self._lock = threading.Lock()
        self._seen: set[tuple[Any, ...]] = set()
        self.lifecycle: list[dict[str, Any]] = []
        self._metrics: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        self._spans: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        self._ranks: dict[int, RankRow] = {}
        self.count = 0

    def add(self, event: dict[str, Any]) -> bool:
        """Take one event; False when it was seen before (or is not an event)."""
        kind, rank = event.get("type"), event.get("rank")
        if not isinstance(kind, str):
            return False
        key = (event["id"],) if "id" in event else (event.get("job"), rank, event.get("seq"), kind)
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            self.count += 1
            if kind == "spans" and isinstance(rank, int):
                steps = self._spans
                steps[int(event.get("step") or 0)][rank] = event
                while len(steps) > self.keep_span_steps:
                    del steps[min(steps)]
            elif kind == "step_metrics" and isinstance(rank, int):
                self._metrics[int(event.get("step") or 0)][rank] = event
            else:
                self.lifecycle.append(event)
            if isinstance(rank, int):
                self._track(rank, kind, event)
        return True

    def _track(self, rank: int, kind: str, event: dict[str, Any]) -> None:
        row = self._ranks.get(rank)
        if row is None or kind == "hello":
            row = self._ranks[rank] = RankRow(
                rank, event.get("stage"), event.get("replica"), "starting", None, 0, None, None
            )
        if kind == "hello":
            row.host, row.pid = event.get("host"), event.get("pid")
        elif kind == "ready":
            row.state = "running"
        elif kind in ("step_metrics", "spans"):
            row.last_heartbeat = max(row.last_heartbeat or 0.0, float(event.get("time", 0.0)))
            row.steps += kind == "step_metrics"
        elif kind == "error":
            row.state, row.error = "failed", f"{event.get('error_type')}: {event.get('message')}"
        elif kind == "exit":
            row.exit_code = event.get("code")
            if row.state != "failed":
                row.state = str(event.get("state") or ("exited" if row.exit_code in (0, 75) else "failed"))

    def events(self, kind: str | None = None, job: str | None = None) -> list[dict[str, Any]]:
        """Lifecycle events (optionally of one type and one launch), in arrival order."""
        with self._lock:
            return [
                e
                for e in self.lifecycle
                if (kind is None or e["type"] == kind) and (job is None or e.get("job") == job)
            ]

    # views -------------------------------------------------------------------------------------
    def notice(self) -> NoticeView | None:
        """The newest launch's preemption notice with the earliest deadline, with its stop, the stop's
        checkpoint and exit as they arrive; None when that launch got none."""
        with self._lock:
            hellos = [e for e in self.lifecycle if e["type"] == "hello"]
            job = hellos[-1].get("job") if hellos else None
            mine = [e for e in self.lifecycle if e.get("job") == job]
        notices = [e for e in mine if e["type"] == "notice" and isinstance(e.get("deadline"), (int, float))]
        if not notices:
            return None
        first = min(notices, key=lambda e: float(e["deadline"]))
        hosts = first.get("hosts")
        view = NoticeView(
            job=job,
            reason=str(first.get("reason") or ""),
            deadline=float(first["deadline"]),
            hosts=[str(h) for h in hosts] if isinstance(hosts, list) else None,
            rank=first.get("rank"),
            seen_step=first.get("step"),
        )
        stops = [e for e in mine if e["type"] == "stop_decided"]
        if stops:
            view.stop_step = stops[0].get("step")
            left = [
                float(e["seconds_left"]) for e in stops if isinstance(e.get("seconds_left"), (int, float))
            ]
            view.stop_seconds_left = min(left) if left else view.deadline - float(stops[0].get("time", 0.0))
            saved = [
                e
                for e in mine
                if e["type"] == "checkpoint_done"
                and e.get("blocking", True) is not False
                and e.get("saved_step") == view.stop_step
            ]
            if saved:
                view.checkpoint_time = max(float(e.get("time", 0.0)) for e in saved)
            view.exited = any(e["type"] == "exit" for e in mine)
        return view

    def ranks(self) -> list[RankRow]:
        """The ranks table, by rank."""
        with self._lock:
            return [
                RankRow(**{f: getattr(r, f) for f in RankRow.__slots__})
                for _, r in sorted(self._ranks.items())
            ]

    def span_steps(self) -> list[int]:
        """The steps whose spans are kept, oldest first."""
        with self._lock:
            return sorted(self._spans)

    def timeline(self, last_steps: int = 3, *, until: int | None = None) -> Timeline:
        """Spans of the last `last_steps` recorded steps (up to step `until`), one row per rank.

        Rows come from the newest launch among those steps only, so after a resize the timeline
        shows the new shape's rows, not a mix of both. A step some rank of that launch has not
        reported yet (the ranks' spans arrive one by one) gives way to the complete steps before
        it; with no complete step, the newest steps as they are.
        """
        launch: tuple[Any, Any] | None = None
        with self._lock:
            kept = [s for s in sorted(self._spans) if until is None or s <= until]
            steps = kept[-last_steps:] if last_steps > 0 else []
            if steps:
                newest = max(self._spans[kept[-1]].values(), key=lambda e: e.get("time", 0.0))
                launch = (newest.get("job"), newest.get("launch"))
                reported = {
                    s: {r for r, e in self._spans[s].items() if (e.get("job"), e.get("launch")) == launch}
                    for s in kept
                }
                ours = [s for s in kept if reported[s]]
                ranks = set().union(*(reported[s] for s in ours))
                complete = [s for s in ours if reported[s] == ranks]
                steps = (complete or ours)[-last_steps:]
            chosen = [(s, dict(self._spans[s])) for s in steps]  # the receiver thread adds ranks
        rows: dict[int, TimelineRow] = {}
        for step, by_rank in chosen:
            for rank, event in by_rank.items():
                if (event.get("job"), event.get("launch")) != launch:
                    continue
                row = rows.setdefault(rank, TimelineRow(event["stage"], event["replica"], rank))
                row.spans += [
                    SpanRecord(
                        s["kind"],
                        s.get("mb"),
                        s["start"],
                        s["end"],
                        step,
                        rank,
                        s.get("dir"),
                        s.get("peer"),
                        s.get("bytes"),
                        s.get("vstage"),
                    )
                    for s in event["spans"]
                ]
        ordered = sorted(rows.values(), key=lambda r: (r.replica, r.stage))
        starts = [s.start for r in ordered for s in r.spans]
        ends = [s.end for r in ordered for s in r.spans]
        return Timeline(steps, ordered, min(starts, default=0.0), max(ends, default=0.0))

    def step_metrics(self) -> list[StepMetrics]:
        """Per step: loss, samples/s, mean bubble fraction over the ranks."""
        with self._lock:
            items = [(s, list(by_rank.values())) for s, by_rank in sorted(self._metrics.items())]
        out = []
        for step, events in items:
            time_s = max(float(e["time_s"]) for e in events)
            by_stage: dict[int, list[float]] = defaultdict(list)
            for e in events:
                by_stage[int(e["stage"])].append(float(e["bubble"]))
            slowest = max(events, key=lambda e: float(e["time_s"]))
            out.append(
                StepMetrics(
                    step=step,
                    loss=float(events[0]["loss"]),
                    samples_per_s=float(slowest["samples_per_s"]),
                    bubble=sum(float(e["bubble"]) for e in events) / len(events),
                    time_s=time_s,
                    bubble_by_stage={s: sum(v) / len(v) for s, v in sorted(by_stage.items())},
                )
            )
        return out

    def step_events(self) -> list[dict[str, Any]]:
        """The kept ``step_metrics`` events, by step and rank (each rank's ``compute_s``: stragglers)."""
        with self._lock:
            return [e for _, by_rank in sorted(self._metrics.items()) for _, e in sorted(by_rank.items())]

    def memory(self) -> list[StageMemory]:
        """The latest figures per stage."""
        with self._lock:
            latest: dict[int, dict[int, Any]] = {}
            for step in sorted(self._metrics):
                for event in self._metrics[step].values():
                    latest.setdefault(int(event["stage"]), {})[int(event["replica"])] = event
        out = []
        for stage, by_replica in sorted(latest.items()):
            event = max(by_replica.values(), key=lambda e: e["memory"].get("peak_rss_bytes") or 0)
            m = event["memory"]
            out.append(
                StageMemory(
                    stage=stage,
                    step=int(event["step"]),
                    params=int(m["params_bytes"]),
                    grads=int(m["grads_bytes"]),
                    optimizer=int(m["optimizer_bytes"]),
                    activations=int(m["activations_bytes"]),
                    peak_rss=m.get("peak_rss_bytes"),
                    rss=m.get("rss_bytes"),
                    cuda_allocated=m.get("cuda_allocated_bytes"),
                    cuda_peak=m.get("cuda_peak_bytes"),
                )
            )
        return out

    def chrome_trace(self, last_steps: int | None = None) -> dict[str, Any]:
        """A Chrome/Perfetto trace: an "X" slice per span (pid per stage/replica row, tid per rank) and
        send -> recv flow arrows ("s"/"f") matched by (step, micro-batch, direction, sender, receiver)."""
        timeline = self.timeline(last_steps if last_steps is not None else self.keep_span_steps)
        events: list[dict[str, Any]] = []
        sends: dict[tuple[Any, ...], SpanRecord] = {}
        recvs: dict[tuple[Any, ...], SpanRecord] = {}
        rows = {(r.replica, r.stage) for r in timeline.rows}
        pid_of = {key: i for i, key in enumerate(sorted(rows))}
        for row in timeline.rows:
            pid = pid_of[(row.replica, row.stage)]
            events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": pid,
                    "args": {"name": f"stage {row.stage} / replica {row.replica}"},
                }
            )
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": row.rank,
                    "args": {"name": f"rank {row.rank}"},
                }
            )
            for s in row.spans:
                name = s.kind + (s.direction or "") + (str(s.microbatch) if s.microbatch is not None else "")
                args = {"step": s.step, "microbatch": s.microbatch, "bytes": s.bytes, "peer": s.peer}
                events.append(
                    {
                        "ph": "X",
                        "name": name,
                        "cat": s.kind,
                        "pid": pid,
                        "tid": row.rank,
                        "ts": s.start * 1e6,
                        "dur": max(s.end - s.start, 0.0) * 1e6,
                        "args": {k: v for k, v in args.items() if v is not None},
                    }
                )
                if s.kind == "send" and s.peer is not None:
                    sends[(s.step, s.microbatch, s.direction, s.rank, s.peer)] = s
                elif s.kind == "recv" and s.peer is not None:
                    recvs[(s.step, s.microbatch, s.direction, s.peer, s.rank)] = s
        pids = {row.rank: pid_of[(row.replica, row.stage)] for row in timeline.rows}
        for n, key in enumerate(sorted(set(sends) & set(recvs), key=str)):
            send, recv = sends[key], recvs[key]
            name = f"{key[2]}{key[1]}"
            events.append(
                {
                    "ph": "s",
                    "id": n,
                    "name": name,
                    "cat": "p2p",
                    "pid": pids[send.rank],
                    "tid": send.rank,
                    "ts": send.start * 1e6,
                }
            )
            events.append(
                {
                    "ph": "f",
                    "bp": "e",
                    "id": n,
                    "name": name,
                    "cat": "p2p",
                    "pid": pids[recv.rank],
                    "tid": recv.rank,
                    "ts": max(recv.end * 1e6 - 1.0, send.start * 1e6),
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}


class StoreViews:
    """The plain-data views of an `EventStore` (for the widgets), on anything that has one as `store`."""

    store: EventStore

    def timeline(self, last_steps: int = 3) -> Timeline:
        """Spans of the last steps, one row per stage and replica."""
        return self.store.timeline(last_steps)

    def step_metrics(self) -> list[StepMetrics]:
        """Loss, samples/s and bubble fraction per step."""
        return self.store.step_metrics()

    def memory(self) -> list[StageMemory]:
        """The latest memory figures per stage."""
        return self.store.memory()

    def ranks(self) -> list[RankRow]:
        """Rank, stage, replica, state, last heartbeat, host, pid."""
        return self.store.ranks()

    def notice(self) -> NoticeView | None:
        """The newest launch's preemption notice and how the job met it (None: it got none)."""
        return self.store.notice()

    def export_chrome_trace(self, path: str | Path, last_steps: int | None = None) -> Path:
        """Write a Chrome/Perfetto trace JSON of the recorded spans (with send -> recv arrows)."""
        from varuna._files import write_json_atomic

        path = Path(path)
        write_json_atomic(path, self.store.chrome_trace(last_steps))  # a reader never sees half a trace
        return path
