"""Stop requests and preemption notices as files in the run directory, for every trigger that is not a
signal: the agent growing or shrinking the job, `varuna notice`, a cloud's preemption API.

    agent / `varuna notice` ──> RUN_DIR/requests/stop-<ns>.json ──> rank 0, at the end of every step
                                {"job", "reason", "deadline",        (`StopFiles.new`): the stop flag of
                                 "hosts", "time"}                     the per-step all-reduce, now or in
                                                                      time to checkpoint before "deadline"

The run directory is on the file system every rank shares (checkpoints are written there), so a file
reaches a job on any host without ssh or a signal crossing hosts. A request names the launch it is for
(``job``, the ``VARUNA_JOB_ID`` of its ranks; None: whichever launch runs) so that one written for a
launch that has ended never stops the next. ``deadline`` (seconds since the epoch, None: at the end of
this step) is when the named ``hosts`` (None: all of them) go away; the engine trains on while one more
step and a checkpoint still fit before it. This module imports no torch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from varuna._files import write_json_atomic
from varuna.errors import ConfigError, check_duration

__all__ = ["REQUESTS", "post_stop", "stop_requests", "StopFiles", "parse_duration", "launch_info"]

REQUESTS = "requests"
_PATTERN = "stop-*.json"


def parse_duration(text: str | float, *, what: str = "--deadline") -> float:
    """Seconds of a duration: a number of seconds (90, "90") or with a unit ("90s", "2min", "1h"),
    as ``varuna notice --deadline`` and ``VARUNA_NOTICE_S`` take it; a ConfigError naming `what`
    for anything else (a negative or unknown unit)."""
    return check_duration(
        text,
        message=f"{what} {text!r} is not a duration: give seconds (90), or a number with a unit: 90s, 2min, 1h",
    )


def launch_info(run_dir: Path) -> dict[str, Any] | None:
    """The launch record of `run_dir` (``job.json``: job_id, start, and end once it ended), or None
    when there is none or it cannot be read."""
    try:
        info = json.loads((Path(run_dir) / "job.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def post_stop(
    run_dir: Path,
    *,
    reason: str,
    job: str | None = None,
    deadline: float | None = None,
    hosts: list[str] | None = None,
) -> Path:
    """Ask the ranks of launch `job` (None: the one running) to checkpoint and exit with the morph
    status, at the end of this step or, with a `deadline` (epoch seconds), while a step and a checkpoint
    still fit before it; `hosts` are the hosts the notice is about (they leave at the deadline)."""
    if deadline is not None and not isinstance(deadline, (int, float)):
        raise ConfigError(f"a notice's deadline is seconds since the epoch (a number), got {deadline!r}")
    folder = Path(run_dir) / REQUESTS
    request = {
        "job": job,
        "reason": str(reason),
        "deadline": None if deadline is None else float(deadline),
        "hosts": None if hosts is None else sorted(str(h) for h in hosts),
        "time": time.time(),
    }
    try:
        return write_json_atomic(folder / f"stop-{time.time_ns()}.json", request)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the stop request in {folder} ({exc.strerror or exc}): run it as the job's owner"
        ) from None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        request = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # removed meanwhile, or not ours
    return request if isinstance(request, dict) and "reason" in request else None


def stop_requests(run_dir: Path, job: str | None) -> list[dict[str, Any]]:
    """Every stop request for launch `job` (and those for whichever launch runs), oldest first."""
    folder = Path(run_dir) / REQUESTS
    found = []
    for path in sorted(folder.glob(_PATTERN)) if folder.is_dir() else []:
        request = _read(path)
        if request is not None and request.get("job") in (None, job):
            found.append({**request, "path": str(path)})
    return found


class StopFiles:
    """Rank 0's reader of the stop requests of its launch: each request once, by `new()`.

    A request written before this launch started and naming no launch is left alone: it was for an
    earlier one (the agent removes what it consumed; a crash may leave one behind)."""

    def __init__(self, run_dir: Path, job: str | None, *, since: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.job = job
        self.since = time.time() if since is None else since
        self._seen: set[str] = set()

    def new(self) -> list[dict[str, Any]]:
        """The requests for this launch that arrived since the last call, oldest first (a file is
        read once: one directory listing per call once every file was seen)."""
        folder = self.run_dir / REQUESTS
        try:
            names = sorted(p.name for p in folder.iterdir() if p.match(_PATTERN))
        except OSError:  # no requests folder (yet)
            return []
        fresh = []
        for name in names:
            if name in self._seen:
                continue
            self._seen.add(name)  # written by rename: a listed file is whole (or not a request)
            request = _read(folder / name)
            if request is None:
                continue
            if request.get("job") not in (None, self.job):
                continue
            if request.get("job") is None and float(request.get("time") or 0.0) < self.since:
                continue
            fresh.append({**request, "path": str(folder / name)})
        return fresh
