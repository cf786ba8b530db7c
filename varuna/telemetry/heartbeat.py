"""Heartbeats: each worker says "alive, doing X" every second; the controller notices who went quiet.

    worker                                       controller
    ------                                       ----------
    Beater thread ── heartbeat {rank, host,  ──> Liveness.see(event)   (every event counts as a sign of life)
                     action, action_since}       Liveness.silent(job) -> [SilentRank]  after silent_after_s

The beat comes from a thread of its own, so a rank blocked in a collective keeps beating and its
``action`` says where it waits ("step 7: sent F mb 3"); a rank that beats no more is stopped
(SIGSTOP, a debugger), swapped out, or its host is gone. Times on the controller's side are its own
monotonic clock at arrival, so clock skew between hosts cannot make a rank look silent. A rank that
never said anything is not reported (it may still be importing torch); a rank whose last word was
``exited`` (or an ``exit`` event) is not expected to speak again. This module imports neither zmq
nor torch.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from varuna.errors import ConfigError

__all__ = [
    "Beater",
    "Liveness",
    "SilentRank",
    "heartbeat_interval",
    "watch_silence",
    "DEFAULT_SILENT_AFTER_S",
]

DEFAULT_SILENT_AFTER_S = 10.0
DEFAULT_INTERVAL_S = 1.0


def heartbeat_interval() -> float:
    """``VARUNA_HEARTBEAT_S`` (seconds between beats, default 1; 0 turns heartbeats off)."""
    raw = os.environ.get("VARUNA_HEARTBEAT_S", "").strip()
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"VARUNA_HEARTBEAT_S must be a number of seconds >= 0 (0 turns heartbeats off); got {raw!r}: "
            "set it to e.g. 1, or unset it"
        )
    return value


def check_silent_after(value: Any) -> float:
    """``silent_after_s`` as a float, or a ConfigError that says what to give."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"silent_after_s must be a number of seconds > 0 (a rank silent that long is reported); got {value!r}"
        )
    return float(value)


class Beater:
    """A daemon thread calling ``beat()`` every ``interval_s`` until `stop`; `beat` must not raise."""

    def __init__(self, beat: Callable[[], None], interval_s: float) -> None:
        self._beat, self.interval_s = beat, interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="varuna-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self._beat()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop beating (the beat under way finishes first)."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


@dataclass(frozen=True, slots=True)
class SilentRank:
    """A rank not heard from for `silent_s` seconds; what it said it was doing last."""

    rank: int
    host: str | None
    last_action: str | None
    silent_s: float


@dataclass(slots=True)
class _Seen:
    job: Any
    at: float
    host: str | None = None
    action: str | None = None
    gone: bool = False


class Liveness:
    """When each rank was last heard from (any event), on which host, doing what; thread-safe."""

    def __init__(self, silent_after_s: float = DEFAULT_SILENT_AFTER_S) -> None:
        self.silent_after_s = check_silent_after(silent_after_s)
        self._ranks: dict[int, _Seen] = {}
        self._lock = threading.Lock()

    def see(self, event: dict[str, Any], now: float | None = None) -> None:
        """Note an event that just arrived (events without an int rank are ignored)."""
        rank, kind = event.get("rank"), event.get("type")
        if not isinstance(rank, int) or isinstance(rank, bool):
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._ranks.get(rank)
            if seen is None or seen.job != event.get("job"):
                if seen is not None and kind not in ("hello", "heartbeat"):
                    return  # a late word from an earlier launch
                seen = self._ranks[rank] = _Seen(event.get("job"), now)
            seen.at = now
            if isinstance(event.get("host"), str):
                seen.host = event["host"]
            if kind == "heartbeat" and isinstance(event.get("action"), str):
                seen.action = event["action"]
            seen.gone = kind == "exit" or (kind == "heartbeat" and event.get("action") == "exited")

    def actions(self) -> dict[int, str | None]:
        """Each rank's last reported action (None before its first heartbeat), by rank."""
        with self._lock:
            return {rank: s.action for rank, s in sorted(self._ranks.items())}

    def silent(self, job: Any = None, now: float | None = None) -> list[SilentRank]:
        """Ranks (of launch `job`, when given) silent for more than `silent_after_s`, by rank."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [
                SilentRank(rank, s.host, s.action, now - s.at)
                for rank, s in sorted(self._ranks.items())
                if not s.gone and (job is None or s.job == job) and now - s.at > self.silent_after_s
            ]


def watch_silence(
    silent: Callable[[], list[SilentRank]], note: Callable[..., None], closing: threading.Event
) -> None:
    """Until `closing`: note ``rank_silent`` when a rank goes quiet, ``rank_back`` when it speaks again."""
    quiet: dict[int, SilentRank] = {}
    while not closing.wait(0.25):
        now = {s.rank: s for s in silent()}
        for rank in now.keys() - quiet.keys():
            s = now[rank]
            note(
                "rank_silent",
                silent_rank=rank,
                host=s.host,
                last_action=s.last_action,
                silent_s=round(s.silent_s, 1),
            )
        for rank in quiet.keys() - now.keys():
            note("rank_back", silent_rank=rank, host=quiet[rank].host)
        quiet = now
