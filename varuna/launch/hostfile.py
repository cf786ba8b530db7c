"""An MPI hostfile, read once and checked before mpiexec sees it (which would fail with its own
message, or `varuna run --elastic` with a traceback).

    node1            one slot
    node2:4          four slots (MPICH)
    node3 slots=4    four slots (Open MPI)   # comments and blank lines are ignored
"""

from __future__ import annotations

from pathlib import Path

from varuna.errors import ConfigError

__all__ = ["hostfile_slots", "hostfile_hosts", "filled_hosts"]

_FORMS = "`host`, `host:N` or `host slots=N` with N a positive integer"


def _slots(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 1 else None


def hostfile_hosts(hostfile: Path) -> dict[str, int]:
    """Host name -> slots of an MPI hostfile, in file order (a host named twice adds up); a
    ConfigError naming the file and line when it cannot be read."""
    try:
        lines = Path(hostfile).read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(
            f"hostfile not found: {hostfile}; give --hostfile an existing file of {_FORMS} lines"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"hostfile {hostfile} cannot be read ({exc}): expected a text file of {_FORMS} lines"
        ) from None
    hosts: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "slots=" in line:
            after = line.split("slots=", 1)[1].split()
            name, count = line.split()[0], _slots(after[0] if after else "")
        elif ":" in line:
            name, _, text = line.rpartition(":")
            count = _slots(text)
        else:
            name, count = line.split()[0], 1
        if count is None or not name.strip():
            raise ConfigError(
                f"hostfile {hostfile} line {number}: expected {_FORMS}, got {raw.strip()!r}; fix that line"
            )
        hosts[name.strip()] = hosts.get(name.strip(), 0) + count
    if not hosts:
        raise ConfigError(f"hostfile {hostfile} names no host: expected lines of {_FORMS}")
    return hosts


def hostfile_slots(hostfile: Path) -> int:
    """Total slots of an MPI hostfile; a ConfigError naming the file and line when it cannot be read."""
    return sum(hostfile_hosts(hostfile).values())


def filled_hosts(hostfile: Path, ranks: int) -> dict[str, int]:
    """The hosts `ranks` ranks fill when mpiexec fills the slots in file order (every host when the
    ranks outnumber the slots), with their slots: the hosts of a job, in either placement.

        h1:2 h2:2 h3:2, 4 ranks  ->  {"h1": 2, "h2": 2}
    """
    filled: dict[str, int] = {}
    for host, slots in hostfile_hosts(hostfile).items():
        if sum(filled.values()) >= ranks:
            break
        filled[host] = slots
    return filled
