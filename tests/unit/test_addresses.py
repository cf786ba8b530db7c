"""Tests of varuna/comm/addresses.py without other hosts (tests/multihost runs it across real ones)."""

from __future__ import annotations

import socket

import pytest

from varuna.comm import addresses
from varuna.comm.addresses import choose_gloo_interface, network_stack, outbound_ip
from varuna.errors import LaunchError


def test_network_stack_names_host_boot_and_namespace() -> None:
    stack = network_stack()
    assert stack == network_stack()
    assert stack.startswith(socket.gethostname() + "/")


def test_master_addr_overrides_the_routed_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_MASTER_ADDR", "10.1.2.3")
    assert outbound_ip(["nowhere.invalid"]) == "10.1.2.3"


def test_a_name_on_127_0_1_1_is_never_advertised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's /etc/hosts puts the host's own name on 127.0.1.1: a peer-less choice falls back to an
    interface's address, and with none a LaunchError names VARUNA_MASTER_ADDR."""
    monkeypatch.delenv("VARUNA_MASTER_ADDR", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(addresses, "interface_addresses", lambda: {"lo": "127.0.0.1", "ib0": "10.9.0.7"})
    assert outbound_ip(["node7"]) == "10.9.0.7"
    monkeypatch.setattr(addresses, "interface_addresses", lambda: {"lo": "127.0.0.1"})
    with pytest.raises(LaunchError, match=r"host node7 has no address.*127\.0\.1\.1.*set VARUNA_MASTER_ADDR"):
        outbound_ip(["node7", "node8"])


def test_gloo_interface_replaces_loopback_and_keeps_the_users_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(addresses, "interface_addresses", lambda: {"lo": "127.0.0.1", "eth3": "10.0.0.5"})
    monkeypatch.setattr(addresses, "interface_towards", lambda host: "eth3")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert choose_gloo_interface("10.0.0.1") == "eth3"
    assert addresses.os.environ["GLOO_SOCKET_IFNAME"] == "eth3"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # the user's, even unknown here: theirs to choose
    assert choose_gloo_interface("10.0.0.1") == "ib0"
    monkeypatch.setattr(addresses, "interface_towards", lambda host: None)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # nothing better found: let gloo use the host name
    assert choose_gloo_interface("10.0.0.1") is None
    assert "GLOO_SOCKET_IFNAME" not in addresses.os.environ


def test_the_loopback_interface_reaches_nothing_else() -> None:
    assert addresses.interface_towards("127.0.0.1") is None
    assert addresses.interface_of("127.0.0.1") in ("lo", None)
