"""Stragglers: a rank persistently slower than the ranks doing the same work, flagged by host.

Pure: fed the ranks' own events (``hello`` for rank -> host, ``step_metrics`` for each rank's
``compute_s``), it returns the ``straggler`` / ``straggler_gone`` events to record. Whoever feeds it
(the launcher's watcher, a notebook replaying a run) decides where those go.

Which time is fair to compare? ``compute_s`` (forward, backward, recompute: no waiting, no
communication), so a fast rank that waits for a slow peer does not look slow itself. Ranks of one
stage do the same work in every replica, so each is compared with the median of its peers::

    step 7   stage 0: rank 0 0.10 s  rank 2 0.21 s   -> rank 2 at 2.1x the median of its peers
             stage 1: rank 1 0.12 s  rank 3 0.12 s

With one replica (D = 1) a stage has no peers; each rank's step is then set against the median of
its own recent steps (those not judged slow), and that relative time against the other stages'
(their median): a stage that slows down mid-run is caught, a machine that slows down as a whole
(every stage at once) is not a straggler, nor is a single rank, nor a stage slow from its first step
(nothing to compare it with; the planner's cost table is).

A rank at ``>= ratio`` x its baseline for ``steps`` consecutive steps is flagged (one ``straggler``
event), and recovered after ``steps`` consecutive steps below (one ``straggler_gone``). The first
``skip_steps`` steps of a launch warm up (allocator, caches) and are not judged. Settings come from
`StragglerConfig` (or the environment: `StragglerConfig.from_env`).
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from varuna.errors import ConfigError, check_int, check_number

__all__ = ["StragglerConfig", "StragglerDetector", "ComputeGrid", "compute_grid", "ENV"]

ENV = {
    "ratio": "VARUNA_STRAGGLER_RATIO",
    "steps": "VARUNA_STRAGGLER_STEPS",
    "skip_steps": "VARUNA_STRAGGLER_SKIP_STEPS",
}
"""The environment variables `StragglerConfig.from_env` reads, by field."""


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """When a rank counts as a straggler.

    >>> StragglerConfig(ratio=1.5, steps=2).steps
    2
    """

    ratio: float = 1.3
    """Slow means ``compute_s >= ratio x`` the baseline (peers' median, or the rank's own history)."""
    steps: int = 3
    """Consecutive slow steps to flag a rank (and consecutive normal ones to clear it); 1 to 5."""
    skip_steps: int = 1
    """Steps at the start of each launch that are not judged (warm-up)."""
    history: int = 20
    """With one replica: how many of a rank's recent normal steps make its baseline."""
    min_history: int = 2
    """With one replica: normal steps needed before a rank is judged at all."""

    def __post_init__(self) -> None:
        check_number(
            self.ratio,
            "ratio",
            above=1.0,
            message=f"straggler ratio must be a number > 1 (e.g. 1.3: 30% slower than its peers), got "
            f"{self.ratio!r}; set {ENV['ratio']} or StragglerConfig(ratio=...)",
        )
        for name, low, high in (
            ("steps", 1, 5),
            ("skip_steps", 0, 1000),
            ("history", 1, 10_000),
            ("min_history", 1, 10_000),
        ):
            value = getattr(self, name)
            where = f"set {ENV[name]} or " if name in ENV else ""
            check_int(
                value,
                name,
                minimum=low,
                maximum=high,
                message=f"straggler {name} must be an integer from {low} to {high}, got {value!r}; "
                f"{where}StragglerConfig({name}=...)",
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> StragglerConfig:
        """The defaults, overridden by ``VARUNA_STRAGGLER_RATIO`` / ``_STEPS`` / ``_SKIP_STEPS``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, var in ENV.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                values[name] = float(raw) if name == "ratio" else int(raw)
            except ValueError:
                raise ConfigError(
                    f"{var} must be a {'number' if name == 'ratio' else 'whole number'}, got {raw!r}; "
                    "fix or unset it"
                ) from None
        return cls(**values)


@dataclass(slots=True)
class _Rank:
    host: str | None = None
    stage: int | None = None
    replica: int | None = None
    slow: list[tuple[int, float]] = field(default_factory=list)  # the current run of slow steps
    normal: int = 0  # consecutive normal steps (while flagged)
    history: deque[float] = field(default_factory=deque)
    flagged: dict[str, Any] | None = None


class StragglerDetector:
    """Judges each step once every rank of the launch reported it; see the module docstring.

    >>> det = StragglerDetector(StragglerConfig(steps=2, skip_steps=0))
    >>> for r, host in enumerate(["h1", "h2"]):
    ...     _ = det.feed({"type": "hello", "rank": r, "host": host, "world": 2})
    >>> out = []
    >>> for step in range(3):
    ...     for r, t in enumerate([0.1, 0.2]):
    ...         out += det.feed({"type": "step_metrics", "rank": r, "stage": 0, "replica": r,
    ...                          "step": step, "compute_s": t})
    >>> [(e["type"], e["rank"], e["host"], e["ratio"], e["steps"]) for e in out]
    [('straggler', 1, 'h2', 2.0, [0, 1])]
    """

    def __init__(self, config: StragglerConfig | None = None, *, job: str | None = None) -> None:
        self.config = config or StragglerConfig()
        self.job = job
        """Only events of this launch (``job`` field) are taken, when set."""
        self.world: int | None = None
        self._ranks: dict[int, _Rank] = defaultdict(_Rank)
        self._pending: dict[int, dict[int, tuple[int, float]]] = defaultdict(dict)
        self._first: int | None = None
        self._judged = -1

    @property
    def flagged(self) -> list[dict[str, Any]]:
        """The ``straggler`` events of the ranks flagged now, by rank."""
        return [r.flagged for _, r in sorted(self._ranks.items()) if r.flagged is not None]

    def feed_all(self, events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """`feed` each event in turn; every event produced."""
        return [out for event in events for out in self.feed(event)]

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one event; the ``straggler`` / ``straggler_gone`` events it settles (often none)."""
        kind, rank = event.get("type"), event.get("rank")
        if not isinstance(rank, int) or (self.job is not None and event.get("job") != self.job):
            return []
        if kind == "hello":
            row = self._ranks[rank]
            row.host, row.stage, row.replica = event.get("host"), event.get("stage"), event.get("replica")
            if isinstance(event.get("world"), int):
                self.world = event["world"]
            return []
        if kind != "step_metrics" or not isinstance(event.get("step"), int):
            return []
        step, compute = event["step"], event.get("compute_s")
        if not isinstance(compute, (int, float)) or step <= self._judged:
            return []
        row = self._ranks[rank]
        row.stage = event.get("stage", row.stage)
        row.replica = event.get("replica", row.replica)
        self._first = step if self._first is None else min(self._first, step)
        self._pending[step][rank] = (int(event.get("stage") or 0), float(compute))
        out: list[dict[str, Any]] = []
        world = self.world or len(self._ranks)
        for ready in sorted(s for s, by_rank in self._pending.items() if len(by_rank) >= world):
            for stale in [s for s in self._pending if s < ready]:
                del self._pending[stale]  # a step some rank never reported (lost line): skipped
            out += self._judge(ready, self._pending.pop(ready), event)
        return out

    def _judge(
        self, step: int, by_rank: dict[int, tuple[int, float]], last: dict[str, Any]
    ) -> list[dict[str, Any]]:
        self._judged = step
        if self._first is not None and step < self._first + self.config.skip_steps:
            return []
        by_stage: dict[int, dict[int, float]] = defaultdict(dict)
        for rank, (stage, compute) in by_rank.items():
            by_stage[stage][rank] = compute
        ratios: dict[int, float] = {}
        alone: dict[int, float] = {}  # ranks without peers: this step against their own history
        for rank, (stage, compute) in sorted(by_rank.items()):
            peers = [t for r, t in by_stage[stage].items() if r != rank]
            row = self._ranks[rank]
            if peers:
                ratios[rank] = compute / base if (base := statistics.median(peers)) > 0 else 1.0
            elif len(row.history) >= self.config.min_history:
                alone[rank] = compute / base if (base := statistics.median(row.history)) > 0 else 1.0
            else:
                self._remember(row, compute)
        for rank, own in alone.items():  # a slowdown of the whole machine or job is no one's straggling
            others = [v for r, v in alone.items() if r != rank]
            if others:
                ratios[rank] = own / statistics.median(others)
            else:
                self._remember(self._ranks[rank], by_rank[rank][1])
        out = []
        for rank, ratio in sorted(ratios.items()):
            row, compute = self._ranks[rank], by_rank[rank][1]
            if ratio >= self.config.ratio:
                row.slow.append((step, ratio))
                row.normal = 0
            else:
                row.slow = []
                row.normal += 1
                self._remember(row, compute)
            if row.flagged is None and len(row.slow) >= self.config.steps:
                row.flagged = self._event("straggler", rank, row, step, last, row.slow[-self.config.steps :])
                out.append(row.flagged)
            elif row.flagged is not None and row.normal >= self.config.steps:
                out.append(
                    self._event("straggler_gone", rank, row, step, last, []) | {"ratio": round(ratio, 3)}
                )
                row.flagged = None
        return out

    def _remember(self, row: _Rank, compute: float) -> None:
        row.history.append(compute)
        while len(row.history) > self.config.history:
            row.history.popleft()

    def _event(
        self, kind: str, rank: int, row: _Rank, step: int, last: dict[str, Any], slow: list[tuple[int, float]]
    ) -> dict[str, Any]:
        ratios = [r for _, r in slow]
        return {
            "type": kind,
            "rank": rank,
            "host": row.host,
            "stage": row.stage,
            "replica": row.replica,
            "step": step,
            "ratio": round(statistics.median(ratios), 3) if ratios else None,
            "steps": [s for s, _ in slow],
            "threshold": self.config.ratio,
            "job": last.get("job"),
            "launch": last.get("launch"),
            "time": time.time(),
            "id": uuid.uuid4().hex,
        }


@dataclass(slots=True)
class ComputeGrid:
    """Per-rank compute seconds per step (``values[i][j]``: rank ``ranks[i]`` at step ``steps[j]``,
    None where the rank did not report it), with each rank's host, for a heatmap."""

    steps: list[int]
    ranks: list[int]
    hosts: dict[int, str | None]
    values: list[list[float | None]]


def compute_grid(
    events: Iterable[dict[str, Any]], *, job: str | None = None, last_steps: int = 200
) -> ComputeGrid:
    """The `ComputeGrid` of the newest launch among ``events`` (or of launch ``job``), its last steps."""
    events = list(events)
    if job is None:
        stamped = [e for e in events if e.get("type") == "step_metrics" and e.get("job")]
        job = max(stamped, key=lambda e: float(e.get("time", 0.0)))["job"] if stamped else None
    hosts: dict[int, str | None] = {}
    cells: dict[tuple[int, int], float] = {}
    for e in events:
        if e.get("job") != job or not isinstance(e.get("rank"), int):
            continue
        if e.get("type") == "hello":
            hosts[e["rank"]] = e.get("host")
        elif e.get("type") == "step_metrics" and isinstance(e.get("step"), int):
            cells[(e["rank"], e["step"])] = float(e.get("compute_s") or 0.0)
    steps = sorted({s for _, s in cells})[-last_steps:] if last_steps > 0 else []
    ranks = sorted({r for r, _ in cells} | set(hosts))
    return ComputeGrid(
        steps, ranks, {r: hosts.get(r) for r in ranks}, [[cells.get((r, s)) for s in steps] for r in ranks]
    )
