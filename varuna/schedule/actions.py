"""Actions, the stages' lists they form, and their kinds: the vocabulary of every schedule;
`format_grid` draws a schedule."""

from __future__ import annotations

import re
from typing import NamedTuple

from varuna.errors import ScheduleError

__all__ = [
    "Action",
    "Span",
    "Schedule",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "WEIGHT_KIND",
    "WORK_KINDS",
    "KINDS",
    "check_sizes",
]

COMPUTE_KINDS = ("F", "B", "R")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
WEIGHT_KIND = "W"
"""A split backward's weight half (see `split_backwards`); B(m) is then only the input gradient."""
WORK_KINDS = COMPUTE_KINDS + (WEIGHT_KIND,)
"""The kinds that keep a stage's processor busy."""
KINDS = COMPUTE_KINDS + COMM_KINDS + ("ALLREDUCE", WEIGHT_KIND)
_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+)(\d*)$")


class Span(NamedTuple):
    """One executed (runtime) or simulated (planner) action: kind, micro-batch, start and end
    seconds, and the virtual stage it ran for where a rank holds several chunks (else None)."""

    kind: str
    microbatch: int | None
    start: float
    end: float
    stage: int | None = None


class Action(NamedTuple):
    """One step of one stage: `Action(1, "F", 0)` is stage 1's forward of micro-batch 0, text `1F0`."""

    stage: int
    kind: str
    microbatch: int | None  # None only for ALLREDUCE

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse the compact form `"{stage}{kind}{microbatch}"`, e.g. `"0B3"`, `"1SEND_F0"`, `"2ALLREDUCE"`."""
        match = _ACTION_RE.match(text)
        if match is None or match.group(2) not in KINDS:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected '<stage><kind><microbatch>' like '1F0' or "
                f"'0ALLREDUCE', with kind one of {', '.join(KINDS)}"
            )
        stage, kind, mb = match.groups()
        if (kind == "ALLREDUCE") != (mb == ""):
            need = "takes no micro-batch" if kind == "ALLREDUCE" else "needs a micro-batch number"
            raise ScheduleError(f"cannot parse action {text!r}: kind {kind} {need}")
        return cls(int(stage), kind, int(mb) if mb else None)


Schedule = dict[int, list[Action]]


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ScheduleError(
            f"num_stages must be at least 1 (given {num_stages}); set the pipeline depth P >= 1"
        )
    if num_microbatches < 1:
        raise ScheduleError(
            f"num_microbatches must be at least 1 (given {num_microbatches}); "
            "give each replica at least one micro-batch per step"
        )


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """Draw one row per stage, columns by position; the `mark=(stage, index)` cell is shown `[like this]`.

    A mark one past the end of a row points at something missing and is drawn `[?]`.
    """
    if not schedule:
        return "(empty schedule)"
    rows = {s: [str(a) for a in schedule[s]] for s in sorted(schedule)}
    if mark is not None and mark[0] in rows:
        cells = rows[mark[0]]
        if 0 <= mark[1] < len(cells):
            cells[mark[1]] = f"[{cells[mark[1]]}]"
        elif mark[1] == len(cells):
            cells.append("[?]")
    steps = max(len(cells) for cells in rows.values())
    header = [str(i) for i in range(steps)]
    widths = [max(len(c[i]) for c in [header, *rows.values()] if i < len(c)) for i in range(steps)]
    label_w = len(f"stage {max(rows)}")

    def row(prefix: str, label: str, cells: list[str]) -> str:
        body = " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False))
        return f"{prefix}{label.rjust(label_w)} | {body}"

    lines = [row("   ", "step", header)]
    lines += [
        row(">> " if mark and mark[0] == s else "   ", f"stage {s}", cells) for s, cells in rows.items()
    ]
    return "\n".join(line.rstrip() for line in lines)
