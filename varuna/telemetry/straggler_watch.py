"""The launcher's straggler watch: follow the ranks' event logs, flag stragglers on the console.

    ranks ── append ──> RUN_DIR/events/rank{r}.jsonl ──(tail, every 0.5 s)──> StragglerDetector
                                                      straggler events ──> RUN_DIR/events/stragglers.jsonl
                                                                     └──> one console line each

Every launch (``varuna run``, or the agent of a notebook's job) comes through `varuna.launch.job.Job`,
which runs one watch per launch; the ranks already write their logs to the run directory (which must be
on a file system every host shares), so the watch needs no socket, no controller and no change to the
ranks. The controller and a replay read ``stragglers.jsonl`` like any other event log.
``VARUNA_STRAGGLER=0`` turns the watch off; thresholds: `varuna.telemetry.stragglers.StragglerConfig`.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any, TextIO

from varuna.telemetry.events import EventLog
from varuna.telemetry.stragglers import StragglerConfig, StragglerDetector

__all__ = ["EventFollower", "StragglerWatch", "LOG", "describe", "watch_config"]

LOG = "events/stragglers.jsonl"
"""Where the watch records its events, relative to the run directory."""


def watch_config(environ: dict[str, str]) -> StragglerConfig | None:
    """The thresholds from ``environ`` (a ConfigError naming the variable when one is bad), or None
    when ``VARUNA_STRAGGLER=0`` turns the watch off."""
    if environ.get("VARUNA_STRAGGLER", "1").strip() == "0":
        return None
    return StragglerConfig.from_env(environ)


class EventFollower:
    """The events appended to ``RUN_DIR/events/rank*.jsonl`` since the last `poll`, of the given
    types only (other lines are skipped before parsing: a rank's spans are most of its log)."""

    def __init__(self, run_dir: Path, kinds: tuple[str, ...] = ("hello", "step_metrics")) -> None:
        self.folder = Path(run_dir) / "events"
        self._marks = [f'"type":"{k}"'.encode() for k in kinds]
        # logs are appended launch after launch: start from their current ends
        self._offsets = {p: p.stat().st_size for p in self.folder.glob("rank*.jsonl")}
        self._partial: dict[Path, bytes] = {}

    def poll(self) -> list[dict[str, Any]]:
        """New whole lines of every rank's log, parsed; a torn last line waits for the next poll."""
        out: list[dict[str, Any]] = []
        for path in sorted(self.folder.glob("rank*.jsonl")):
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
            lines = (self._partial.pop(path, b"") + chunk).split(b"\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                if any(mark in line for mark in self._marks):
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(event, dict):
                        out.append(event)
        return out


def describe(event: dict[str, Any]) -> str:
    """The console line of a ``straggler`` or ``straggler_gone`` event."""
    where = f"rank {event['rank']} (stage {event.get('stage')}, replica {event.get('replica')}) on host {event.get('host')}"
    if event["type"] == "straggler":
        steps = event.get("steps") or []
        span = f"steps {steps[0]}-{steps[-1]}" if steps else f"step {event.get('step')}"
        return (
            f"varuna: straggler: {where} computes {event.get('ratio')}x slower than its peers ({span}); "
            f"exclude its host: JobController.exclude_host({event.get('host')!r}) or resize without it"
        )
    return f"varuna: {where} is no longer a straggler (at {event.get('ratio')}x at step {event.get('step')})"


class StragglerWatch:
    """One launch's watch (a daemon thread); `stop` reads what is left and joins it."""

    def __init__(
        self,
        run_dir: Path,
        job_id: str,
        err: TextIO | io.TextIOBase,
        config: StragglerConfig,
        interval_s: float = 0.5,
    ) -> None:
        self.run_dir, self.err, self.interval_s = Path(run_dir), err, interval_s
        self.detector = StragglerDetector(config, job=job_id)
        self.follower = EventFollower(self.run_dir)
        self.found: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="varuna-stragglers")

    def start(self) -> StragglerWatch:
        """Start following."""
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> list[dict[str, Any]]:
        """Read new events once; the straggler events they settled (recorded and printed)."""
        found = self.detector.feed_all(self.follower.poll())
        if found:
            log = EventLog(self.run_dir / LOG)
            for event in found:
                log.write(event)
                print(describe(event), file=self.err, flush=True)
            log.close()
            self.found += found
        return found

    def stop(self) -> None:
        """Stop the thread, after one last read."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.tick()
