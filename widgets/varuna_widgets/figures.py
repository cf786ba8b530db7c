"""What the workbench draws, as plain Plotly dicts computed from the controller's views.

Pure functions (no ipywidgets, no plotly import): the tests check them directly and the
`Workbench` hands their output to its `PlotView`s, each figure replaced whole.

    timeline  one row per (stage, replica), stage 0 on top; one bar trace per span kind, so a
              refresh replaces a fixed set of arrays instead of adding traces; the gaps are the
              bubbles; a prediction from `varuna.planner.simulator` can be drawn under the measured spans.
    bubbles   per stage, the measured step's idle time (fill/drain, communication wait, imbalance)
              stacked beside the simulator's prediction for the schedule that ran, with the theory.
    memory    stacked bars per stage (parameters, gradients, optimizer, activations) + peak marker.
    curves    loss and samples/s against the step, old points thinned; a line where the job was
              relaunched in a new shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from varuna.telemetry import StageMemory, StepBubbles, StepMetrics, Timeline

__all__ = [
    "SPAN_KINDS",
    "COLORS",
    "row_label",
    "timeline_traces",
    "predicted_traces",
    "timeline_layout",
    "memory_traces",
    "curve_traces",
    "relaunch_marks",
    "thin",
    "theoretical_bubble",
    "bubble_figure",
]

SPAN_KINDS = ("F", "B", "W", "R", "send", "recv", "allreduce", "optim")
"""Measured span kinds, in legend order."""
COLORS = {
    "F": "#4C78A8",
    "B": "#F58518",
    "W": "#FFBF79",
    "R": "#B279A2",
    "send": "#54A24B",
    "recv": "#9D9D9D",
    "allreduce": "#E45756",
    "optim": "#72B7B2",
}
_NAMES = {
    "F": "forward",
    "B": "backward",
    "W": "weight gradients",
    "R": "recompute",
    "send": "send",
    "recv": "recv (wait)",
    "allreduce": "all-reduce",
    "optim": "optimizer",
}
_WIDTH = {"send": 0.22, "recv": 0.22}
_PREDICTED = {"F": "F", "B": "B", "W": "W", "R": "R", "ALLREDUCE": "allreduce"}
_MIB = 1024 * 1024


def row_label(stage: int, replica: int) -> str:
    """The timeline's row name: "stage 1 · replica 0"."""
    return f"stage {stage} · replica {replica}"


def theoretical_bubble(pipeline: int, microbatches: int, schedule: str = "1f1b") -> float:
    """The schedule's theoretical idle fraction from the registry (`varuna.schedule.bubble_fraction`):
    (P-1)/(M+P-1) for GPipe, 1F1B and Varuna; smaller for zero-bubble and interleaved schedules."""
    from varuna.schedule import bubble_fraction

    return bubble_fraction(schedule, pipeline, microbatches)  # type: ignore[arg-type]


def timeline_traces(timeline: Timeline, *, origin: float | None = None) -> list[dict[str, Any]]:
    """One horizontal bar trace per kind in `SPAN_KINDS` (always all of them, maybe empty).

    x is the duration and `base` the start, both in milliseconds from `origin` (default: the
    timeline's first span); y is `row_label(stage, replica)`.
    """
    t0 = timeline.start if origin is None else origin
    out: dict[str, dict[str, list[Any]]] = {
        k: {"x": [], "base": [], "y": [], "customdata": []} for k in SPAN_KINDS
    }
    pipeline = max((r.stage for r in timeline.rows), default=0) + 1
    patterns: dict[str, list[str]] = {k: [] for k in SPAN_KINDS}
    for row in timeline.rows:
        label = row_label(row.stage, row.replica)
        for s in row.spans:
            cols = out.get(s.kind)
            if cols is None:
                continue
            cols["base"].append(round((s.start - t0) * 1e3, 3))
            cols["x"].append(round(max(s.end - s.start, 0.0) * 1e3, 3))
            cols["y"].append(label)
            cols["customdata"].append(
                [
                    s.step,
                    "" if s.microbatch is None else s.microbatch,
                    s.direction or "",
                    row.rank,
                    _chunk(s.vstage),
                ]
            )
            patterns[s.kind].append(_pattern(s.vstage, pipeline))
    return [
        {
            "type": "bar",
            "orientation": "h",
            "name": _NAMES[kind],
            "legendgroup": kind,
            "marker": _marker(COLORS[kind], patterns[kind]),
            "width": _WIDTH.get(kind, 0.8),
            "hovertemplate": f"{_NAMES[kind]} %{{customdata[2]}}%{{customdata[1]}}%{{customdata[4]}}<br>step "
            "%{customdata[0]}, rank %{customdata[3]}<br>%{base:.1f} ms + %{x:.2f} ms<extra></extra>",
            **cols,
        }
        for kind, cols in out.items()
    ]


