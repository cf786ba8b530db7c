"""The exit statuses a job's ranks report and the launcher interprets (`varuna.elastic` builds its
morph protocol on them)."""

from __future__ import annotations

__all__ = ["MORPH_EXIT"]

MORPH_EXIT = 75
"""Exit status of a job that checkpointed on request and is ready to relaunch in a new shape
(EX_TEMPFAIL in sysexits.h: try again)."""
