"""Signed messages (varuna/telemetry/events.py `Sender`/`Receiver`) and the controller's channel
(varuna/telemetry/channel.py): what is dropped, why, and that the receiver thread lives through it.
One process, real ZeroMQ sockets; the worker's side of commands is in test_telemetry.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import zmq

from varuna.controller import JobController
from varuna.telemetry import events as _events
from varuna.telemetry.channel import Channel

KEY = bytes.fromhex(_events.new_key())


def receiver() -> _events.Receiver:
    return _events.Receiver(KEY, _events.EVENT_FIELDS, "type")


def signed(payload: bytes) -> list[bytes]:
    return [_events.sign(KEY, payload), payload]


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


# --- the receiver's checks -------------------------------------------------------------------------


def test_each_message_is_stamped_with_its_sender_and_the_next_seq() -> None:
    a, b = _events.Sender("rank0"), _events.Sender("rank0")
    first, second = a.stamp({"type": "hello"}), a.stamp({"type": "ready", "time": 5.0})
    assert (first["seq"], second["seq"]) == (1, 2) and first["sender"] == second["sender"]
    assert second["time"] == 5.0 and abs(first["time"] - time.time()) < 5
    assert a.id.startswith("rank0-") and a.id != b.id  # a restarted process is a new sender


def test_good_messages_pass_and_replays_are_dropped() -> None:
    rx, sender = receiver(), _events.Sender("rank1")
    old = _events.encode(KEY, sender.stamp({"type": "hello", "rank": 1}))
    new = _events.encode(KEY, sender.stamp({"type": "ready", "rank": 1}))
    assert rx.accept(old)["type"] == "hello"
    assert rx.accept(new)["type"] == "ready"
    assert rx.accept(new) is None and rx.accept(old) is None  # the same again, and an older one
    restarted = _events.Sender("rank1")  # seq 1 again, but a new sender
    assert rx.accept(_events.encode(KEY, restarted.stamp({"type": "hello", "rank": 1}))) is not None
    assert rx.dropped == {"replay": 2}


def test_stale_too_big_bad_signature_and_malformed_are_dropped_by_reason() -> None:
    rx, sender = receiver(), _events.Sender("rank0")
    stale = sender.stamp({"type": "hello", "time": time.time() - 2 * _events.MAX_AGE_S})
    assert rx.accept(_events.encode(KEY, stale)) is None
    big = b"x" * _events.MAX_MESSAGE_BYTES
    assert rx.accept([b"not even a signature", big]) is None  # refused by size, before the HMAC
    assert rx.accept(_events.encode(b"another key", sender.stamp({"type": "hello"}))) is None
    assert rx.dropped == {"stale": 1, "too_big": 1, "bad_signature": 1}


GONE = object()


@pytest.mark.parametrize(
    "change",
    [
        b"not json",
        b"[1, 2]",
        b'{"type": "hello", "time": NaN, "sender": "s", "seq": 1}',  # Python's json would read NaN
        {"id": [1]},  # the message that once killed the controller's receiver thread
        {"rank": "0"},
        {"rank": True},
        {"type": 3},
        {"type": GONE},
        {"step": 1.5},
        {"sender": GONE},
        {"sender": ""},
        {"seq": True},
        {"seq": 0},
        {"time": "now"},
    ],
)
def test_malformed_signed_messages_are_dropped(change: bytes | dict) -> None:
    if isinstance(change, bytes):
        raw = change
    else:
        message = _events.Sender("rank0").stamp({"type": "hello", "rank": 0})
        for name, value in change.items():
            message[name] = value
            if value is GONE:
                del message[name]
        raw = json.dumps(message).encode()
    rx = receiver()
    assert rx.accept(signed(raw)) is None
    assert rx.accept([signed(raw)[0]]) is None  # one frame
    assert rx.dropped == {"malformed": 2}


# --- the controller's channel ----------------------------------------------------------------------


def test_the_receiver_thread_survives_bad_messages_and_handler_errors(tmp_path: Path) -> None:
    got: list[dict] = []

    def on_event(event: dict) -> None:
        if event["type"] == "boom":
            raise KeyError("the store choked")
        got.append(event)

    channel = Channel(tmp_path, KEY.hex(), on_event)
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(channel.events_address)
        sender = _events.Sender("rank0")
        push.send_multipart(signed(json.dumps(sender.stamp({"type": "hello", "id": [1]})).encode()))
        push.send_multipart(_events.encode(KEY, sender.stamp({"type": "boom", "rank": 0})))
        push.send_multipart([b"0" * 64, b"y" * (_events.MAX_MESSAGE_BYTES + 1)])
        hello = _events.encode(KEY, sender.stamp({"type": "hello", "rank": 0}))
        push.send_multipart(hello)
        push.send_multipart(hello)  # a replay
        push.send_multipart(_events.encode(KEY, sender.stamp({"type": "ready", "rank": 0})))
        assert wait_for(lambda: [e["type"] for e in got] == ["hello", "ready"]), got
        assert channel.drops == {"malformed": 2, "too_big": 1, "replay": 1} and channel.dropped == 4
        assert channel.last_error == "KeyError: 'the store choked'"
    finally:
        push.close(linger=0)
        channel.close()


def test_commands_are_stamped_in_order_and_controller_json_is_private(tmp_path: Path) -> None:
    channel = Channel(tmp_path, KEY.hex(), lambda e: None)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(channel.commands_address)
        time.sleep(0.3)  # let the SUB socket join
        channel.send("checkpoint")
        channel.send("stop", checkpoint=True)
        rx = _events.Receiver(KEY, _events.COMMAND_FIELDS, "cmd")
        got = [rx.accept(sub.recv_multipart()) for _ in range(2) if sub.poll(5000)]
        assert [(c["cmd"], c["seq"]) for c in got] == [("checkpoint", 1), ("stop", 2)]
        assert got[0]["sender"].startswith("controller-")
        assert (tmp_path / "controller.json").stat().st_mode & 0o777 == 0o600
    finally:
        sub.close(linger=0)
        channel.close()


def test_a_controller_counts_what_it_dropped(tmp_path: Path) -> None:
    ctl = JobController(tmp_path)
    ctl._bind()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(ctl.events_address)
        key, sender = bytes.fromhex(ctl.key), _events.Sender("rank0")
        good = _events.encode(key, sender.stamp({"type": "hello", "rank": 0, "host": "h"}))
        push.send_multipart([_events.sign(key, b'{"id": [1]}'), b'{"id": [1]}'])
        push.send_multipart(good)
        push.send_multipart(good)
        assert wait_for(lambda: sum(ctl.dropped_messages().values()) == 2)
        assert ctl.dropped_messages() == {"malformed": 1, "replay": 1}
        assert [e["rank"] for e in ctl.store.events("hello")] == [0]
    finally:
        push.close(linger=0)
        ctl.close()