def _chunk(vstage: Any) -> str:
    """Hover text naming the virtual stage of a span (several chunks per rank), else nothing."""
    return "" if vstage is None else f" (stage {vstage})"


def _pattern(vstage: Any, pipeline: int) -> str:
    """A rank's later chunk (virtual stage >= P) is hatched; its first chunk and one-chunk spans are solid."""
    return "/" if vstage is not None and int(vstage) >= pipeline else ""


def _marker(color: str, patterns: list[str], **extra: Any) -> dict[str, Any]:
    marker: dict[str, Any] = {"color": color, "line": {"width": 0}, **extra}
    if any(patterns):  # per bar: hatched for the later chunk
        marker["pattern"] = {"shape": patterns, "fillmode": "overlay", "fgcolor": "#333", "solidity": 0.35}
    return marker


def predicted_traces(
    events: Sequence[dict[str, Any]], *, offset_ms: float = 0.0, replica: int = 0
) -> list[dict[str, Any]]:
    """The planner's prediction (`varuna.planner.simulator.Timeline.to_events()`) as outlined bars on the
    measured rows of `replica`, shifted by `offset_ms` (align it with a measured step's start)."""
    out: dict[str, dict[str, list[Any]]] = {
        k: {"x": [], "base": [], "y": []} for k in ("F", "B", "W", "R", "allreduce")
    }
    pipeline = max((int(e["stage"]) for e in events), default=0) + 1
    patterns: dict[str, list[str]] = {k: [] for k in out}
    for e in events:
        kind = _PREDICTED.get(str(e["kind"]))
        if kind is None:
            continue
        out[kind]["base"].append(round(offset_ms + float(e["start"]) * 1e3, 3))
        out[kind]["x"].append(round((float(e["end"]) - float(e["start"])) * 1e3, 3))
        out[kind]["y"].append(row_label(int(e["stage"]), replica))
        out[kind].setdefault("text", []).append(_chunk(e.get("vstage")))
        patterns[kind].append(_pattern(e.get("vstage"), pipeline))
    return [
        {
            "type": "bar",
            "orientation": "h",
            "name": f"predicted {_NAMES[kind]}",
            "legendgroup": f"predicted-{kind}",
            "marker": _marker("rgba(0,0,0,0)", patterns[kind], line={"width": 1.5, "color": COLORS[kind]}),
            "width": 0.95,
            "textposition": "none",
            "hovertemplate": f"predicted {_NAMES[kind]}%{{text}}<br>%{{base:.1f}} ms + %{{x:.2f}} ms<extra></extra>",
            **cols,
        }
        for kind, cols in out.items()
    ]


def timeline_layout(
    timeline: Timeline, *, title: str, step_starts_ms: Sequence[float] = ()
) -> dict[str, Any]:
    """Axis, title and step separators for `timeline` (rows sorted replica-major, stage 0 on top)."""
    labels = [
        row_label(r.stage, r.replica) for r in sorted(timeline.rows, key=lambda r: (r.replica, r.stage))
    ]
    return {
        "title": {"text": title, "font": {"size": 13}},
        "barmode": "overlay",
        "xaxis": {"title": {"text": "ms"}, "zeroline": False},
        "yaxis": {
            "type": "category",
            "categoryorder": "array",
            "categoryarray": labels,
            "autorange": "reversed",
        },
        "shapes": [_vline(x, dash="dot", color="#888") for x in step_starts_ms],
    }


