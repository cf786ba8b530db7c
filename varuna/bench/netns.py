"""Hosts you can test: two or three "hosts" on this machine, each a Linux network namespace.

    switch namespace  <prefix>-sw             host namespaces  <prefix>-h1, <prefix>-h2, ...
    ┌──────────────────────────────┐          ┌──────────────────────────┐
    │ br0 ── <prefix>p1 ─── veth ──┼──────────┤ eth0 10.77.0.1/24  "h1"  │
    │   └─── <prefix>p2 ─── veth ──┼──────────┤ eth0 10.77.0.2/24  "h2"  │
    └──────────────────────────────┘          └──────────────────────────┘

Each host has its own network stack (its own loopback too), an address on a private subnet that
exists only inside these namespaces (the bridge lives in a namespace of its own, so nothing here
touches this machine's network), its own host name (a UTS namespace per process started there:
``socket.gethostname()`` says ``h1``) and an ``/etc/hosts`` naming every host (``ip netns exec``
bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``), as a cluster's name service would,
with the host's own name on 127.0.1.1 as Debian and Ubuntu install it (a trap for code that takes
its own name's address for the one other hosts reach).
Everything else is shared with this machine: the file system (the run directory is on a "shared
file system", as it must be on a cluster), the processes' pids, the CPUs.

MPICH's hydra starts the ranks of each host through ``-launcher ssh -launcher-exec SHIM``: hydra
calls ``SHIM -x HOST "proxy" args...`` as it would call ``ssh``, and the shim runs the proxy in
HOST's namespace under HOST's name (under this machine's name when ``NETNS_HOSTS_SAME_NAME`` is set
in mpiexec's environment: hosts that share one name). ``mpiexec`` itself runs in the first host
(`NetnsHosts.command`), so every process of a job is on the private subnet.

Names carry this process's pid (``vmh<pid>-...``), so harnesses of concurrent test runs never
meet, and the namespaces of a killed run (its pid gone) are removed by the next one.

Needs root, ``ip`` (iproute2) with network namespace support and ``unshare`` (util-linux).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NetnsHosts", "unavailable", "remove_stale"]

NETNS_ETC = Path("/etc/netns")
SUBNET = "10.77.0"
_NAME = re.compile(r"^vmh(\d+)-")


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns, veth pairs, unshare --uts)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"namespace hosts need `{tool}` on PATH (apt-get install iproute2 util-linux)"
    probe = f"vmh{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete(ns: str) -> None:
    """Kill what still runs in namespace `ns` (only our test processes can be there), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def remove_stale() -> list[str]:
    """Delete the namespaces (and their /etc/netns files) of harnesses whose process is gone."""
    stale = [ns for ns in _namespaces() if (m := _NAME.match(ns)) and not _pid_alive(int(m.group(1)))]
    for ns in stale:
        _delete(ns)
    return stale


