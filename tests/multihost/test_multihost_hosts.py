"""The namespace hosts themselves, and how a rank picks its address and gloo interface on them.

Each host must look like a machine of its own to the code under test: its own name, its own network
stack (and loopback), an address on a subnet that only the hosts can see; the hosts reach each other by
name; and the harness leaves nothing behind, also after a killed run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from varuna.bench.netns import NETNS_ETC, SUBNET, NetnsHosts, remove_stale, unavailable
from varuna.comm.addresses import interface_addresses as addresses_here
from varuna.comm.addresses import network_stack

pytestmark = [pytest.mark.multihost, pytest.mark.foreground, pytest.mark.timeout(120)]

WHO = """
import json, socket
from varuna.comm.addresses import interface_addresses, network_stack
print(json.dumps({"name": socket.gethostname(), "stack": network_stack(), "addresses": interface_addresses(),
                  "others": {h: socket.gethostbyname(h) for h in ("h1", "h2", "h3")}}))
"""


def test_multihost_each_host_has_its_own_name_stack_and_address(hosts: NetnsHosts, on_host) -> None:
    seen = {host: json.loads(on_host(host, WHO)) for host in hosts.names}
    assert [seen[h]["name"] for h in hosts.names] == ["h1", "h2", "h3"]
    stacks = {seen[h]["stack"] for h in hosts.names} | {network_stack()}
    assert len(stacks) == 4  # three hosts and this machine: four network stacks
    for i, host in enumerate(hosts.names, 1):
        assert seen[host]["addresses"] == {"lo": "127.0.0.1", "eth0": f"{SUBNET}.{i}"}
        # its own name on 127.0.1.1, as Debian installs it; the others' on the subnet
        assert seen[host]["others"] == {
            h: "127.0.1.1" if h == host else hosts.address(h) for h in hosts.names
        }
    # the subnet exists only inside the hosts
    assert not [a for a in addresses_here().values() if a.startswith(f"{SUBNET}.")]


def test_multihost_hosts_reach_each_other_by_name(hosts: NetnsHosts, on_host) -> None:
    server = subprocess.Popen(
        hosts.command(
            "h2",
            [
                sys.executable,
                "-c",
                (
                    "import socket\n"
                    "s = socket.create_server(('0.0.0.0', 0)); print(s.getsockname()[1], flush=True)\n"
                    "c, peer = s.accept(); c.sendall(peer[0].encode() + b' ' + socket.gethostname().encode())\n"
                ),
            ],
        ),
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        code = (
            f"import socket; print(socket.create_connection(('h2', {port}), timeout=10).recv(100).decode())"
        )
        assert on_host("h1", code).split() == [hosts.address("h1"), "h2"]
        # this machine's own stack has no route to the subnet
        with pytest.raises(OSError):
            import socket

            socket.create_connection((hosts.address("h2"), port), timeout=2)
    finally:
        server.kill()
        server.wait()


def test_multihost_rank0_and_gloo_use_the_subnet_not_loopback(hosts: NetnsHosts, on_host) -> None:
    """h1's name resolves to 127.0.1.1 on h1 and a notebook may leave GLOO_SOCKET_IFNAME=lo behind:
    rank 0 still advertises 10.77.0.1 and every host points gloo at the interface that reaches it."""
    code = (
        "from varuna.comm.addresses import outbound_ip, choose_gloo_interface\n"
        "print(outbound_ip(['h1', 'h2', 'h3']), choose_gloo_interface('{store}'))\n"
    )
    store = hosts.address("h1")
    assert on_host("h1", code.format(store=store), env={"GLOO_SOCKET_IFNAME": "lo"}).split() == [
        store,
        "eth0",
    ]
    assert on_host("h3", code.format(store=store), env={"GLOO_SOCKET_IFNAME": "lo"}).split()[1] == "eth0"
    # an interface the user named is theirs to choose
    kept = "import os; from varuna.comm.addresses import choose_gloo_interface as c; print(c('h1'))"
    assert on_host("h2", kept, env={"GLOO_SOCKET_IFNAME": "eth0,lo"}).strip() == "eth0,lo"


def test_multihost_harness_leaves_nothing_behind(tmp_path) -> None:
    if (reason := unavailable()) is not None:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid nobody has: the namespaces of a killed run
    stale = NetnsHosts(2, workdir=tmp_path, prefix=f"vmh{dead.pid}").up()
    made = [stale.netns(h) for h in stale.names]
    assert all((NETNS_ETC / ns / "hosts").exists() for ns in made)
    removed = remove_stale()
    assert set(removed) == {*made, f"vmh{dead.pid}-sw"}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"vmh{dead.pid}-" not in listed
    assert not any((NETNS_ETC / ns).exists() for ns in made)
    mine = NetnsHosts(2, workdir=tmp_path, prefix=f"vmh{os.getpid()}-t").up()
    assert remove_stale() == []  # a live run's hosts are not stale
    mine.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"vmh{os.getpid()}-t-" not in listed


SEND = """
import socket, sys, time
host, nbytes = sys.argv[1], int(sys.argv[2])
sock = socket.create_connection((host, 5099), timeout=30)
payload = bytes(1 << 16)
start = time.perf_counter()
left = nbytes
while left > 0:
    left -= sock.send(payload[: min(left, len(payload))])
sock.shutdown(socket.SHUT_WR)
sock.recv(1)  # the receiver's byte once it has everything
print(time.perf_counter() - start)
"""

RECEIVE = """
import socket, sys
nbytes = int(sys.argv[1])
server = socket.create_server(("0.0.0.0", 5099))
print("listening", flush=True)
conn, _ = server.accept()
got = 0
while got < nbytes:
    got += len(conn.recv(1 << 16))
conn.sendall(b"k")
"""


def _transfer_s(hosts: NetnsHosts, src: str, dst: str, nbytes: int) -> float:
    """Seconds to move `nbytes` over TCP from `src` to `dst` (the receiver confirms the last byte)."""
    env = {**os.environ, "PYTHONPATH": ""}
    receiver = subprocess.Popen(
        hosts.command(dst, [sys.executable, "-c", RECEIVE, str(nbytes)]),
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "listening"
        sent = subprocess.run(
            hosts.command(src, [sys.executable, "-c", SEND, dst, str(nbytes)]),
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        assert sent.returncode == 0, sent.stderr
        return float(sent.stdout.strip())
    finally:
        receiver.wait(timeout=30)


def test_multihost_a_shaped_link_moves_data_at_its_rate_both_ways(hosts: NetnsHosts) -> None:
    """`NetnsHosts.shape(host, mbit)`: 4 MB at 16 Mbit/s takes about 2 s each way (tbf shapes the rate,
    not the delay: this kernel has no netem); unshaped again, it is back to memory speed."""
    nbytes, mbit = 4_000_000, 16
    ideal = nbytes * 8 / (mbit * 1e6)
    hosts.shape("h2", mbit)
    try:
        out = _transfer_s(hosts, "h1", "h2", nbytes)  # into h2: its switch port's bucket
        back = _transfer_s(hosts, "h2", "h1", nbytes)  # out of h2: its eth0's bucket
    finally:
        hosts.shape("h2", None)
    free = _transfer_s(hosts, "h1", "h2", nbytes)
    print(
        f"\n4 MB at {mbit} Mbit/s: {out:.2f} s in, {back:.2f} s out (ideal {ideal:.2f} s); unshaped {free:.3f} s"
    )
    for seconds in (out, back):
        assert 0.9 * ideal <= seconds <= 1.6 * ideal
    assert free < ideal / 4
