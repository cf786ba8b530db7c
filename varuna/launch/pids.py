"""Which process a rank's status file names, and whether it is still that process.

A PID alone names nobody for long: once a rank dies its number goes back to the kernel, and a
status file left ``running`` by a killed job may point at an editor, a shell or another job's rank.
So ``status/rank{r}.json`` records the process's *identity*: host, pid, the boot id and the
process's start time (Linux: field 22 of ``/proc/PID/stat``, clock ticks since boot). A signal goes
to a rank only when all of them match here and now::

    status says running ──> host is this host? ──no──> remote: skipped (its host's launcher signals it)
                                 │yes
                            pid alive?  ────────no──> dead: the job was killed, the status is stale
                                 │yes
                    same boot, same start time? ─no──> reused: another process has the pid, stale
                                 │yes
                               live: safe to signal

Without ``/proc`` (not Linux) the start time cannot be read, and nothing found only through a status
file is signalled (``unverified``). This module imports nothing heavy: the CLI uses it.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "identity",
    "pid_alive",
    "terminate",
    "start_ticks",
    "boot_id",
    "Verdict",
    "check_status",
    "job_processes",
]

Kind = Literal["live", "dead", "reused", "remote", "unverified"]


def start_ticks(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) sits in parentheses and may hold spaces or ")": split after the last one
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])  # fields[0] is field 3 (the state), so field 22 is fields[19]
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): start times count from a boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """This process as a status file records it: host, pid, start time and boot id."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": start_ticks(pid), "boot_id": boot_id()}


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def terminate(pids: Callable[[], set[int]], grace_s: float, kill_wait_s: float = 1.0) -> set[int]:
    """SIGTERM the processes `pids()` names, SIGKILL those `pids()` names after `grace_s` (the set
    is asked again: a launcher's children may have appeared), wait up to `kill_wait_s` for them;
    returns the ones still alive."""
    left: set[int] = set()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        left = pids()
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait_s
        while left and time.monotonic() < end:
            time.sleep(0.05)
            left = {pid for pid in left if pid_alive(pid)}
    return left


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a status file's process is now; only ``live`` may be signalled."""

    kind: Kind
    pid: int | None
    reason: str

    @property
    def live(self) -> bool:
        """True when the recorded process is the one running under that pid on this host."""
        return self.kind == "live"


def check_status(status: dict[str, Any]) -> Verdict:
    """Whether the process a status file names is still that process, on this host.

    >>> check_status({**identity(), "rank": 0}).kind
    'live'
    """
    who = f"rank {status.get('rank', '?')}"
    pid, host = status.get("pid"), status.get("host")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return Verdict("dead", None, f"{who}'s status names no valid pid ({pid!r})")
    if host != socket.gethostname():
        return Verdict(
            "remote",
            pid,
            f"{who} runs on {host}, not on this host ({socket.gethostname()}): not checked here",
        )
    if not pid_alive(pid):
        return Verdict("dead", pid, f"{who}'s status says running but pid {pid} is gone: a stale status")
    recorded, now = status.get("start_ticks"), start_ticks(pid)
    if recorded is None or now is None:
        return Verdict(
            "unverified", pid, f"{who}'s pid {pid} cannot be matched to its start time here: not signalled"
        )
    if recorded != now or status.get("boot_id") != boot_id():
        return Verdict(
            "reused",
            pid,
            f"{who}'s status says running but pid {pid} is another process now (started at tick {now}, "
            f"the rank at {recorded}): a stale status",
        )
    return Verdict("live", pid, f"{who} is pid {pid}")


def _netns(entry: Path) -> str:
    try:
        return os.readlink(entry / "ns" / "net")
    except OSError:
        return ""


def job_processes(job_id: str) -> dict[int, list[str]]:
    """pid -> argv of every process on this host whose environment carries ``VARUNA_JOB_ID=job_id``
    (mpiexec, hydra's proxy, the ranks); empty without ``/proc``. Only processes of this network
    stack count: a machine's network namespaces (containers, the test suite's hosts) are other hosts,
    whose ranks their own launcher ends (mpiexec's teardown), never a signal from here."""
    tag, found = f"VARUNA_JOB_ID={job_id}".encode(), {}
    here = _netns(Path("/proc/self"))
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and tag in (entry / "environ").read_bytes().split(b"\0")
                and _netns(entry) == here
            ):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return found
