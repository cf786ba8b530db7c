"""One morph protocol for every trigger: a signal, `varuna resize`, the notebook controller, the agent's
live host set, a preemption notice.

    trigger                      every rank                                  the supervisor
    ───────                      ──────────                                  ──────────────
    SIGUSR1 / SIGTERM to any  →  StopRequest set; at the end of the step   → exit status MORPH_EXIT:
    worker, a resize request       the stop flag rides the per-step           read the oldest resize
    (which signals the             all-reduce, so all ranks agree; write      request (or the shape for
    workers), a stop file          a checkpoint; exit with MORPH_EXIT         the live host set, or keep
    (`varuna.launch.notices`:                                                 the shape) and relaunch
    the agent, `varuna notice`)  with a deadline (a notice): the same,        from checkpoints/latest
                                   after the last step that leaves time for
                                   a checkpoint before it (`varuna.engine.notice`)

The user's script holds no signal handler: the engine installs one. Before the engine exists the
worker holds one for SIGUSR1 (`varuna.launch.signals.remember_early_stops`), so a `varuna resize` that lands while the
script still imports or loads data is kept and honoured at the end of the engine's first step, rather
than killing the rank (SIGUSR1's default). SIGTERM keeps its default until then: a job stopped
during start-up stops at once. Only a process whose status file matches it on this host (pid, start
time, boot: `varuna.launch.pids`) is ever signalled. This module imports no torch, so the CLI and the
controller can use it cheaply.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from varuna._files import write_json_atomic
from varuna.errors import ConfigError, check_int
from varuna.launch.exits import MORPH_EXIT
from varuna.launch.pids import Verdict, check_status
from varuna.launch.signals import StopRequest, remember_early_stops

__all__ = [
    "MORPH_EXIT",
    "StopRequest",
    "request_resize",
    "take_resize",
    "live_workers",
    "worker_verdicts",
    "remember_early_stops",
]


@dataclass(frozen=True, slots=True)
class Shape:
    pipeline: int
    data: int


def _requests(run_dir: Path) -> Path:
    return Path(run_dir) / "requests"


def worker_verdicts(run_dir: Path) -> list[Verdict]:
    """For each rank whose status says running (by rank): is it still that process, on this host?"""
    from varuna.launch.postmortem import read_reports

    statuses, _ = read_reports(Path(run_dir))
    return [check_status(s) for _, s in sorted(statuses.items()) if s.get("state") == "running"]


def live_workers(run_dir: Path) -> list[int]:
    """PIDs of this run's running ranks on this host that are still the processes their status names."""
    return [v.pid for v in worker_verdicts(run_dir) if v.live and v.pid is not None]


def request_resize(run_dir: Path, *, pipeline: int, data: int, notify: bool = True) -> Path:
    """Queue a new shape for the job in `run_dir` and, with `notify`, ask its workers to morph now."""
    for name, value in (("pipeline", pipeline), ("data", data)):
        check_int(value, name, message=f"resize needs a positive integer {name}, got {value!r}")
    run_dir = Path(run_dir)
    if notify and not (run_dir / "job.json").exists():
        raise ConfigError(f"{run_dir} is not a varuna run directory (it has no job.json)")
    folder = _requests(run_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = write_json_atomic(
            folder / f"resize-{time.time_ns()}.json",
            {"pipeline": pipeline, "data": data, "time": time.time()},
        )
    except OSError as exc:
        raise ConfigError(
            f"cannot queue the resize in {folder} ({exc.strerror or exc}): run it as the job's owner"
        ) from None
    if notify:
        _signal_one(run_dir)
    return path


def _signal_one(run_dir: Path) -> int | None:
    """SIGUSR1 to one verified live rank of the job (one is enough: the stop flag is all-reduced).

    Every status that cannot be signalled (stale, remote, unverifiable) is reported on stderr, never
    signalled; returns the pid signalled, or None.
    """
    verdicts = worker_verdicts(run_dir)
    for verdict in verdicts:
        if not verdict.live:
            print(f"varuna: {verdict.reason}", file=sys.stderr)
    for pid in (v.pid for v in verdicts if v.live and v.pid is not None):
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # it ended between the check and the signal: try the next
            continue
        return pid
    print(
        f"varuna: no running rank of {run_dir} on this host to signal; the request waits for the next launch",
        file=sys.stderr,
    )
    return None


def take_resize(run_dir: Path) -> Shape | None:
    """The oldest queued resize request, removed from the queue (None if there is none)."""
    folder = _requests(Path(run_dir))
    pending = sorted(folder.glob("resize-*.json")) if folder.is_dir() else []
    if not pending:
        return None
    request = json.loads(pending[0].read_text())
    done = folder / "applied"
    done.mkdir(exist_ok=True)
    pending[0].replace(done / pending[0].name)
    return Shape(int(request["pipeline"]), int(request["data"]))
