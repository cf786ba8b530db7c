"""How a rank hears a stop: `StopRequest`, set by SIGUSR1/SIGTERM (or a call) and read by the engine at
the end of every step, and the worker's start-up handler that keeps an early SIGUSR1 for it.

The morph protocol (`varuna.elastic.protocol`) is built on it; the worker (`varuna.launch.worker`)
installs `remember_early_stops` first thing, before the script has built its engine.
"""

from __future__ import annotations

import signal
import sys
import threading

__all__ = ["STACKS_SIGNAL", "STOP_SIGNALS", "StopRequest", "remember_early_stops"]

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
STACKS_SIGNAL = signal.SIGUSR2
"""Makes a rank print every thread's Python stack to its stderr and go on (`varuna.launch.worker`
registers it; the launcher sends it to a job that ran past ``--timeout`` before stopping it)."""


class StopRequest:
    """Set by a signal or a call; read by the engine at the end of every step."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def __bool__(self) -> bool:
        return self.reason is not None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def install(self) -> bool:
        """Handle SIGUSR1 and SIGTERM by setting the request (main thread only; else a no-op).

        A SIGUSR1 that arrived before (see `remember_early_stops`) sets the request now, with a log line.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, _frame: self.set(signal.Signals(signum).name))
        if _EARLY:
            self.set(f"{_EARLY.reason} before the engine existed")
            print(
                f"varuna: a stop request ({_EARLY.reason}) arrived before Varuna() existed; "
                "honouring it at the end of the first step",
                file=sys.stderr,
                flush=True,
            )
            _EARLY.reason = None
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
