"""Which address and network interface a rank uses to reach the other hosts of its job.

A one-host job keeps everything on loopback (see `varuna.comm.rendezvous`). A job across hosts must
not, and leaving the choice to defaults goes wrong on ordinary machines:

- Gloo binds to the address its host name resolves to. Debian and Ubuntu write ``127.0.1.1 NAME``
  into ``/etc/hosts``, so every rank would publish a loopback address and the other hosts be
  refused (``Gloo connectFullMesh failed ... remote=[127.0.1.1]``). A ``GLOO_SOCKET_IFNAME=lo``
  inherited from a process that once trained alone (the one-process rendezvous sets it) does the same.
- Rank 0's rendezvous store must be told an address the other hosts can reach, not its name's.

So the kernel's routing decides: a UDP socket "connected" to a peer sends nothing, yet tells which
local address would carry the traffic. Rank 0 advertises the address that routes to its peers, and
every rank names gloo the interface holding the address that routes to rank 0's store::

    rank 0:  peers' names ──route──> 10.0.0.1 (advertised with the store's port)
    rank r:  10.0.0.1 ──route──> own 10.0.0.7 ──interface──> eth1 = GLOO_SOCKET_IFNAME

What ranks share a network stack (and so may use loopback) is decided by `network_stack`, not by
host names alone: two machines may both be called ``node``, and containers or network namespaces on
one machine share its name but not its loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

from varuna.errors import LaunchError

__all__ = [
    "interface_addresses",
    "network_stack",
    "outbound_ip",
    "interface_of",
    "interface_towards",
    "choose_gloo_interface",
    "listening_on",
]

_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def network_stack() -> str:
    """An id equal for processes that share one network stack: host name, boot id, network namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot}/{netns}"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _route_from(address: str) -> str | None:
    """The local address that traffic to `address` leaves from, or None when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # UDP: looks up the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """This host's interfaces and their IPv4 addresses (Linux; empty elsewhere)."""
    try:
        import fcntl
    except ImportError:  # not Unix
        return {}
    found: dict[str, str] = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # down, or no IPv4 address
                continue
        found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address`, or None."""
    return next((name for name, held in interface_addresses().items() if held == address), None)


def interface_towards(host: str) -> str | None:
    """The interface this host reaches `host` through, or None (no route, or only loopback)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    local = _route_from(address)
    return None if local is None or _loopback(local) else interface_of(local)


def outbound_ip(peers: list[str]) -> str:
    """The address of this host that the hosts named in `peers` can reach (``VARUNA_MASTER_ADDR`` overrides).

    The address that routes to the first peer that resolves to a remote address; else this host's
    name's address unless it is loopback; else the first address of a non-loopback interface.
    """
    override = os.environ.get("VARUNA_MASTER_ADDR", "").strip()
    if override:
        return override
    me = socket.gethostname()
    for peer in dict.fromkeys(peers):
        if peer == me:
            continue
        try:
            address = socket.gethostbyname(peer)
        except OSError:
            continue
        local = _route_from(address) if not _loopback(address) else None
        if local is not None and not _loopback(local):
            return local
    try:
        mine = socket.gethostbyname(me)
    except OSError:
        mine = "127.0.0.1"
    if not _loopback(mine):
        return mine
    for held in interface_addresses().values():
        if not _loopback(held):
            return held
    raise LaunchError(
        f"host {me} has no address other hosts can reach (its name resolves to {mine} and no interface "
        "holds a non-loopback IPv4 address): set VARUNA_MASTER_ADDR to rank 0's address on the cluster network"
    )


def choose_gloo_interface(store_host: str) -> str | None:
    """Point gloo (``GLOO_SOCKET_IFNAME``) at the interface that reaches `store_host`; return it.

    A ``GLOO_SOCKET_IFNAME`` the user set to real interfaces is kept; one naming only loopback
    interfaces, which cannot reach another host, is replaced (or dropped when no interface is found,
    so that gloo falls back to the host name's address rather than certainly failing).
    """
    current = os.environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if current:
        held = interface_addresses()
        names = [n.strip() for n in current.split(",") if n.strip()]
        if not all(n == "lo" or _loopback(held.get(n, "")) for n in names):
            return current
    chosen = interface_towards(store_host)
    if chosen is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = chosen
    else:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    return chosen


def listening_on(port: int) -> list[str]:
    """The addresses a socket of this network stack listens on at `port` (from /proc/net/tcp, tcp6)."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # per-word host order
                found.append(str(ipaddress.ip_address(words)))
    return found
