"""Excluding a host from a job: the hostfile of the next launch, minus that host.

`JobController.exclude_host` writes ``RUN_DIR/agent/hostfile`` (the job's hostfile without the
host) and queues a resize; the agent launches every later launch with that file when it exists
(`hostfile_for`), so the relaunch goes through the one morph protocol like any resize. The user's
own hostfile is never edited.
"""

from __future__ import annotations

from pathlib import Path

from varuna._files import write_atomic
from varuna.errors import ConfigError
from varuna.launch.hostfile import hostfile_slots

__all__ = ["EXCLUDED", "hostfile_for", "hostfile_hosts", "write_without"]

EXCLUDED = "agent/hostfile"
"""The run's own hostfile, relative to the run directory, once a host was excluded."""


def hostfile_for(run_dir: Path, spec_hostfile: str | Path | None) -> Path | None:
    """The hostfile the next launch uses: the run's own (after an exclusion), else the job's."""
    own = Path(run_dir) / EXCLUDED
    if own.is_file():
        return own
    return Path(spec_hostfile) if spec_hostfile else None


def _host(line: str) -> str:
    word = line.split("#", 1)[0].strip().split()[0] if line.split("#", 1)[0].strip() else ""
    return word.split(":", 1)[0]


def hostfile_hosts(hostfile: Path) -> list[str]:
    """The host names of a hostfile, in order."""
    return [h for h in map(_host, Path(hostfile).read_text().splitlines()) if h]


def _same(a: str, b: str) -> bool:
    return a == b or a.split(".", 1)[0] == b.split(".", 1)[0]  # node1 vs node1.cluster.local


def write_without(run_dir: Path, hostfile: Path, host: str) -> tuple[Path, int]:
    """Write ``RUN_DIR/agent/hostfile``: `hostfile` without the lines of `host`; it and its slots."""
    hostfile_slots(hostfile)  # a ConfigError naming the bad line first
    named = hostfile_hosts(hostfile)
    if not any(_same(h, host) for h in named):
        raise ConfigError(
            f"exclude_host({host!r}): the job's hostfile {hostfile} names {', '.join(named)}; give one of them"
        )
    kept = [line for line in Path(hostfile).read_text().splitlines() if not _same(_host(line), host)]
    if not any(_host(line) for line in kept):
        raise ConfigError(
            f"exclude_host({host!r}): no host would be left ({hostfile} names only {host}); add hosts to it first"
        )
    path = write_atomic(Path(run_dir) / EXCLUDED, ("\n".join(kept) + "\n").encode())
    return path, hostfile_slots(path)
