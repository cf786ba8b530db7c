"""A host-availability trace: when spot nodes come, go without warning, or get a preemption notice.

    0,add,n1                 Bamboo's public traces (ms,add|remove,node), read as they are
    100000,notice,n4,40000   a notice at 100 s: n4 is taken 40 s later (the replay removes it then)
    230000,remove,n3         taken without warning
    600000,end               optional: where the trace ends (else at its last event)

Lines starting with # and blank lines are ignored; a header line of words (``ms,event,node``) too.
Node names are the trace's own (Bamboo's are addresses); the bench maps the first ones it meets onto
its hosts (`Trace.nodes`). `availability` gives the intervals between changes with the nodes present,
which the bench's ideal is computed over.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from varuna.errors import ConfigError

__all__ = ["Event", "Trace", "read_trace", "DEFAULT_TRACE", "QUICK_TRACE"]

DEFAULT_TRACE = Path(__file__).with_name("default_trace.csv")
QUICK_TRACE = Path(__file__).with_name("quick_trace.csv")
"""The `--quick` run's trace: two nodes, 28 s, a notice, a return and an unannounced removal."""
_KINDS = ("add", "remove", "notice", "end")


@dataclass(frozen=True, slots=True)
class Event:
    """One change at `at_s` seconds of trace time; a notice's node is taken `lead_s` later."""

    at_s: float
    kind: str
    node: str
    lead_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Trace:
    events: tuple[Event, ...]
    end_s: float
    source: str

    @property
    def nodes(self) -> list[str]:
        """The nodes in the order they first appear."""
        return list(dict.fromkeys(e.node for e in self.events if e.node))

    def scaled(self, duration_s: float, nodes: int) -> Trace:
        """This trace stretched to last `duration_s` seconds, over its first `nodes` nodes only."""
        keep = set(self.nodes[:nodes])
        factor = duration_s / self.end_s
        events = tuple(
            Event(e.at_s * factor, e.kind, e.node, e.lead_s * factor) for e in self.events if e.node in keep
        )
        return Trace(events, duration_s, self.source)

    def removals(self, *, notices: bool) -> list[Event]:
        """The changes as the replay makes them: a notice becomes its notice (with `notices`) and a
        removal `lead_s` later; sorted by time."""
        out: list[Event] = []
        for e in self.events:
            if e.kind == "notice":
                if notices:
                    out.append(e)
                out.append(Event(e.at_s + e.lead_s, "remove", e.node))
            elif e.kind in ("add", "remove"):
                out.append(e)
        return sorted(out, key=lambda e: (e.at_s, e.kind != "remove"))

    def availability(self) -> list[tuple[float, float, frozenset[str]]]:
        """(start, end, nodes present) for every interval between changes, up to `end_s`."""
        present: set[str] = set()
        spans, t = [], 0.0
        for e in self.removals(notices=False):
            if e.at_s > t:
                spans.append((t, min(e.at_s, self.end_s), frozenset(present)))
                t = e.at_s
            if e.at_s >= self.end_s:
                break
            (present.add if e.kind == "add" else present.discard)(e.node)
        if t < self.end_s:
            spans.append((t, self.end_s, frozenset(present)))
        return [s for s in spans if s[1] > s[0]]


def read_trace(path: Path) -> Trace:
    """A trace file (see the module docstring), or a ConfigError naming the line that is wrong."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--trace {path}: cannot read it ({exc.strerror or exc})") from None
    events, end = [], None
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(",")]
        if number == 1 and not parts[0].replace(".", "", 1).isdigit():
            continue  # a header
        try:
            at_s = float(parts[0]) / 1000.0
            kind = parts[1]
            if kind not in _KINDS or at_s < 0:
                raise ValueError
            if kind == "end":
                end = at_s
                continue
            node = parts[2]
            lead_s = float(parts[3]) / 1000.0 if kind == "notice" else 0.0
            if not node or lead_s < 0 or (kind != "notice" and len(parts) > 3):
                raise ValueError
        except (ValueError, IndexError):
            raise ConfigError(
                f"--trace {path} line {number}: expected `ms,add|remove,node`, `ms,notice,node,lead_ms` or "
                f"`ms,end`, got {raw.strip()!r}"
            ) from None
        events.append(Event(at_s, kind, node, lead_s))
    if not events:
        raise ConfigError(f"--trace {path} has no event: expected lines of `ms,add|remove,node`")
    last = max(e.at_s + e.lead_s for e in events)
    end_s = end if end is not None else last
    if end_s <= 0:
        raise ConfigError(f"--trace {path} ends at 0 ms: add a `ms,end` line or later events")
    return Trace(tuple(sorted(events, key=lambda e: e.at_s)), end_s, str(path))
