"""Telemetry: the recorder on each rank, the signed event format, the channel to the
controller, and the event store the workbench reads (public: the widgets use it)."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "Telemetry": "recorder",
    "EventLog": "events",
    "encode": "events",
    "decode": "events",
    "Channel": "channel",
    "EventStore": "store",
    "RankRow": "store",
    "NoticeView": "store",
    "StageMemory": "store",
    "StepMetrics": "store",
    "Timeline": "store",
    "StepBubbles": "bubbles",
    "compare_step": "bubbles",
    "step_spans": "bubbles",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
