"""The agent's live host set: which hosts a job may use now, where that comes from, and when a change of
hosts is worth a morph.

    source                         HostSet                                   the agent
    ──────                         ───────                                   ─────────
    HostfileSource: a hostfile  →  available = what the source lists      →  shrink now when a host it
      the agent watches (edits       minus the hosts found dead (until         launched on is gone; grow
      and `varuna hosts` take        the source drops them: a host that        once a larger set has stayed
      effect)                        comes back is a new host)                 `settle_s` unchanged; one
    SlurmSource: the allocation                                                morph in flight, what changes
    any object with `read()`                                                   meanwhile waits for the next
    (a cloud's API)                                                            decision (coalesced)

A source says the whole set each time it is read (host -> slots), as a hostfile or an allocation does;
`None` means "cannot tell now" (a half-written file, scontrol down) and keeps the last set. The set a
launch was offered is compared with what is available now: a host gone or with fewer slots is a shrink
and acted on at once (its machine is going); more hosts or slots are a grow, acted on only after the set
has stayed the same for `settle_s` seconds (spot machines flap) and only when the planner's shape for
the new slot count differs from the running one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from varuna._files import write_atomic
from varuna._slurm import expand_hostlist, expand_tasks_per_node
from varuna.errors import ConfigError, check_number
from varuna.launch.hostfile import hostfile_hosts

__all__ = [
    "DEFAULT_SETTLE_S",
    "HostSource",
    "HostfileSource",
    "SlurmSource",
    "HostSet",
    "Change",
    "check_settle",
    "write_hostfile",
    "same_host",
    "watched_hostfile",
    "parse_host",
    "edit_hostfile",
]

DEFAULT_SETTLE_S = 30.0
"""How long a larger host set must stay unchanged before the job grows onto it."""


@runtime_checkable
class HostSource(Protocol):
    """Where the live host set comes from: `read()` gives host -> slots now, or None when it cannot tell."""

    def read(self) -> dict[str, int] | None: ...

    def describe(self) -> str: ...


def same_host(a: str, b: str) -> bool:
    """`node1` and `node1.cluster.local` are one host."""
    return a == b or a.split(".", 1)[0] == b.split(".", 1)[0]


class HostfileSource:
    """A hostfile the agent watches: every edit (by hand, by `varuna hosts`, by a cloud hook) takes
    effect at the next read. A file that cannot be parsed keeps the last set (None): an editor may have
    it half-written; a file with no host line is an empty set (every host taken away)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).absolute()

    def read(self) -> dict[str, int] | None:
        try:
            text = self.path.read_text()
        except OSError:
            return None
        if not any(line.split("#", 1)[0].strip() for line in text.splitlines()):
            return {}
        try:
            return hostfile_hosts(self.path)
        except ConfigError:
            return None

    def describe(self) -> str:
        return f"hostfile {self.path}"


