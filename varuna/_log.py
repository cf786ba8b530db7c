"""The library's log: `logging.getLogger("varuna")`, rank 0 only by default.

Every message the training library has for a person goes through this logger (the launcher's and
the CLI's console lines are their program's output and stay prints). When the application has not
configured logging for "varuna" (no handler on it or on the root logger), the engine installs one
at start-up (`setup`): messages as they are ("varuna: resumed from ..."), on stdout, at INFO on
rank 0 and WARNING on the other ranks. `VARUNA_LOG_LEVEL` (DEBUG, INFO, WARNING, ...) sets the
level on every rank. An application that configures logging itself keeps full control:

    logging.basicConfig(level=logging.INFO)      # before Varuna(...): varuna's records go there
"""

from __future__ import annotations

import logging
import os
import sys

from varuna.errors import ConfigError

__all__ = ["log", "setup", "LEVEL_ENV"]

log = logging.getLogger("varuna")
LEVEL_ENV = "VARUNA_LOG_LEVEL"
_ours: logging.Handler | None = None


def setup(rank: int) -> None:
    """Give the "varuna" logger a handler and level for this rank, unless the application did."""
    global _ours
    wanted = os.environ.get(LEVEL_ENV)
    level = logging.INFO if rank == 0 else logging.WARNING
    if wanted:
        named = logging.getLevelName(wanted.upper())
        if not isinstance(named, int):
            raise ConfigError(
                f"{LEVEL_ENV}={wanted!r} is not a logging level; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
            )
        level = named
    if _ours is not None:
        log.setLevel(level)
        return
    if log.handlers or logging.getLogger().handlers:
        if wanted:
            log.setLevel(level)
        return  # the application configured logging: its handlers, its format
    _ours = _Stdout()
    _ours.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_ours)
    log.setLevel(level)


class _Stdout(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever `sys.stdout` is when a record comes (a notebook or a test may
    replace it after start-up)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        pass