def _vline(x: float, *, dash: str, color: str) -> dict[str, Any]:
    """A thin vertical line across the whole plot at data x = `x`."""
    return {
        "type": "line",
        "xref": "x",
        "yref": "paper",
        "x0": x,
        "x1": x,
        "y0": 0,
        "y1": 1,
        "line": {"dash": dash, "width": 1, "color": color},
    }


_IDLE_PARTS = (
    ("fill_drain_s", "fill/drain", "#9ECAE9", "before the stage's first compute and after its last"),
    ("comm_wait_s", "communication wait", "#E45756", "waiting for activations or gradients"),
    ("imbalance_s", "stage imbalance", "#EECA3B", "waiting while a slower stage works"),
)


def bubble_figure(bubbles: StepBubbles) -> dict[str, Any]:
    """The bubble figure: per stage two stacked bars, measured and predicted (hatched), each split
    into fill/drain, communication wait and imbalance as a percent of the step, and a dashed line
    at the schedule's theoretical idle share. `bubbles` comes from `varuna.telemetry.bubbles.compare_step`
    (one step's spans and the schedule, P and M that ran); returns `{"data": [...], "layout": {...}}`.
    """
    stages = sorted(bubbles.measured)
    x: list[list[str]] = [[], []]
    rows: list[tuple[str, dict[str, float]]] = []
    for s in stages:
        for which, parts in (("measured", bubbles.measured), ("predicted", bubbles.predicted)):
            x[0].append(f"stage {s}")
            x[1].append(which)
            rows.append((which, parts.get(s, {})))
    traces = []
    for key, name, color, meaning in _IDLE_PARTS:
        y, custom = [], []
        for (which, part), stage in zip(rows, x[0]):
            step_s = part.get("step_s") or 0.0
            idle = step_s - part.get("busy_s", 0.0)
            y.append(round(100 * part.get(key, 0.0) / step_s, 3) if step_s else None)
            custom.append(
                [
                    f"{stage} {which}",
                    round(part.get(key, 0.0) * 1e3, 3),
                    round(step_s * 1e3, 3),
                    round(100 * idle / step_s, 2) if step_s else 0.0,
                ]
            )
        traces.append(
            {
                "type": "bar",
                "name": name,
                "x": x,
                "y": y,
                "customdata": custom,
                "marker": _marker(color, ["/" if w == "predicted" else "" for w in x[1]]),
                "hovertemplate": f"%{{customdata[0]}}<br>{name}: %{{y:.1f}}% of the step "
                "(%{customdata[1]:.2f} of %{customdata[2]:.2f} ms)"
                f"<br>{meaning}<br>idle in all: %{{customdata[3]:.1f}}%<extra></extra>",
            }
        )
    theory = 100 * bubbles.theory
    where = f"{bubbles.schedule}, P={bubbles.pipeline}, M={bubbles.microbatches}"
    step = "" if bubbles.step is None else f"step {bubbles.step}: "
    layout = {
        "barmode": "stack",
        "title": {
            "text": f"{step}idle share per stage, measured vs predicted ({where})",
            "font": {"size": 13},
        },
        "xaxis": {"type": "multicategory"},
        "yaxis": {"title": {"text": "% of the step"}, "rangemode": "tozero"},
        "shapes": [
            {
                "type": "line",
                "xref": "paper",
                "yref": "y",
                "x0": 0,
                "x1": 1,
                "y0": theory,
                "y1": theory,
                "line": {"dash": "dash", "width": 1.5, "color": "#333"},
            }
        ],
        "annotations": [
            {
                "xref": "paper",
                "yref": "y",
                "x": 1,
                "y": theory,
                "xanchor": "right",
                "yanchor": "bottom",
                "showarrow": False,
                "text": f"theory {theory:.1f}% ({where})",
                "font": {"size": 11},
            }
        ],
    }
    return {"data": traces, "layout": layout}


