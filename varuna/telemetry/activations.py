"""The peak of activation memory over one step, from the bytes autograd packed and the step's spans."""

from __future__ import annotations

from collections.abc import Sequence

from varuna.schedule import Span, releasing

__all__ = ["activation_peak"]


def activation_peak(packs: Sequence[tuple[float, int]], spans: Sequence[Span]) -> int:
    """Peak bytes saved for backward during the step: F/R of micro-batch m adds what autograd packed
    (`packs`: (time, bytes), in time order) during that span, B of m frees it (W of m, where its
    backward was split); with several chunks per rank, per (micro-batch, virtual stage)."""
    i, held, peak = 0, 0, 0
    live: dict[tuple[int, int | None], int] = {}
    frees = releasing(spans)
    for s in spans:
        key = (s.microbatch or 0, s.stage)
        if s.kind in ("F", "R"):
            size = 0
            while i < len(packs) and packs[i][0] <= s.end:
                if packs[i][0] >= s.start:
                    size += packs[i][1]
                i += 1
            live[key] = live.get(key, 0) + size
            held += size
            peak = max(peak, held)
        elif (s.kind, s.microbatch, s.stage) in frees:
            held -= live.pop(key, 0)
    return peak
