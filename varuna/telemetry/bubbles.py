"""Split a step's idle time per rank into fill/drain, imbalance and communication wait.

Definitions (all in seconds, per rank, within one step ``[step_start, step_end]``):

- ``busy_s``: summed duration of the rank's compute spans (F, B, W, R).
- ``fill_drain_s``: idle before the rank's first compute span plus after its last.
- ``imbalance_s``: the slowest rank's busy time minus this rank's busy time, capped by the idle
  time left after fill/drain (a rank with less work than the slowest must wait that long anyway).
- ``comm_wait_s``: the rest of the idle time inside the rank's compute window, i.e. waiting for
  activations/gradients from neighbours.
So ``busy_s + fill_drain_s + imbalance_s + comm_wait_s == step_s`` for each rank.
"""

from __future__ import annotations

from typing import Any

from varuna.errors import ConfigError

COMPUTE_KINDS = frozenset({"F", "B", "W", "R"})


def bubble_breakdown(
    spans_by_rank: dict[int, list[dict[str, Any]]], step_start: float, step_end: float
) -> dict[int, dict[str, float]]:
    """Per rank ``{"fill_drain_s", "comm_wait_s", "imbalance_s", "busy_s", "step_s"}``."""
    if step_end <= step_start:
        raise ConfigError(
            f"bubble_breakdown needs step_end > step_start, got start={step_start} end={step_end}; "
            "pass the step's measured start and end times"
        )
    step_s = step_end - step_start
    windows: dict[int, tuple[float, float, float]] = {}
    for rank, spans in spans_by_rank.items():
        busy = 0.0
        first, last = step_end, step_start
        for sp in spans:
            if sp.get("kind") not in COMPUTE_KINDS:
                continue
            a = max(float(sp["start"]), step_start)
            b = min(float(sp["end"]), step_end)
            if b <= a:
                continue
            busy += b - a
            first, last = min(first, a), max(last, b)
        windows[rank] = (busy, first, last)
    slowest = max((w[0] for w in windows.values()), default=0.0)
    out: dict[int, dict[str, float]] = {}
    for rank, (busy, first, last) in windows.items():
        if busy == 0.0:
            fill = step_s
        else:
            fill = (first - step_start) + (step_end - last)
        rest = max(step_s - busy - fill, 0.0)
        imb = min(max(slowest - busy, 0.0), rest)
        out[rank] = {
            "fill_drain_s": fill,
            "comm_wait_s": rest - imb,
            "imbalance_s": imb,
            "busy_s": busy,
            "step_s": step_s,
        }
    return out


def timeline_breakdown(timeline: Any) -> dict[int, dict[str, float]]:
    """`bubble_breakdown` of a simulated `varuna.planner.simulator.Timeline` (step from 0 to step_s)."""
    spans = {
        s: [{"kind": sp.kind, "start": sp.start, "end": sp.end} for sp in stage_spans]
        for s, stage_spans in enumerate(timeline.spans)
    }
    return bubble_breakdown(spans, 0.0, float(timeline.step_s))
