"""Fault-bench cases on the signed channel and on process identity: forged, replayed, oversize,
malformed and stale messages sent to a real controller channel (ZeroMQ, this process); a status file
whose pid now belongs to an unrelated process, against the real `varuna resize`."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from varuna.bench.faults.case import Case, Result, cli, wait_for


def channel_attack(
    attack: Callable[[bytes, Any], list[list[bytes]]], reason: str
) -> Callable[[Path], Result]:
    """Push the frames `attack(key, sender)` returns, then one good message, to a real Channel: ok when
    exactly one message was dropped, for `reason`, and the good message still arrived."""

    def case(tmp: Path) -> Result:
        import zmq

        from varuna.telemetry import events as ev
        from varuna.telemetry.channel import Channel

        key = ev.new_key()
        got: list[dict[str, Any]] = []
        channel = Channel(tmp, key, got.append)
        push: Any = zmq.Context.instance().socket(zmq.PUSH)
        try:
            push.connect(channel.events_address)
            sender = ev.Sender("rank0")
            frames = attack(bytes.fromhex(key), sender)
            for message in frames:
                push.send_multipart(message)
            push.send_multipart(ev.encode(bytes.fromhex(key), sender.stamp({"type": "ready", "rank": 0})))
            arrived = wait_for(lambda: any(e["type"] == "ready" for e in got), 10)
            drops = channel.drops
        finally:
            push.close(linger=0)
            channel.close()
        ok = arrived and drops == {reason: 1}
        return ok, f"drops {drops}; next good message {'arrived' if arrived else 'LOST'}"

    return case


def _replay(key: bytes, sender: Any) -> list[list[bytes]]:
    from varuna.telemetry import events as ev

    hello = ev.encode(key, sender.stamp({"type": "hello", "rank": 0}))
    return [hello, hello]  # the first passes, its copy is the replay


def _too_big(key: bytes, sender: Any) -> list[list[bytes]]:
    from varuna.telemetry import events as ev

    return [[b"0" * 64, b"y" * (ev.MAX_MESSAGE_BYTES + 1)]]


def _malformed(key: bytes, sender: Any) -> list[list[bytes]]:
    from varuna.telemetry import events as ev

    payload = json.dumps(sender.stamp({"type": "hello", "rank": 0, "id": [1]})).encode()
    return [[ev.sign(key, payload), payload]]


def _bad_signature(key: bytes, sender: Any) -> list[list[bytes]]:
    from varuna.telemetry import events as ev

    return [ev.encode(b"not the job's key", sender.stamp({"type": "hello", "rank": 0}))]


def _stale(key: bytes, sender: Any) -> list[list[bytes]]:
    from varuna.telemetry import events as ev

    return [
        ev.encode(key, sender.stamp({"type": "hello", "rank": 0, "time": time.time() - 2 * ev.MAX_AGE_S}))
    ]


def controller_json_private(tmp: Path) -> Result:
    from varuna.telemetry import events as ev
    from varuna.telemetry.channel import Channel

    key = ev.new_key()
    channel = Channel(tmp, key, lambda e: None)
    try:
        mode = (tmp / ev.CONTROLLER_FILE).stat().st_mode & 0o777
        holders = [p.name for p in tmp.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    finally:
        channel.close()
    return mode == 0o600 and holders == [ev.CONTROLLER_FILE], f"mode {mode:o}; key in {holders}"


def stale_status_not_signalled(tmp: Path) -> Result:
    """The rank that wrote the status died; its pid now belongs to `sleep` (another start time)."""
    from varuna.launch.pids import identity, start_ticks

    sleeper = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        run = tmp / "run"
        (run / "status").mkdir(parents=True)
        (run / "job.json").write_text("{}")
        status = {
            "rank": 0,
            "state": "running",
            **identity(),
            "pid": sleeper.pid,
            "start_ticks": start_ticks(os.getpid()),
        }
        (run / "status" / "rank0.json").write_text(json.dumps(status))
        done = cli("resize", str(run), "-p", "1", "-d", "1")
        time.sleep(0.2)
        alive = sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    said = next(
        (ln for ln in done.stderr.splitlines() if "another process now" in ln), done.stderr.strip()[:160]
    )
    ok = done.returncode == 0 and alive and "stale status" in said
    return ok, f"exit {done.returncode}; unrelated pid {'alive' if alive else 'SIGNALLED'}; {said.strip()}"


def dead_status_recognised(tmp: Path) -> Result:
    from varuna.launch.pids import check_status, identity

    gone = subprocess.Popen(["true"])
    gone.wait()
    verdict = check_status({"rank": 1, "state": "running", **identity(), "pid": gone.pid})
    return verdict.kind == "dead" and not verdict.live, f"{verdict.kind}: {verdict.reason}"


def cases() -> list[Case]:
    return [
        Case(
            "replayed signed event",
            "attack",
            "dropped as replay; receiver goes on",
            channel_attack(_replay, "replay"),
        ),
        Case(
            "oversize frame",
            "attack",
            "dropped as too_big before the HMAC; receiver goes on",
            channel_attack(_too_big, "too_big"),
        ),
        Case(
            'malformed signed event ("id": [1])',
            "attack",
            "dropped as malformed; next good one arrives",
            channel_attack(_malformed, "malformed"),
        ),
        Case(
            "bad signature",
            "attack",
            "dropped as bad_signature",
            channel_attack(_bad_signature, "bad_signature"),
        ),
        Case("stale timestamp", "attack", "dropped as stale", channel_attack(_stale, "stale")),
        Case(
            "controller.json holds the key privately",
            "attack",
            "mode 600; the only file with the key",
            controller_json_private,
        ),
        Case(
            "stale status, live unrelated pid",
            "attack",
            "varuna resize signals nothing; says stale status",
            stale_status_not_signalled,
        ),
        Case("status of a dead rank", "fault", "recognised as dead, not live", dead_status_recognised),
    ]
