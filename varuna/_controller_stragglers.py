"""The controller's straggler controls: who is flagged, the per-rank compute grid, and "exclude
host and morph". Kept apart from `varuna.controller` (a mixin of `JobController`) so that file stays
about starting and steering a job.

    ctl.stragglers()          # [{"rank": 3, "host": "node7", "ratio": 1.9, "steps": [4, 5, 6], ...}]
    ctl.compute_grid()        # rank x step compute seconds, hosts: the workbench's heatmap
    ctl.exclude_host("node7") # relaunch without node7: a resize to the shape its other hosts fit

Detection runs in the launcher (`varuna.telemetry.straggler_watch`), which records its events in
``RUN_DIR/events/stragglers.jsonl``; this reads them into the controller's store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from varuna.errors import ConfigError
from varuna.launch.exclude import write_without
from varuna.launch.launches import FileTail
from varuna.telemetry.straggler_watch import LOG
from varuna.telemetry.stragglers import ComputeGrid, compute_grid

if TYPE_CHECKING:
    from varuna.launch.launches import LaunchView
    from varuna.telemetry.store import EventStore

__all__ = ["StragglerControl"]


class StragglerControl:
    """`stragglers`, `compute_grid` and `exclude_host` for `JobController`."""

    if TYPE_CHECKING:  # what the mixin uses of JobController
        run_dir: Path
        store: EventStore

        @property
        def job(self) -> LaunchView | None: ...
        def _running_launch(self, what: str) -> LaunchView: ...
        def _note(self, kind: str, **fields: Any) -> None: ...
        def resize(
            self, pipeline: int | None = None, data: int | None = None, *, gpus: int | None = None
        ) -> str: ...

    def _straggler_events(self) -> None:
        tail = self.__dict__.setdefault("_straggler_tail", FileTail(self.run_dir / LOG))
        for line in tail.lines():
            try:
                self.store.add(json.loads(line))
            except ValueError:
                continue

    def stragglers(self) -> list[dict[str, Any]]:
        """The ranks of the current launch flagged as stragglers now (their last ``straggler`` event:
        rank, host, stage, replica, ratio, steps), by rank; `varuna.telemetry.stragglers` says how."""
        self._straggler_events()
        job = self.job
        if job is None:
            return []
        flagged: dict[int, dict[str, Any]] = {}
        for event in self.store.events(job=job.job_id):
            if event["type"] == "straggler":
                flagged[event["rank"]] = event
            elif event["type"] == "straggler_gone":
                flagged.pop(event["rank"], None)
        return [flagged[r] for r in sorted(flagged)]

    def compute_grid(self, last_steps: int = 50) -> ComputeGrid:
        """Each rank's compute seconds for the last steps of the newest launch, with its host."""
        return compute_grid([*self.store.events("hello"), *self.store.step_events()], last_steps=last_steps)

    def exclude_host(self, host: str) -> str:
        """Relaunch the running job without `host`: its hostfile minus that host, in the shape
        `shape_for` gives the slots left (same global batch), through the morph protocol (checkpoint,
        stop, relaunch from the checkpoint). Noted as an ``exclude_host`` event; returns the state."""
        if not isinstance(host, str) or not host:
            raise ConfigError(f"exclude_host() takes a host name as in the hostfile, got {host!r}")
        self._running_launch("exclude_host")
        hostfile = json.loads((self.run_dir / "job.json").read_text()).get("hostfile")  # the running launch's
        if hostfile is None:
            raise ConfigError(
                "exclude_host(): this job was started without a hostfile, so it runs on this host only; "
                "start it with hostfile= to run on several hosts"
            )
        path, slots = write_without(self.run_dir, Path(hostfile), host)
        self._note("exclude_host", host=host, hostfile=str(path), slots=slots)
        return self.resize(gpus=slots)  # the shape `shape_for(slots)` gives, noted as "resize_plan"
