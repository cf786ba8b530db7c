"""The controller's end of the signed ZeroMQ channel: PULL for events, PUB for commands.

Both sockets bind on one interface (loopback by default; the controller passes the address routing
toward the other hosts when its hostfile names any, `varuna.elastic.hosts.controller_interface`; ``"*"``
or ``"0.0.0.0"`` for every interface, advertised to the workers by this host's name) and their
addresses and the job's key
go to ``RUN_DIR/controller.json`` (0600), so a later controller can bind the same addresses and
the workers' sockets, which reconnect by themselves, find it. A background thread verifies every
message (`varuna.telemetry.events.Receiver`: size, signature, fields, sequence, age) and hands the
good ones to ``on_event``; the rest are counted by reason in ``drops``. The thread is the job's only
ear, so nothing a message does may end it: an exception from ``on_event`` is counted as
``malformed`` and kept in ``last_error``. Commands go out stamped by this channel's own `Sender`,
and the workers check them the same way.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from varuna.telemetry import events as _events

__all__ = ["Channel"]


def _bind_again(sock: Any, address: str, wait_s: float = 5.0) -> None:
    """Bind `sock` to the fixed `address` a closed channel had. zmq releases a closed socket's
    listener in its I/O thread, after `close()` has returned, so binding right after a close can
    find the address still in use: try again until `wait_s` has passed, then raise."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Channel:
    """Bound sockets and the receiver thread; `send` publishes a signed command to every rank."""

    def __init__(
        self,
        run_dir: Path,
        key: str,
        on_event: Callable[[dict[str, Any]], Any],
        *,
        interface: str = "127.0.0.1",
        events: str | None = None,
        commands: str | None = None,
    ) -> None:
        self.key = key
        self.receiver = _events.Receiver(bytes.fromhex(key), _events.EVENT_FIELDS, "type")
        self.last_error: str | None = None
        """The last exception `on_event` raised (its message was dropped), for a post-mortem."""
        self._sender = _events.Sender("controller")
        self._on_event = on_event
        self._closing = threading.Event()
        self._lock = threading.Lock()
        host = "*" if interface in ("*", "0.0.0.0") else interface
        shown = socket.getfqdn() if host == "*" else host
        ctx: Any = zmq.Context.instance()
        self._pull, self._pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
        addresses = []
        try:
            for sock, address in ((self._pull, events), (self._pub, commands)):
                sock.setsockopt(zmq.LINGER, 0)
                if address is not None:
                    _bind_again(sock, address.replace(shown, host, 1) if host == "*" else address)
                else:
                    sock.bind_to_random_port(f"tcp://{host}")
                bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
                addresses.append(address or bound.replace("0.0.0.0", shown))
        except zmq.ZMQError:
            self._pull.close(linger=0)
            self._pub.close(linger=0)
            raise
        self.events_address, self.commands_address = addresses
        info = {
            "events": self.events_address,
            "commands": self.commands_address,
            "key": key,
            "pid": os.getpid(),
        }
        _events.write_controller_info(run_dir, info)
        self._thread = threading.Thread(target=self._receive, daemon=True, name="varuna-events")
        self._thread.start()

    @property
    def drops(self) -> dict[str, int]:
        """Messages dropped so far, by reason (too_big, bad_signature, malformed, replay, stale)."""
        return dict(self.receiver.dropped)

    @property
    def dropped(self) -> int:
        """Messages dropped so far, all reasons."""
        return sum(self.receiver.dropped.values())

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closing.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = self.receiver.accept(frames)
                if event is None:
                    continue
                try:
                    self._on_event(event)
                except Exception as exc:  # noqa: BLE001 - one bad message must not deafen the controller
                    self.receiver.dropped["malformed"] += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"

    def send(self, cmd: str, **fields: Any) -> None:
        """Publish the command `cmd` (signed) to every subscribed rank."""
        with self._lock:  # stamp and send in one go: seq must reach the wire in order
            message = self._sender.stamp({"cmd": cmd, "time": time.time(), **fields})
            self._pub.send_multipart(_events.encode(bytes.fromhex(self.key), message))

    def close(self) -> None:
        """Stop the receiver and close both sockets."""
        self._closing.set()
        self._thread.join(timeout=1.0)
        self._pull.close(linger=0)
        self._pub.close(linger=0)
