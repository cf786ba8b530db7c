"""Split a step's idle time per rank into fill/drain, imbalance and communication wait.

Definitions (all in seconds, per rank, within one step ``[step_start, step_end]``):

- ``busy_s``: summed duration of the rank's compute spans (F, B, W, R).
- ``fill_drain_s``: idle before the rank's first compute span plus after its last.
- ``imbalance_s``: the slowest rank's busy time minus this rank's busy time, capped by the idle
  time left after fill/drain (a rank with less work than the slowest must wait that long anyway).
- ``comm_wait_s``: the rest of the idle time inside the rank's compute window, i.e. waiting for
  activations/gradients from neighbours.
So ``busy_s + fill_drain_s + imbalance_s + comm_wait_s == step_s`` for each rank.

`compare_step` puts one measured step's breakdown beside the breakdown of the simulator's
prediction for the same schedule, timed with that step's median costs; the workbench draws the
pair as its bubble figure (`varuna_widgets.figures.bubble_figure`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from varuna.errors import ConfigError

COMPUTE_KINDS = frozenset({"F", "B", "W", "R"})


def bubble_breakdown(
    spans_by_rank: Mapping[int, Sequence[Mapping[str, Any]]], step_start: float, step_end: float
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


@dataclass(frozen=True, slots=True)
class StepBubbles:
    """One measured step's idle time beside the simulator's prediction for the schedule that ran.

    `measured` and `predicted` are `bubble_breakdown`s keyed by stage (rank in the pipeline);
    `theory` is the schedule's textbook idle share (`varuna.schedule.bubble_fraction`); `costs`
    the per-virtual-stage `StageCost`s the prediction was simulated with (medians of the step).
    """

    schedule: str
    pipeline: int
    microbatches: int
    measured: dict[int, dict[str, float]]
    predicted: dict[int, dict[str, float]]
    theory: float
    costs: list[Any]
    step: int | None = None


def step_spans(timeline: Any, step: int | None = None, replica: int = 0) -> dict[int, list[dict[str, Any]]]:
    """One step's spans per stage of `replica`, as dicts, from a measured `varuna.telemetry.Timeline`
    (`JobController.timeline(n)`); `step=None`: the newest step in it."""
    if step is None:
        step = max(timeline.steps, default=None)
    out: dict[int, list[dict[str, Any]]] = {}
    for row in timeline.rows:
        if row.replica != replica:
            continue
        out.setdefault(row.stage, []).extend(
            {"kind": s.kind, "start": s.start, "end": s.end, "mb": s.microbatch, "vstage": s.vstage}
            for s in row.spans
            if s.step == step
        )
    return {s: spans for s, spans in sorted(out.items()) if spans}


def compare_step(
    spans_by_stage: Mapping[int, Sequence[Mapping[str, Any]]],
    schedule: str,
    pipeline: int,
    microbatches: int,
    *,
    step: int | None = None,
    sees_arrivals: bool = True,
) -> StepBubbles:
    """Measured idle time of one step, split as `bubble_breakdown` does, beside a prediction.

    The prediction simulates `schedule` on `pipeline` stages with `microbatches` micro-batches
    (`varuna.planner.simulator.simulate`), each virtual stage costing the step's median F, B, W and
    R durations (recompute and split backwards as the spans show they ran), with free transfers:
    so a measured communication wait above the predicted one is what the transfers cost. The step
    is the window from the first compute span to the last over all stages (the gradient
    all-reduce and the optimizer after it are not pipeline bubbles), in both.

        >>> spans = {0: [{"kind": "F", "start": 0, "end": 1}, {"kind": "B", "start": 4, "end": 6}],
        ...          1: [{"kind": "F", "start": 1, "end": 2}, {"kind": "B", "start": 2, "end": 4}]}
        >>> b = compare_step(spans, "1f1b", 2, 1)
        >>> b.measured[1]["fill_drain_s"], b.predicted[1]["fill_drain_s"]  # waits 1 s, idles 2 s after
        (3.0, 3.0)
    """
    from varuna.planner.simulator import simulate
    from varuna.schedule import bubble_fraction, schedule_spec

    spec = schedule_spec(schedule)  # ScheduleError naming the choices for an unknown one
    theory = bubble_fraction(schedule, pipeline, microbatches)  # type: ignore[arg-type]
    compute = {
        int(s): [sp for sp in spans if sp.get("kind") in COMPUTE_KINDS] for s, spans in spans_by_stage.items()
    }
    if not any(compute.values()):
        raise ConfigError(
            "compare_step got no compute spans (F, B, W, R); pass one step's spans per stage, "
            "e.g. step_spans(controller.timeline(1))"
        )
    if sorted(compute) != list(range(pipeline)):
        raise ConfigError(
            f"compare_step needs spans of stages 0..{pipeline - 1} (pipeline={pipeline}), got stages "
            f"{sorted(compute)}; pass every stage of one replica, or the pipeline depth that ran"
        )
    chunks = spec.chunks_per_rank
    by_vstage: dict[int, list[Mapping[str, Any]]] = {}
    for s, spans in compute.items():
        for sp in spans:
            v = sp.get("vstage")
            if v is None and chunks > 1:
                raise ConfigError(
                    f"{schedule!r} runs {chunks} chunks per rank but a span of stage {s} names no "
                    "vstage; pass spans as the recorder sends them (with their virtual stage)"
                )
            by_vstage.setdefault(s if v is None else int(v), []).append(sp)
    costs = [_median_cost(v, by_vstage.get(v, []), schedule) for v in range(pipeline * chunks)]
    kinds = {sp["kind"] for spans in compute.values() for sp in spans}
    timeline = simulate(
        schedule,  # type: ignore[arg-type]
        pipeline,
        microbatches,
        costs,
        recompute="R" in kinds,
        split_backward="W" in kinds,
        sees_arrivals=sees_arrivals,
    )
    start = min(float(sp["start"]) for spans in compute.values() for sp in spans)
    end = max(float(sp["end"]) for spans in compute.values() for sp in spans)
    if end <= start:
        raise ConfigError(
            f"compare_step: the compute spans cover no time (first start {start}, last end {end}); "
            "pass spans whose end is after their start, in seconds"
        )
    measured = bubble_breakdown(compute, start, end)
    return StepBubbles(
        schedule=schedule,
        pipeline=pipeline,
        microbatches=microbatches,
        measured=measured,
        predicted=timeline_breakdown(timeline),
        theory=theory,
        costs=costs,
        step=step,
    )


def _median_cost(vstage: int, spans: Sequence[Mapping[str, Any]], schedule: str) -> Any:
    """A `StageCost` from one virtual stage's compute spans (`varuna.planner.timeline.measured_cost`:
    median F, B, W and R seconds; whole B = split B + W where every B was split)."""
    from varuna.planner.timeline import measured_cost

    cost = measured_cost(spans)
    if cost is None:
        missing = "F" if not any(sp["kind"] == "F" for sp in spans) else "B"
        raise ConfigError(
            f"virtual stage {vstage} has no {missing} span in this step, so the "
            f"{schedule!r} prediction has no cost for it; pass a whole step's spans (every stage's "
            "event for that step)"
        )
    return cost
