"""What the controller keeps about each launch of a job, and the post-mortem of one that ended.

A launch is one `varuna.launch.job.Job` (a job is relaunched after a morph or a resume). When it ends,
the ranks' own reports (status/ and failures/, written by varuna.launch.worker) say how each rank ended;
the launcher's summary names the rank that died first.
"""

from __future__ import annotations

import io
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from varuna.launch.exits import MORPH_EXIT
from varuna.launch.job import Job, read_reports

__all__ = ["DeadRank", "ConsoleTail", "FileTail", "Launch", "LaunchView", "post_mortem"]


@dataclass(slots=True)
class DeadRank:
    """A rank that ended badly: how ("killed", "exception", "never started"), its exit code, its log."""

    rank: int
    stage: int | None
    replica: int | None
    how: str
    exit_code: int | None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    log: str | None = None
    first: bool = False
    """True for the rank the launcher names as the first to fail."""


class ConsoleTail(io.TextIOBase):
    """A text sink keeping the last lines of the launcher's console output (the ranks' prefixed lines)."""

    def __init__(self, lines: int = 2000) -> None:
        super().__init__()
        self.lines: deque[str] = deque(maxlen=lines)
        self._partial = ""

    def write(self, text: str) -> int:
        """Keep complete lines; hold a partial last line until its newline."""
        parts = (self._partial + text).split("\n")
        self._partial = parts.pop()
        self.lines.extend(parts)
        return len(text)

    def writable(self) -> bool:
        """Always: this is an output stream."""
        return True


@dataclass(slots=True)
class Launch:
    """One launch: its Job, world size, exit code once over, and the ranks that died."""

    job: Job
    world: int
    code: int | None = None
    dead: list[DeadRank] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class LaunchView:
    """One launch of the job as its agent reports it (one object per launch, updated in place)."""

    job_id: str
    pipeline: int
    data: int
    world: int
    code: int | None = None
    """The launch's exit code, None while it runs."""
    summary: list[str] = field(default_factory=list)
    dead: list[DeadRank] = field(default_factory=list)


class FileTail:
    """New complete lines of a growing file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        self.offset += len(chunk)
        parts = (self.partial + chunk).split(b"\n")
        self.partial = parts.pop()
        return [p.decode("utf-8", "replace") for p in parts]


def post_mortem(run_dir: Path, launch: Launch) -> list[dict[str, Any]]:
    """Fill `launch.dead` from the run directory; return one `exit` record per rank."""
    statuses, failures = read_reports(run_dir, launch.job.job_id)
    summary = launch.job.summary
    first = re.search(r"rank (\d+) \(stage", summary[0]) if summary else None
    failed = {int(f["rank"]): f for f in failures}
    exits = []
    for rank in range(launch.world):
        status = statuses.get(rank, {})
        state = status.get("state")
        code = {"done": 0, "morph": MORPH_EXIT}.get(str(state), status.get("code"))
        how = (
            "killed"
            if state == "running"
            else "exception"
            if rank in failed
            else str(state or "never started")
        )
        stage, replica = status.get("stage"), status.get("replica")
        exits.append({"rank": rank, "stage": stage, "replica": replica, "code": code, "state": how})
        if how in ("killed", "exception", "never started") and launch.code not in (0, MORPH_EXIT):
            f = failed.get(rank, {})
            launch.dead.append(
                DeadRank(
                    rank=rank,
                    stage=stage,
                    replica=replica,
                    how=how,
                    exit_code=code,
                    error_type=f.get("type"),
                    message=f.get("message"),
                    traceback=f.get("traceback"),
                    log=str(run_dir / "logs" / f"rank{rank}.log"),
                    first=first is not None and int(first.group(1)) == rank,
                )
            )
    return exits
