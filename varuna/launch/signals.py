"""How a rank hears a stop: `StopRequest`, set by SIGUSR1/SIGTERM (or a call, or rank 0's stop files)
and read by the engine at the end of every step, and the worker's start-up handler that keeps an early
SIGUSR1 for it.

A request either stops at the end of this step, or carries a deadline (a preemption notice: the
host goes away then), which the engine meets by training on while one more step and a checkpoint
still fit before it (`varuna.engine.notice`). SIGUSR1 always stops at the end of the step (a morph);
SIGTERM does too, unless the engine was given a notice window (`notice_s`), when it means "this
host goes away `notice_s` seconds from now".

The morph protocol (`varuna.elastic.protocol`) is built on it; the worker (`varuna.launch.worker`)
installs `remember_early_stops` first thing, before the script has built its engine.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["STACKS_SIGNAL", "STOP_SIGNALS", "Notice", "StopRequest", "remember_early_stops"]

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
STACKS_SIGNAL = signal.SIGUSR2
"""Makes a rank print every thread's Python stack to its stderr and go on (`varuna.launch.worker`
registers it; the launcher sends it to a job that ran past ``--timeout`` before stopping it)."""


@dataclass(frozen=True, slots=True)
class Notice:
    """One stop request with a deadline: the `hosts` (None: all) go away at `deadline` (epoch seconds)."""

    reason: str
    deadline: float
    hosts: tuple[str, ...] | None = None
    received: float = 0.0
    """When this rank heard of it (epoch seconds)."""
    source: str = "call"
    """"signal", "file" (a stop request file, read by rank 0) or "call"."""


class StopRequest:
    """Set by a signal, a call or a stop file; read by the engine at the end of every step.

    `set(reason)` stops at the end of this step (`immediate`); `set(reason, deadline=t)` is a
    notice: the engine stops in time to checkpoint before `t`. The first reason is kept; every
    notice is kept, in arrival order (`notices`), and the earliest deadline counts (`deadline`).
    True once anything was asked.
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self.immediate = False
        self.notices: list[Notice] = []
        self.notice_s: float | None = None
        """With a value, SIGTERM is a notice with the deadline that many seconds after it arrives."""

    def __bool__(self) -> bool:
        return self.reason is not None

    @property
    def deadline(self) -> float | None:
        """The earliest deadline of the notices (None: no notice)."""
        return min((n.deadline for n in self.notices), default=None)

    def set(
        self,
        reason: str,
        *,
        deadline: float | None = None,
        hosts: list[str] | tuple[str, ...] | None = None,
        source: str = "call",
    ) -> None:
        """Ask to stop at the end of this step, or with `deadline` (epoch seconds) in time to
        checkpoint before it; `hosts` are the hosts that go away then (None: all)."""
        if self.reason is None:
            self.reason = reason
        if deadline is None:
            self.immediate = True
            return
        named = None if hosts is None else tuple(sorted(str(h) for h in hosts))
        self.notices.append(Notice(reason, float(deadline), named, time.time(), source))

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and self.notice_s is not None:
            self.set(name, deadline=time.time() + self.notice_s, source="signal")
        else:
            self.set(name, source="signal")

    def install(self, *, notice_s: float | None = None) -> bool:
        """Handle SIGUSR1 and SIGTERM by setting the request (main thread only; else a no-op).

        With `notice_s`, SIGTERM is a notice whose deadline is `notice_s` seconds after it arrives;
        without, it stops at the end of the step, like SIGUSR1. A SIGUSR1 that arrived before (see
        `remember_early_stops`) sets the request now, with a log line.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        self.notice_s = notice_s
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, _frame: self._on_signal(signum))
        if _EARLY:
            self.set(f"{_EARLY.reason} before the engine existed")
            print(
                f"varuna: a stop request ({_EARLY.reason}) arrived before Varuna() existed; "
                "honouring it at the end of the first step",
                file=sys.stderr,
                flush=True,
            )
            _EARLY.reason = None
            _EARLY.immediate = False
        return True


_EARLY = StopRequest()
"""SIGUSR1s received before any engine installed its handler (the worker's start-up)."""


def remember_early_stops() -> bool:
    """Until an engine installs its handler, keep SIGUSR1 (a morph request) instead of dying of it.

    The worker calls this first thing (main thread only; else a no-op, False). The handler only
    records: printing from a signal handler could deadlock on the line tee's lock.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGUSR1, lambda signum, _frame: _EARLY.set(signal.Signals(signum).name))
    return True
