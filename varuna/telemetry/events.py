"""The wire and file formats shared by the workers' telemetry and the controller.

    worker ── PUSH [signature, payload] ──> controller PULL      (events, every rank)
    worker <── SUB [signature, payload] ─── controller PUB       (commands, every rank subscribes)
    worker ── append one JSON line ──> RUN_DIR/events/rank{r}.jsonl   (always, controller or not)

``payload`` is compact JSON; ``signature`` is HMAC-SHA256 of the payload with the job's key
(``VARUNA_EVENTS_KEY``, hex). Every message names its ``sender`` (who, plus a random nonce drawn
once per process, so a restarted worker or controller is a new sender) and carries that sender's
``seq`` (1, 2, 3, ...) and ``time``. A `Receiver` checks, cheapest first, and drops (counting the
reason): a frame over ``MAX_MESSAGE_BYTES`` before any hashing or parsing (``too_big``), a wrong
signature (``bad_signature``), a payload that is not a JSON object with the fields and types the
reader relies on (``malformed``), a ``seq`` not above the last one seen from its sender (``replay``)
and a ``time`` further than ``MAX_AGE_S`` from the receiver's clock (``stale``: a message recorded
in an earlier launch, whose sender the receiver never saw). So a process on the same host that
guesses the port can neither inject events nor command the job, nor replay what it captured, and
one bad message costs the receiver a counter, never its thread.

The key never travels on a command line: the launcher passes it to mpiexec by name, in the
environment (see `varuna.launch.job.SECRET_ENV`). ``RUN_DIR/controller.json`` (mode 0600) keeps
the addresses and the key, so a restarted notebook kernel can reattach; ``job.json`` holds no
secret. This module imports neither zmq nor torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "new_key",
    "sign",
    "encode",
    "decode",
    "Sender",
    "Receiver",
    "EVENT_FIELDS",
    "COMMAND_FIELDS",
    "MAX_MESSAGE_BYTES",
    "MAX_AGE_S",
    "EventLog",
    "read_log",
    "read_events",
    "write_controller_info",
    "read_controller_info",
    "free_port",
]

CONTROLLER_FILE = "controller.json"

MAX_MESSAGE_BYTES = 1 << 20
"""The largest message (signature + payload) a receiver reads; a bigger one is dropped unread."""
MAX_AGE_S = 300.0
"""How far a message's ``time`` may be from the receiver's clock (covers clock skew between hosts)."""
MAX_SENDERS = 4096
"""Senders remembered for replay detection (a restarted worker is a new one); the oldest go first."""

_NONE = type(None)
Fields = Mapping[str, tuple[type, ...]]
EVENT_FIELDS: Fields = {
    "type": (str,),
    "rank": (int, _NONE),
    "stage": (int, _NONE),
    "replica": (int, _NONE),
    "step": (int, _NONE),
    "job": (str, _NONE),
    "launch": (int, _NONE),
    "id": (str,),
    "host": (str, _NONE),
    "action": (str, _NONE),
}
"""Fields of an event and the types the controller's store relies on; ``type`` is required."""
COMMAND_FIELDS: Fields = {
    "cmd": (str,),
    "paused": (bool,),
    "spans_every": (int,),
    "min_interval_s": (int, float),
    "checkpoint": (bool,),
    "reason": (str,),
}
"""Fields of a command and their types; ``cmd`` is required."""


def new_key() -> str:
    """A fresh per-job key: 32 random bytes as hex."""
    return secrets.token_hex(32)


