"""Jobs across hosts: where the controller listens, which host died, and the hosts left after it.

    hostfile h2:2 h3:2  ──> controller_interface ──> 10.0.0.1 (the address routing to h2), not 127.0.0.1
    ranks' heartbeats   ──> dead_hosts            ──> ["h3"]  every rank on h3 silent >= dead_after_s
    agent               ──> hostfile_without      ──> RUN_DIR/agent/hosts-2: h2:2   relaunch there

A one-host job keeps the controller on loopback. Once the hostfile names another host the ranks
there must reach the controller's sockets, so it binds the local address the kernel would route
toward the first remote host (`varuna.comm.addresses.outbound_ip`; ``VARUNA_MASTER_ADDR`` overrides).
Messages stay signed with the job's key either way.

A host is taken for dead when every rank of the running launch on it has been silent (no heartbeat,
no event; `varuna.telemetry.heartbeat`) for ``dead_after_s`` seconds while another host's ranks still
speak, or when it no longer answers at all after the launch failed: ranks killed, host powered
off, link down all look the same from the controller. Only jobs on two hosts or more are watched:
a one-host job that goes silent has nobody left to relaunch on.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from varuna._files import write_json_atomic
from varuna.comm.addresses import interface_addresses, outbound_ip
from varuna.errors import ConfigError, check_number
from varuna.launch.hostfile import hostfile_hosts

__all__ = [
    "LOOPBACK",
    "DEFAULT_DEAD_AFTER_S",
    "remote_hosts",
    "controller_interface",
    "dead_hosts",
    "hostfile_without",
    "check_dead_after",
    "HostWatch",
    "host_down",
    "lost_in_console",
]

LOOPBACK = "127.0.0.1"
DEFAULT_DEAD_AFTER_S = 5.0
"""Heartbeats come every second: five missed in a row from every rank of a host is a dead host."""


def _is_local(name: str) -> bool:
    """Whether `name` is this host: its own name, localhost, or an address held or looped back here."""
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return False  # mpiexec will say it cannot resolve it; not ours to decide
    try:
        if ipaddress.ip_address(address).is_loopback:
            return True
    except ValueError:
        return False
    return address in interface_addresses().values()


def remote_hosts(names: Iterable[str]) -> list[str]:
    """The names in `names` (in order, once each) that are other hosts than this one."""
    return [name for name in dict.fromkeys(names) if not _is_local(name)]


def controller_interface(hostfile: Path | None) -> str:
    """The address the controller binds for a job on `hostfile`: loopback when every host of the
    hostfile is this one (or there is none), else the address that routes toward its first remote host."""
    if hostfile is None:
        return LOOPBACK
    others = remote_hosts(hostfile_hosts(hostfile))
    return outbound_ip(others) if others else LOOPBACK


def check_dead_after(value: object) -> float:
    """``dead_after_s`` as a float, or a ConfigError that says what to give."""
    return check_number(
        value,
        "dead_after_s",
        message=f"dead_after_s must be a number of seconds > 0 (a host whose ranks are all silent that long "
        f"is taken for dead), got {value!r}",
    )


def dead_hosts(placement: Mapping[int, str], silent_s: Mapping[int, float], dead_after_s: float) -> list[str]:
    """Hosts all of whose ranks have been silent for `dead_after_s` seconds or more, while some
    other host's rank was heard from more recently (else the controller itself may be cut off).

    `placement` is rank -> host of the running launch, `silent_s` rank -> seconds since last heard
    (ranks never heard from are left out: they may still be starting).

    >>> dead_hosts({0: "h2", 1: "h2", 2: "h3", 3: "h3"}, {0: 0.4, 1: 0.9, 2: 6.0, 3: 5.5}, 5.0)
    ['h3']
    """
    by_host: dict[str, list[float]] = {}
    for rank, host in placement.items():
        by_host.setdefault(host, []).append(silent_s.get(rank, 0.0))
    if len(by_host) < 2:
        return []
    quiet = [h for h, waits in by_host.items() if min(waits) >= dead_after_s]
    return quiet if len(quiet) < len(by_host) else []


def hostfile_without(hostfile: Path, lost: Iterable[str], folder: Path) -> Path:
    """A copy of `hostfile` without the hosts in `lost`, written to `folder` (``hosts-N``, N = the
    slots left), with a JSON note of what was dropped; a ConfigError when no host is left."""
    gone = set(lost)
    left = {h: n for h, n in hostfile_hosts(hostfile).items() if h not in gone}
    if not left:
        raise ConfigError(
            f"no host of {hostfile} is left after losing {', '.join(sorted(gone))}: add hosts to the "
            "hostfile (or bring them back) and resume()"
        )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"hosts-{sum(left.values())}"
    path.write_text("".join(f"{h}:{n}\n" for h, n in left.items()))
    write_json_atomic(folder / "hosts-lost.json", {"from": str(hostfile), "lost": sorted(gone), "left": left})
    return path


# hydra's words for a host gone: its ranks SIGKILLed (exit code 9: the OOM killer, a reboot, an
# operator), or its proxy unable to reach mpiexec at all (link down when the launch began)
_KILLED = re.compile(r"PID \d+ RUNNING AT (\S+)\s*=\s*EXIT CODE: 9\b")
_UNREACHABLE = re.compile(r"\[proxy:[^@\]]*@([^\]\s]+)\][^\n]*unable to connect")


def lost_in_console(console: str, names: Iterable[str]) -> tuple[str, str] | None:
    """The first host of `names` (a hostfile's) that mpiexec's output says is lost, and how:
    ``killed`` (its ranks SIGKILLed) or ``unreachable`` (its proxy could not connect back); None.

    >>> lost_in_console("=   PID 1803 RUNNING AT h3.cluster\\n=   EXIT CODE: 9", ["h2", "h3"])
    ('h3', 'killed')
    """
    short = {name.split(".")[0]: name for name in names}
    found = [(m.start(), m.group(1), "killed") for m in _KILLED.finditer(console)]
    found += [(m.start(), m.group(1), "unreachable") for m in _UNREACHABLE.finditer(console)]
    for _, host, how in sorted(found):
        if host.split(".")[0] in short:
            return short[host.split(".")[0]], how
    return None


def host_down(event: dict[str, Any]) -> str | None:
    """What a ``host_dead`` event says for people (the controller's `error`), else None."""
    if event.get("type") != "host_dead":
        return None
    return f"host {event.get('host')} is down: {event.get('reason')}; its ranks {event.get('ranks')}"


class HostWatch:
    """The controller's watch for dead hosts: every event is a sign of life (`see`); `check` names the
    hosts of the running launch newly taken for dead, once each per launch. Times are this process's
    monotonic clock at arrival, as for `varuna.telemetry.heartbeat.Liveness`."""

    def __init__(self, dead_after_s: float = DEFAULT_DEAD_AFTER_S) -> None:
        self.dead_after_s = check_dead_after(dead_after_s)
        self._seen: dict[tuple[Any, int], float] = {}  # (job, rank) -> last heard
        self._gone: set[tuple[Any, int]] = set()  # said it exits: not expected to speak again
        self._reported: set[tuple[Any, str]] = set()
        self._lock = threading.Lock()

    def see(self, event: dict[str, Any], now: float | None = None) -> None:
        """Note an event that just arrived (events without an int rank are ignored)."""
        rank, kind = event.get("rank"), event.get("type")
        if not isinstance(rank, int) or isinstance(rank, bool):
            return
        key = (event.get("job"), rank)
        with self._lock:
            self._seen[key] = time.monotonic() if now is None else now
            if kind == "exit" or (kind == "heartbeat" and event.get("action") == "exited"):
                self._gone.add(key)

    def check(
        self, job: Any, placement: Mapping[int, str], now: float | None = None
    ) -> list[tuple[str, list[int], float]]:
        """(host, its ranks, seconds silent) for each host of launch `job` found dead since the last
        call; `placement` is rank -> host (from the ranks' hello events)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            silent = {
                rank: now - at
                for (j, rank), at in self._seen.items()
                if j == job and (j, rank) not in self._gone
            }
        found = []
        for host in dead_hosts(placement, silent, self.dead_after_s):
            if (job, host) not in self._reported:
                self._reported.add((job, host))
                ranks = sorted(r for r, h in placement.items() if h == host)
                found.append((host, ranks, min(silent[r] for r in ranks)))
        return found

    def watch(
        self,
        launch: Callable[[], tuple[Any, list[dict[str, Any]]] | None],
        report: Callable[[Any, str, list[int], float], None],
        closing: threading.Event,
    ) -> None:
        """Until `closing`, four times a second: `report(job, host, ranks, silent_s)` for each newly
        dead host of the running launch; `launch()` gives its job id and its ranks' hello events (None
        while no launch runs)."""
        while not closing.wait(0.25):
            current = launch()
            if current is None:
                continue
            job, hellos = current
            placement = {e["rank"]: e["host"] for e in hellos if isinstance(e.get("host"), str)}
            for host, ranks, silent_s in self.check(job, placement):
                report(job, host, ranks, silent_s)
