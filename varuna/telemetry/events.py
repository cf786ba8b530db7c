"""The wire and file formats shared by the workers' telemetry and the controller.

    worker ── PUSH [signature, payload] ──> controller PULL      (events, every rank)
    worker <── SUB [signature, payload] ─── controller PUB       (commands, every rank subscribes)
    worker ── append one JSON line ──> RUN_DIR/events/rank{r}.jsonl   (always, controller or not)

``payload`` is compact JSON; ``signature`` is HMAC-SHA256 of the payload with the job's key
(``VARUNA_EVENTS_KEY``, hex). A message whose signature does not verify is dropped, so a process
on the same host that guesses the port can neither inject events nor command the job.
``RUN_DIR/controller.json`` (mode 0600) keeps the addresses and the key, so a restarted notebook
kernel can reattach. This module imports neither zmq nor torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "new_key",
    "sign",
    "encode",
    "decode",
    "EventLog",
    "read_log",
    "read_events",
    "write_controller_info",
    "read_controller_info",
    "free_port",
]

CONTROLLER_FILE = "controller.json"


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
    """The message carried by ``frames``, or None when it is malformed or its signature is wrong."""
    if len(frames) != 2:
        return None
    signature, payload = frames
    if not hmac.compare_digest(signature, sign(key, payload)):
        return None
    try:
        message = json.loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


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
