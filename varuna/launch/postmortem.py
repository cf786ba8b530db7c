"""After a job: which rank failed first and why, from the ranks' reports and what the launcher saw."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, TextIO

from varuna.comm.rendezvous import placement
from varuna.launch.pids import check_status
from varuna.launch.signals import STACKS_SIGNAL

__all__ = ["read_reports", "show_stacks", "summarise", "shown"]

# Hydra's "PID 123 RUNNING AT host / EXIT CODE: 9 ... (signal 9)": *a* rank that died of a signal,
# not necessarily the first (it often names one that it killed itself).
_DEATH = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)")
_PEER_LOST = re.compile(
    r"closed by peer|reset by peer|broken pipe|remote worker crash|remote process exited|communicator was aborted",
    re.IGNORECASE,
)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ranks(ranks: set[int] | list[int]) -> str:
    """``rank 2`` or ``ranks 0, 2``."""
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, sorted(ranks)))


def shown(path: Path) -> Path:
    """``path`` relative to the working directory when it lies inside it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def read_reports(
    run_dir: Path, job: str | None = None
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The ranks' own reports: status by rank, and failure records oldest first; with `job`, only
    those of that launch (a rank of an earlier launch, cut off on a lost host, may write late)."""

    def reports(kind: str) -> list[dict[str, Any]]:
        found = (_read_json(p) for p in run_dir.glob(f"{kind}/rank*.json"))
        return [r for r in found if r and "rank" in r and (job is None or r.get("job") in (None, job))]

    statuses = {s["rank"]: s for s in reports("status") if isinstance(s["rank"], int)}
    failures = reports("failures")
    return statuses, sorted(failures, key=lambda f: f.get("time", 0.0))


def summarise(
    run_dir: Path,
    pipeline: int,
    world: int,
    *,
    deaths: list[tuple[float, list[int]]],
    console: str,
    mpiexec_code: int,
    launcher: str = "mpiexec",
    job: str | None = None,
) -> list[str]:
    """Say which rank failed first and why, then who followed, from the run dir and what was seen.

    ``deaths`` are batches of ranks seen dying together (launcher's clock), ``console`` the tail of
    mpiexec's output. When one rank dies the process manager kills the rest, and gloo makes others
    raise "Connection closed by peer", so order matters: the earliest event is the cause. ``launcher``
    names the process manager (mpiexec, or srun in a Slurm allocation).
    """
    statuses, failures = read_reports(run_dir, job)
    died = {r for r, s in statuses.items() if s.get("state") == "running"}  # no clean end, no record

    def where(rank: int) -> tuple[str, str]:
        stage, replica = placement(rank, pipeline)
        log = run_dir / "logs" / f"rank{rank}.log"
        return f"rank {rank} (stage {stage}, replica {replica})", str(shown(log))

    def death(rank: int) -> str:
        who, log = where(rank)
        pid, host = statuses[rank].get("pid"), str(statuses[rank].get("host", "")).split(".")[0]
        for p, h, how in _DEATH.findall(console):
            if int(p) == pid and h.split(".")[0] == host and f"(signal {how})" in console:
                name = signal.Signals(int(how)).name if int(how) in signal.valid_signals() else "?"
                return f"varuna: {who} was killed by signal {how} ({name}) — log: {log}"
        try:
            fatal = re.findall(
                r"Fatal Python error: ([^\n]+)", Path(log).read_text(errors="replace")[-20000:]
            )
        except OSError:
            fatal = []
        if fatal:
            return f"varuna: {who} crashed: Fatal Python error: {fatal[-1]} — log: {log}"
        return (
            f"varuna: {who} died without a Python exception (killed, e.g. SIGKILL, or os._exit) — log: {log}"
        )

    # A peer's "connection closed" is what every survivor raises when one rank dies: never the cause.
    primary = [f for f in failures if not _PEER_LOST.search(str(f.get("message", "")))]
    secondary = [f for f in failures if f not in primary]
    ordered = sorted(deaths, key=lambda d: d[0])  # a death seen only afterwards has time 0: earliest
    first_dead = next(((t, sorted(set(b) & died)) for t, b in ordered if set(b) & died), None)
    lines: list[str] = []
    cause = ""
    # a death of unknown time (0: seen only afterwards) never outranks a rank's own exception
    if first_dead and (not primary or 0.0 < first_dead[0] < primary[0].get("time", 0.0)):
        lines += [death(r) for r in first_dead[1]]
        cause = _ranks(first_dead[1])
        died -= set(first_dead[1])
    for group in (primary, secondary):
        if group is secondary and secondary and died and not cause:
            # the survivors say a peer vanished, but we saw nobody die first (another host): name them all
            lines += [death(r) for r in sorted(died)]
            cause, died = _ranks(died), set()
        for f in group:
            who, log = where(f["rank"])
            message = (str(f.get("message", "")).strip().splitlines() or [""])[0]
            lead = f"also failed (after {cause})" if cause else "failed"
            message = message[:120] + "..." if cause and len(message) > 120 else message[:500]
            lines.append(f"varuna: {who} {lead}: {f.get('type')}: {message} — log: {log}")
            cause = cause or f"rank {f['rank']}"
    if died and cause:
        lines.append(f"varuna: {_ranks(died)} stopped by {launcher} after {cause}")
    elif died:
        lines += [death(r) for r in sorted(died)]
    if not lines and mpiexec_code != 0:
        missing = sorted(set(range(world)) - set(statuses))
        if missing:
            lines.append(f"varuna: {_ranks(missing)} never started (see the output above)")
        lines.append(f"varuna: {launcher} exited with code {mpiexec_code} — logs: {shown(run_dir / 'logs')}")
    return lines


def show_stacks(run_dir: Path, job: str, err: TextIO | io.TextIOBase) -> None:
    """Have each live rank of `job` on this host write its threads' Python stacks (where a hang
    waits) to its log, and print them to `err`, each line marked with its rank."""
    asked: dict[int, tuple[Path, int]] = {}
    for rank, status in sorted(read_reports(run_dir, job)[0].items()):
        verdict = check_status(status)
        log = run_dir / "logs" / f"rank{rank}.log"
        if not (verdict.live and verdict.pid and status.get("state") == "running" and log.exists()):
            continue
        size = log.stat().st_size
        try:
            os.kill(verdict.pid, STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        asked[rank] = (log, size)
    if not asked:
        return
    time.sleep(1.0)  # the ranks write them from their signal handlers
    print(f"varuna: the Python stacks of ranks {sorted(asked)} at the timeout:", file=err)
    for rank, (log, size) in asked.items():
        with open(log, "rb") as f:
            f.seek(size)
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            if line.strip():
                print(f"[rank {rank}] {line}", file=err)
    err.flush()