class SlurmSource:
    """The nodes of the Slurm allocation `job_id` (default ``SLURM_JOB_ID``) as ``scontrol show job``
    says now (an allocation shrunk by ``scontrol update`` or a node failure shows here), with the
    allocation's tasks per node as slots."""

    def __init__(self, job_id: str | None = None) -> None:
        job_id = job_id or os.environ.get("SLURM_JOB_ID")
        if not job_id:
            raise ConfigError("host source 'slurm' needs a Slurm allocation (SLURM_JOB_ID is not set)")
        if shutil.which("scontrol") is None:
            raise ConfigError("host source 'slurm' needs scontrol on PATH (Slurm's client tools)")
        self.job_id = str(job_id)

    def read(self) -> dict[str, int] | None:
        try:
            out = subprocess.run(
                ["scontrol", "show", "job", "-o", self.job_id],
                capture_output=True,
                text=True,
                timeout=10,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return slurm_hosts(out.stdout) if out.returncode == 0 else None

    def describe(self) -> str:
        return f"Slurm allocation {self.job_id}"


def slurm_hosts(show_job: str) -> dict[str, int] | None:
    """Host -> slots from one line of ``scontrol show job -o``: its NodeList, and its tasks per node
    (``TasksPerNode`` / ``NtasksPerN:B:S:C`` when given, else ``NumTasks`` spread evenly), or None
    when the line names no nodes."""
    fields = dict(word.split("=", 1) for word in show_job.split() if "=" in word)
    nodes = fields.get("NodeList", "")
    if not nodes or nodes == "(null)":
        return None
    names = expand_hostlist(nodes)
    per = fields.get("TasksPerNode")
    if per:
        counts = expand_tasks_per_node(per)
    else:
        ntasks = fields.get("NtasksPerN:B:S:C", "0:0:*:*").split(":", 1)[0]
        each = int(ntasks) if ntasks.isdigit() and int(ntasks) > 0 else 0
        if not each:
            total = fields.get("NumTasks", "")
            each = max(1, int(total) // len(names)) if total.isdigit() else 1
        counts = [each] * len(names)
    if len(counts) != len(names):
        counts = [counts[0] if counts else 1] * len(names)
    return dict(zip(names, counts, strict=True))


def check_settle(value: object) -> float:
    """`settle_s` as a float >= 0, or a ConfigError that says what to give."""
    return check_number(
        value,
        "settle_s",
        inclusive=True,
        message=f"settle_s must be a number of seconds >= 0 (how long a new host must stay before the job "
        f"grows onto it), got {value!r}",
    )


def write_hostfile(path: Path, hosts: Mapping[str, int]) -> Path:
    """`hosts` as a hostfile (``host:slots`` lines), written atomically."""
    return write_atomic(Path(path), "".join(f"{h}:{n}\n" for h, n in hosts.items()).encode())


@dataclass(frozen=True, slots=True)
class Change:
    """A difference between the hosts a launch was offered and those available now."""

    kind: str
    """"shrink" (a host gone or with fewer slots: act now) or "grow" (more, settled)."""
    gone: tuple[str, ...]
    added: tuple[str, ...]
    available: dict[str, int]

    def describe(self) -> str:
        parts = []
        if self.gone:
            parts.append(f"{', '.join(self.gone)} gone")
        if self.added:
            parts.append(f"{', '.join(self.added)} added")
        slots = sum(self.available.values())
        return f"{self.kind}: {'; '.join(parts) or 'slots changed'} ({slots} slots now)"


class HostSet:
    """The live host set of one job: the source's hosts minus those found dead."""

    def __init__(self, source: HostSource, *, settle_s: float = DEFAULT_SETTLE_S) -> None:
        self.source = source
        self.settle_s = check_settle(settle_s)
        self.listed: dict[str, int] = {}
        """What the source said last."""
        self.dead: set[str] = set()
        """Hosts a launch lost; left out until the source stops listing them (a return is a new host)."""
        self.changed_at = time.monotonic()
        """When `available()` last changed (monotonic)."""
        self.poll()

    def poll(self, now: float | None = None) -> bool:
        """Read the source; True when the available set changed."""
        listed = self.source.read()
        if listed is None:
            return False
        before = self.available()
        self.dead = {h for h in self.dead if any(same_host(h, name) for name in listed)}
        self.listed = dict(listed)
        if self.available() != before:
            self.changed_at = time.monotonic() if now is None else now
            return True
        return False

    def mark_dead(self, hosts: Iterable[str]) -> None:
        before = self.available()
        self.dead |= set(hosts)
        if self.available() != before:
            self.changed_at = time.monotonic()

    def available(self) -> dict[str, int]:
        return {h: n for h, n in self.listed.items() if not any(same_host(h, d) for d in self.dead)}

    def settled(self, now: float | None = None) -> bool:
        """Whether the available set has stayed unchanged for `settle_s`."""
        return (time.monotonic() if now is None else now) - self.changed_at >= self.settle_s

    def gone(self, offered: Mapping[str, int]) -> tuple[str, ...]:
        """The hosts of `offered` that are not available now, or with fewer slots."""
        available = self.available()
        return tuple(h for h, n in offered.items() if available.get(h, 0) < n)

    def change(self, offered: Mapping[str, int], now: float | None = None) -> Change | None:
        """What differs between the hosts a launch was `offered` and those available now: a shrink at
        once, a grow once settled; None when nothing (yet) calls for a morph."""
        available = self.available()
        gone = self.gone(offered)
        added = tuple(h for h, n in available.items() if n > offered.get(h, 0))
        if gone:
            return Change("shrink", gone, added, available)
        if added and self.settled(now):
            return Change("grow", gone, added, available)
        return None


# `varuna hosts RUN_DIR add|remove|list`: the watched hostfile, edited from outside ---------------------
def watched_hostfile(run_dir: Path) -> Path:
    """The hostfile the agent of `run_dir` watches, or a ConfigError saying why there is none."""
    import json

    spec_path = Path(run_dir) / "agent" / "spec.json"
    try:
        spec = json.loads(spec_path.read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"{run_dir} has no agent (no readable {spec_path}); `varuna hosts` edits the hosts of a job started "
            "with `varuna run --elastic --watch-hosts --hostfile FILE` or JobController.start(watch_hosts='hostfile')"
        ) from None
    if spec.get("watch_hosts") == "slurm":
        raise ConfigError(
            f"the job in {run_dir} takes its hosts from the Slurm allocation: change the allocation "
            "(scontrol update) instead of `varuna hosts`"
        )
    if spec.get("watch_hosts") != "hostfile" or not spec.get("hostfile"):
        raise ConfigError(
            f"the job in {run_dir} does not watch its hosts (started without watch_hosts); relaunch it with "
            "`varuna run --elastic --watch-hosts --hostfile FILE` to add or remove hosts while it runs"
        )
    return Path(spec["hostfile"])


def parse_host(text: str, *, default_slots: int | None = 1) -> tuple[str, int | None]:
    """``HOST`` or ``HOST:SLOTS`` -> (host, slots); a ConfigError that shows the form."""
    name, sep, count = text.strip().rpartition(":") if ":" in text else (text.strip(), "", "")
    slots: int | None = default_slots
    if sep:
        slots = int(count) if count.isdigit() and int(count) >= 1 else None
        if slots is None:
            raise ConfigError(f"expected HOST or HOST:SLOTS with SLOTS a positive integer, got {text!r}")
    if not name or any(c.isspace() or c == "#" for c in name):
        raise ConfigError(f"expected HOST or HOST:SLOTS (a host name without spaces), got {text!r}")
    return name, slots


def edit_hostfile(
    path: Path, *, add: Mapping[str, int] | None = None, remove: Iterable[str] = ()
) -> dict[str, int]:
    """Add hosts (or change their slots) and remove hosts in the hostfile `path`, keeping its comments;
    written atomically under a lock (two `varuna hosts` at once both take effect). The hosts after."""
    import fcntl

    path = Path(path)
    remove = list(remove)
    with open(path.with_name(f".{path.name}.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        named = [_line_host(line) for line in lines]
        for host in remove:
            if not any(n and same_host(n, host) for n in named):
                listed = ", ".join(n for n in named if n) or "no host"
                raise ConfigError(f"{path} names {listed}; cannot remove {host!r}: give one of them")
        kept = [
            (line, n)
            for line, n in zip(lines, named, strict=True)
            if not (n and any(same_host(n, h) for h in remove))
        ]
        for host, slots in (add or {}).items():
            at = [i for i, (_, n) in enumerate(kept) if n and same_host(n, host)]
            if at:
                kept[at[0]] = (f"{host}:{slots}", host)
                kept = [item for i, item in enumerate(kept) if i not in at[1:]]
            else:
                kept.append((f"{host}:{slots}", host))
        write_atomic(path, "".join(line + "\n" for line, _ in kept).encode())
    return hostfile_hosts(path) if any(n for _, n in kept) else {}


def _line_host(line: str) -> str | None:
    words = line.split("#", 1)[0].split()
    return words[0].rpartition(":")[0] or words[0] if words else None