def sign(key: bytes, payload: bytes) -> bytes:
    """The HMAC-SHA256 of ``payload`` under ``key`` (hex digest, as bytes)."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest().encode()


def encode(key: bytes, message: dict[str, Any]) -> list[bytes]:
    """The two frames of a signed message: signature, payload."""
    payload = json.dumps(message, separators=(",", ":"), default=str).encode()
    return [sign(key, payload), payload]


def decode(key: bytes, frames: list[bytes]) -> dict[str, Any] | None:
    """The message carried by ``frames``, or None when it is malformed, too big or its signature is
    wrong (no sequence check: that is `Receiver`'s)."""
    if len(frames) != 2 or sum(len(f) for f in frames) > MAX_MESSAGE_BYTES:
        return None
    signature, payload = frames
    if not hmac.compare_digest(signature, sign(key, payload)):
        return None
    try:
        message = json.loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


class Sender:
    """Stamps this process's messages with its sender id and the next sequence number.

    >>> sender = Sender("rank3")
    >>> sender.stamp({"type": "hello"})["seq"], sender.stamp({"type": "ready"})["seq"]
    (1, 2)
    """

    def __init__(self, name: str) -> None:
        self.id = f"{name}-{secrets.token_hex(8)}"
        self.seq = 0

    def stamp(self, message: dict[str, Any]) -> dict[str, Any]:
        """``message`` with ``sender``, the next ``seq`` and (unless it has one) ``time`` set, in place."""
        self.seq += 1
        message["sender"], message["seq"] = self.id, self.seq
        message.setdefault("time", time.time())
        return message


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; a message has none


def _well_formed(message: Any, fields: Fields, required: str) -> bool:
    if not isinstance(message, dict) or required not in message:
        return False
    sender, seq, stamp = message.get("sender"), message.get("seq"), message.get("time")
    if not isinstance(sender, str) or not 0 < len(sender) <= 200:
        return False
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        return False
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp):
        return False
    for name, types in fields.items():
        value = message.get(name)
        if name in message and (
            not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        ):
            return False
    return True


class Receiver:
    """Verifies incoming frames (see the module docstring) and counts what it drops, by reason.

    >>> rx = Receiver(key, EVENT_FIELDS, "type")     # doctest: +SKIP
    >>> rx.accept(frames)                            # the message, or None (then rx.dropped says why)  # doctest: +SKIP
    """

    REASONS = ("too_big", "bad_signature", "malformed", "replay", "stale")

    def __init__(
        self,
        key: bytes,
        fields: Fields,
        required: str,
        *,
        max_bytes: int = MAX_MESSAGE_BYTES,
        max_age_s: float = MAX_AGE_S,
    ) -> None:
        self.key, self.fields, self.required = key, fields, required
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.dropped: Counter[str] = Counter()
        self._last: OrderedDict[str, int] = OrderedDict()

    def accept(self, frames: list[bytes]) -> dict[str, Any] | None:
        """The verified message of ``frames``, or None (counted in ``dropped``)."""
        reason = self._check(frames)
        if isinstance(reason, str):
            self.dropped[reason] += 1
            return None
        return reason

    def _check(self, frames: list[bytes]) -> dict[str, Any] | str:
        if sum(len(f) for f in frames) > self.max_bytes:
            return "too_big"
        if len(frames) != 2:
            return "malformed"
        signature, payload = frames
        if not hmac.compare_digest(signature, sign(self.key, payload)):
            return "bad_signature"
        try:
            message = json.loads(payload, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return "malformed"
        if not _well_formed(message, self.fields, self.required):
            return "malformed"
        sender, seq = message["sender"], message["seq"]
        last = self._last.get(sender)
        if last is not None and seq <= last:
            return "replay"
        if abs(time.time() - message["time"]) > self.max_age_s:
            return "stale"
        self._last[sender] = seq
        self._last.move_to_end(sender)
        while len(self._last) > MAX_SENDERS:
            self._last.popitem(last=False)
        return message  # type: ignore[no-any-return]


class EventLog:
    """Append-only JSON lines: ``RUN_DIR/events/rank{r}.jsonl``, flushed per write.

    >>> log = EventLog(Path("/tmp/run/events/rank0.jsonl"))   # doctest: +SKIP
    >>> log.write({"type": "hello", "rank": 0})                # doctest: +SKIP
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, event: dict[str, Any]) -> None:
        """Append one event as one line (a full disk must not stop training: errors are ignored)."""
        try:
            self._file.write(json.dumps(event, separators=(",", ":"), default=str) + "\n")
            self._file.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_log(path: Path) -> Iterator[dict[str, Any]]:
    """The events of one log file; a torn last line (a rank killed mid-write) is skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of a run directory (all ranks, all launches), ordered by wall time."""
    events = [e for p in sorted(Path(run_dir).glob("events/*.jsonl")) for e in read_log(p)]
    return sorted(events, key=lambda e: float(e.get("time", 0.0)))


def write_controller_info(run_dir: Path, info: dict[str, Any]) -> Path:
    """Write ``RUN_DIR/controller.json`` readable by its owner only (it holds the job's key)."""
    path = Path(run_dir) / CONTROLLER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f, indent=1)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def read_controller_info(run_dir: Path) -> dict[str, Any] | None:
    """``RUN_DIR/controller.json``, or None when the run was not started by a controller."""
    try:
        info = json.loads((Path(run_dir) / CONTROLLER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
