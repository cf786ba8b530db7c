"""One morph protocol for every trigger: a signal, `varuna resize`, or the notebook controller.

    trigger                      every rank                                  the supervisor
    ───────                      ──────────                                  ──────────────
    SIGUSR1 / SIGTERM to any  →  StopRequest set; at the end of the step   → exit status MORPH_EXIT:
    worker, or a resize            the stop flag rides the per-step           read the oldest resize
    request (which signals         all-reduce, so all ranks agree; write      request (or keep the
    the workers)                   a checkpoint; exit with MORPH_EXIT         shape) and relaunch from
                                                                              checkpoints/latest

The user's script holds no signal handler: the engine installs one. This module imports no torch,
so the CLI and the controller can use it cheaply.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from varuna._files import write_json_atomic
from varuna.errors import ConfigError
from varuna.launch.exits import MORPH_EXIT

__all__ = [
    "MORPH_EXIT",
    "StopRequest",
    "request_resize",
    "take_resize",
    "live_workers",
]

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Set by a signal or a call; read by the engine at the end of every step."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def __bool__(self) -> bool:
        return self.reason is not None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def install(self) -> bool:
        """Handle SIGUSR1 and SIGTERM by setting the request (main thread only; else a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, _frame: self.set(signal.Signals(signum).name))
        return True


@dataclass(frozen=True, slots=True)
class Shape:
    pipeline: int
    data: int


def _requests(run_dir: Path) -> Path:
    return Path(run_dir) / "requests"


def live_workers(run_dir: Path) -> list[int]:
    """PIDs of this run's ranks that report themselves running (on this host), by rank."""
    from varuna.launch.postmortem import read_reports

    statuses, _ = read_reports(Path(run_dir))
    pids = []
    for _, status in sorted(statuses.items()):
        pid = status.get("pid")
        if status.get("state") == "running" and isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            pids.append(pid)
    return pids


def request_resize(run_dir: Path, *, pipeline: int, data: int, notify: bool = True) -> Path:
    """Queue a new shape for the job in `run_dir` and, with `notify`, ask its workers to morph now."""
    for name, value in (("pipeline", pipeline), ("data", data)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"resize needs a positive {name}, got {value!r}")
    run_dir = Path(run_dir)
    if notify and not (run_dir / "job.json").exists():
        raise ConfigError(f"{run_dir} is not a varuna run directory (it has no job.json)")
    folder = _requests(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = write_json_atomic(
        folder / f"resize-{time.time_ns()}.json", {"pipeline": pipeline, "data": data, "time": time.time()}
    )
    if notify:
        for pid in live_workers(run_dir)[:1]:  # one is enough: the stop flag is all-reduced
            os.kill(pid, signal.SIGUSR1)
    return path


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