def memory_traces(memory: Sequence[StageMemory]) -> list[dict[str, Any]]:
    """Stacked MiB per stage (parameters, gradients, optimizer, activations) and a peak marker
    (the CUDA allocator's peak on GPU, the process's peak RSS on CPU)."""
    x = [f"stage {m.stage}" for m in memory]
    parts = [
        ("parameters", "params", "#4C78A8"),
        ("gradients", "grads", "#F58518"),
        ("optimizer", "optimizer", "#54A24B"),
        ("activations", "activations", "#B279A2"),
    ]
    traces: list[dict[str, Any]] = [
        {
            "type": "bar",
            "name": name,
            "x": x,
            "y": [round(getattr(m, attr) / _MIB, 3) for m in memory],
            "marker": {"color": color},
            "hovertemplate": f"{name} %{{y:.1f}} MiB<extra>%{{x}}</extra>",
        }
        for name, attr, color in parts
    ]
    peaks = [m.cuda_peak if m.cuda_peak is not None else m.peak_rss for m in memory]
    on_gpu = any(m.cuda_peak is not None for m in memory)
    traces.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "peak (CUDA allocator)" if on_gpu else "peak RSS (process)",
            "x": x,
            "y": [None if p is None else round(p / _MIB, 3) for p in peaks],
            "marker": {"symbol": "line-ew-open", "size": 28, "line": {"width": 3}, "color": "#222"},
            "hovertemplate": "peak %{y:.1f} MiB<extra>%{x}</extra>",
        }
    )
    return traces


def thin(xs: Sequence[Any], ys: Sequence[Any], max_points: int) -> tuple[list[Any], list[Any]]:
    """At most `max_points` points: the newest half kept whole, the older part decimated evenly.

    >>> thin(list(range(10)), list(range(10)), 6)
    ([0, 3, 6, 7, 8, 9], [0, 3, 6, 7, 8, 9])
    """
    n = len(xs)
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    if n <= max_points:
        return list(xs), list(ys)
    recent = max_points // 2
    old_n, keep_old = n - recent, max_points - recent
    idx = [round(i * (old_n - 1) / max(keep_old - 1, 1)) for i in range(keep_old)] if keep_old > 1 else [0]
    idx = sorted(set(idx)) + list(range(old_n, n))
    return [xs[i] for i in idx], [ys[i] for i in idx]


def curve_traces(metrics: Sequence[StepMetrics], *, max_points: int = 400) -> list[dict[str, Any]]:
    """Loss (left axis) and samples/s (right axis) against the step, thinned to `max_points`."""
    steps = [m.step for m in metrics]
    sx, loss = thin(steps, [m.loss for m in metrics], max_points)
    tx, rate = thin(steps, [m.samples_per_s for m in metrics], max_points)
    return [
        {
            "type": "scatter",
            "mode": "lines",
            "name": "loss",
            "x": sx,
            "y": loss,
            "line": {"color": "#4C78A8"},
        },
        {
            "type": "scatter",
            "mode": "lines",
            "name": "samples/s",
            "x": tx,
            "y": rate,
            "yaxis": "y2",
            "line": {"color": "#F58518", "width": 1},
        },
    ]


def relaunch_marks(hellos: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Shapes and annotations marking each launch after the first: where (the step it resumed at)
    and in what shape ("4×1"), from the rank-0 `hello` events of each launch."""
    firsts: dict[Any, dict[str, Any]] = {}
    for e in hellos:
        if e.get("rank") == 0:
            firsts.setdefault((e.get("job"), e.get("launch")), e)
    shapes, notes = [], []
    for e in list(firsts.values())[1:]:
        x = int(e.get("step") or 0)
        shapes.append(_vline(x, dash="dash", color="#666"))
        notes.append(
            {
                "x": x,
                "y": 1,
                "xref": "x",
                "yref": "paper",
                "text": f"{e.get('pipeline')}×{e.get('data')}",
                "showarrow": False,
                "yanchor": "bottom",
                "font": {"size": 11},
            }
        )
    return shapes, notes