@dataclass
class NetnsHosts:
    """``count`` namespace hosts named h1..hN on 10.77.0.0/24; `up` makes them, `down` removes them.

    >>> hosts = NetnsHosts(2, workdir=tmp).up()            # doctest: +SKIP
    >>> subprocess.run(hosts.command("h1", ["hostname"]))  # prints h1  # doctest: +SKIP
    >>> hosts.down()                                       # doctest: +SKIP
    """

    count: int
    workdir: Path
    prefix: str = field(default_factory=lambda: f"vmh{os.getpid()}")
    names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        if not 2 <= self.count <= 9:
            raise ValueError(f"NetnsHosts makes 2 to 9 hosts (got {self.count})")
        self.names = [f"h{i}" for i in range(1, self.count + 1)]
        self.shim = self.workdir / "netns-launcher.sh"

    def netns(self, host: str) -> str:
        """The network namespace of `host`."""
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of `host` on the private subnet."""
        return f"{SUBNET}.{self.names.index(host) + 1}"

    def command(self, host: str, argv: list[str], *, own_name: bool = True) -> list[str]:
        """`argv` run on `host`: in its network namespace, in a UTS namespace named after it (with
        `own_name`; else under this machine's name, as hosts that all share one name)."""
        name = 'hostname "$0"' if own_name else ":"
        return [
            "ip",
            "netns",
            "exec",
            self.netns(host),
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'{name} && exec "$@"',
            host,
            *argv,
        ]

    def hostfile(self, path: Path, slots: dict[str, int]) -> Path:
        """Write an MPI hostfile (``host:N`` lines, in the order given) and return its path."""
        path.write_text("".join(f"{host}:{n}\n" for host, n in slots.items()))
        return path

    @property
    def mpiexec_args(self) -> str:
        """What ``VARUNA_MPIEXEC_ARGS`` needs so that hydra starts each host's ranks there."""
        return f"-launcher ssh -launcher-exec {shlex.quote(str(self.shim))}"

    def _etc_hosts(self, host: str) -> str:
        """`host`'s /etc/hosts as Debian writes it: its own name on 127.0.1.1, the others' addresses."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{'127.0.1.1' if h == host else self.address(h)} {h}" for h in self.names]
        return "\n".join(lines) + "\n"

    def shape(self, host: str, mbit: float | None) -> None:
        """Limit `host`'s link to `mbit` megabits per second in both directions (None: unlimited).

        A token bucket (`tc ... tbf`) on each end of the host's veth: on its eth0 for what it sends,
        on its switch port for what it receives. This kernel has no `netem`, so no delay is added:
        the shaping is bandwidth only. The qdiscs go with the namespaces in `down`."""
        port = f"{self.prefix}p{self.names.index(host) + 1}"
        for ns, dev in ((self.netns(host), "eth0"), (f"{self.prefix}-sw", port)):
            if mbit is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                continue
            burst = max(int(mbit * 1e6 / 8 / 100), 16 * 1024)  # 10 ms of the rate, at least 16 KiB
            done = subprocess.run(
                [
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{mbit}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                ],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"`tc` could not shape {host}'s link: {done.stderr.strip()}")

    def up(self) -> NetnsHosts:
        """Make the switch, the hosts, their links, /etc/hosts files and the launcher shim."""
        remove_stale()
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        switch = f"{self.prefix}-sw"
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.names, 1):
            ns, port = self.netns(host), f"{self.prefix}p{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(self._etc_hosts(host))
        # hydra calls `SHIM -x HOST CMD...` as it would call ssh: CMD is one shell line (quoted)
        self.shim.write_text(
            "#!/bin/sh\n"
            "# hydra's ssh launcher: run the proxy command line on HOST's namespace, under HOST's name\n"
            '[ "$1" = -x ] && shift\n'
            "host=$1; shift\n"
            '[ -n "$NETNS_HOSTS_SAME_NAME" ] && name=: || name="hostname $host"\n'
            f'exec ip netns exec "{self.prefix}-$host" unshare --uts sh -c "$name && exec $*"\n'
        )
        self.shim.chmod(0o755)
        self._wait_links()

    def _wait_links(self, timeout_s: float = 10.0) -> None:
        """Wait until the first host reaches every other one (a fresh bridge port may take a moment)."""
        first = self.names[0]
        probe = (  # a refused connection is an answer: the host is there
            "import socket, sys\n"
            "for host in sys.argv[1:]:\n"
            "    try:\n"
            "        socket.create_connection((host, 9), timeout=1).close()\n"
            "    except ConnectionRefusedError:\n"
            "        pass\n"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run(
                self.command(first, [sys.executable, "-c", probe, *self.names[1:]]),
                capture_output=True,
                text=True,
            )
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace hosts not reachable from {first}: {done.stderr.strip()}")
            time.sleep(0.2)

    def down(self) -> None:
        """Kill anything left in the hosts, delete every namespace and /etc/netns file of this harness."""
        for ns in _namespaces():
            if ns.startswith(f"{self.prefix}-"):
                _delete(ns)
        try:
            NETNS_ETC.rmdir()  # only when no other harness (or user) keeps files there
        except OSError:
            pass
