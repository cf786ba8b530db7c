"""The notebook controller (varuna/controller.py) without processes: event signing, address reuse,
validation in the caller. The tests that drive a real job are in tests/multirank/test_controller_jobs.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import zmq

from varuna.controller import JobController
from varuna.errors import ConfigError
from varuna.telemetry import events as _events


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_unsigned_and_badly_signed_events_are_dropped(tmp_path: Path) -> None:
    ctl = JobController(tmp_path)
    ctl._bind()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(ctl.events_address)
        push.send_multipart([b"", b'{"type": "hello", "rank": 7}'])
        push.send_multipart(_events.encode(b"not the key", {"type": "hello", "rank": 8}))
        rank9 = _events.Sender("rank9").stamp({"type": "hello", "rank": 9})
        push.send_multipart(_events.encode(bytes.fromhex(ctl.key), rank9))
        assert wait_for(lambda: ctl.store.count > 0, 5.0)
        time.sleep(0.2)
        assert [e["rank"] for e in ctl.store.events("hello")] == [9]
        assert ctl._channel is not None and ctl._channel.dropped == 2
        assert _events.read_controller_info(tmp_path)["events"] == ctl.events_address
        assert ctl.events_address.startswith("tcp://127.0.0.1:")
    finally:
        push.close(linger=0)
        ctl.close()


def test_a_controller_binds_the_addresses_of_one_closed_a_moment_ago(tmp_path: Path) -> None:
    from varuna.telemetry.channel import _bind_again

    first = JobController(tmp_path)
    first._bind()
    events, commands = first.events_address, first.commands_address
    first.close()  # zmq frees the listeners later, in its I/O thread
    second = JobController(tmp_path)
    try:
        second._bind(events, commands)
        assert (second.events_address, second.commands_address) == (events, commands)
    finally:
        second.close()
    held = zmq.Context.instance().socket(zmq.PULL)
    _bind_again(held, events)  # `second` was closed just now
    other = zmq.Context.instance().socket(zmq.PULL)
    try:
        start = time.monotonic()
        with pytest.raises(zmq.ZMQError) as caught:
            _bind_again(other, events, wait_s=0.3)  # an address that stays taken: tried, then raised
        assert caught.value.errno == zmq.EADDRINUSE and time.monotonic() - start >= 0.3
    finally:
        held.close(linger=0)
        other.close(linger=0)


def test_start_validates_in_the_caller(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="script not found"):
        JobController.start([str(tmp_path / "nope.py")], pipeline=2, data=1, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="not a varuna run directory"):
        JobController.attach(tmp_path)


def test_set_checks_names_and_values_before_sending(tmp_path: Path) -> None:
    ctl = JobController(tmp_path)  # no job and no socket: a LaunchError if anything got as far as sending
    for options, says in [
        ({"spans_every": "x"}, r"set\(spans_every=...\) takes an integer >= 1.*got 'x'"),
        ({"spans_every": 0}, r"takes an integer >= 1.*got 0"),
        ({"paused": "no"}, r"set\(paused=...\) takes True or False.*got 'no'"),
        ({"min_interval_s": -1}, r"seconds >= 0.*got -1"),
        ({"span_every": 2}, r"no option 'span_every'; valid: paused, spans_every, min_interval_s"),
    ]:
        with pytest.raises(ConfigError, match=says):
            ctl.set(**options)


def test_resume_checks_its_shape_before_launching(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    job = {"argv": ["train.py"], "pipeline": 2, "data": 1, "start": 0.0, "end": 1.0, "exit_code": 0}
    (run / "job.json").write_text(json.dumps(job))
    ctl = JobController.attach(run, reconnect=False)
    assert ctl.state == "finished"
    start = time.monotonic()
    for kw, says in [
        ({"pipeline": "2"}, r"resume\(pipeline=...\) takes a positive integer or None.*got '2'"),
        ({"pipeline": 0}, r"resume\(pipeline=...\).*got 0"),  # was silently the last shape
        ({"data": -1}, r"resume\(data=...\).*got -1"),
        ({"checkpoint": 3}, r"takes 'latest' or a checkpoint directory, got 3"),
    ]:
        with pytest.raises(ConfigError, match=says):
            ctl.resume(**kw)
    assert time.monotonic() - start < 1.0 and ctl.job is None  # nothing launched, no wait
    assert ctl.state == "finished"
