"""The workbench's bubble figure (`figures.bubble_figure`) and its panel, in plain pytest: measured
idle time per stage beside the simulator's prediction, fed synthetic steps (no job, no browser)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from varuna_widgets import Workbench, figures  # noqa: E402
from varuna_widgets.bench import synthetic_step_events  # noqa: E402

from varuna.controller import JobController  # noqa: E402
from varuna.planner.simulator import StageCost, simulate  # noqa: E402
from varuna.telemetry import compare_step, step_spans  # noqa: E402


def simulated_spans(p: int, m: int, comm: float = 0.0) -> dict[int, list[dict]]:
    t = simulate(
        "1f1b",
        p,
        m,
        [StageCost(forward_s=0.01, backward_s=0.02)] * p,
        comm=[comm] * (p - 1),
        split_backward=False,
    )
    return {
        s: [
            {"kind": sp.kind, "start": 5.0 + sp.start, "end": 5.0 + sp.end, "mb": sp.microbatch}
            for sp in spans
        ]
        for s, spans in enumerate(t.spans)
    }


def test_bubble_figure_stacks_measured_and_predicted_per_stage_with_theory() -> None:
    bubbles = compare_step(simulated_spans(3, 6, comm=0.002), "1f1b", 3, 6, step=4)
    fig = figures.bubble_figure(bubbles)
    data, layout = fig["data"], fig["layout"]
    assert [t["name"] for t in data] == ["fill/drain", "communication wait", "stage imbalance"]
    x = data[0]["x"]
    assert x[0] == ["stage 0", "stage 0", "stage 1", "stage 1", "stage 2", "stage 2"]
    assert x[1] == ["measured", "predicted"] * 3
    assert layout["barmode"] == "stack" and layout["xaxis"]["type"] == "multicategory"
    for i, which in enumerate(x[1]):
        part = (bubbles.measured if which == "measured" else bubbles.predicted)[i // 2]
        stacked = sum(t["y"][i] for t in data)
        assert stacked == pytest.approx(100 * (1 - part["busy_s"] / part["step_s"]), abs=0.01)
        assert data[0]["customdata"][i][3] == pytest.approx(stacked, abs=0.02)  # "idle in all" on hover
    assert data[1]["marker"]["pattern"]["shape"] == ["", "/"] * 3  # predicted bars hatched
    assert data[1]["y"][0] > data[1]["y"][1]  # the transfers show as measured communication wait
    (line,) = layout["shapes"]
    assert line["y0"] == line["y1"] == pytest.approx(100 * 2 / 8)
    assert "theory 25.0% (1f1b, P=3, M=6)" == layout["annotations"][0]["text"]
    assert layout["title"]["text"].startswith("step 4: ")
    assert "of the step" in data[0]["hovertemplate"] and "ms" in data[0]["hovertemplate"]


def test_workbench_draws_the_newest_whole_step(tmp_path: Path) -> None:
    ctl = JobController(tmp_path)
    for step in range(3):
        for e in synthetic_step_events(step, 2, 4, t0=1000.0 + step):
            ctl.store.add(e)
    for rank in range(2):
        ctl.store.add(
            {
                "type": "hello",
                "rank": rank,
                "stage": rank,
                "replica": 0,
                "step": 0,
                "job": "bench",
                "launch": 1,
                "seq": 0,
                "time": 999.0,
                "pipeline": 2,
                "data": 1,
                "num_microbatches": 4,
                "schedule": "1f1b",
                "device": "cpu",
            }
        )
    wb = Workbench(controller=ctl, last_steps=2)
    try:
        wb._stop_refresher()
        fig = wb.bubbles_fig
        assert "varuna-bubbles" in fig._dom_classes and fig in wb.view.children
        assert (
            fig.layout["title"]["text"].startswith("step 2: ") and "P=2, M=4" in fig.layout["title"]["text"]
        )
        assert len(fig.data) == 3 and len(fig.data[0]["y"]) == 4
        expected = figures.bubble_figure(
            compare_step(step_spans(ctl.timeline(1)), "1f1b", 2, 4, step=2, sees_arrivals=False)
        )
        assert fig.data == expected["data"]
        # rank 1's spans of step 3 have not come yet: the figure stays on step 2, then moves
        events = synthetic_step_events(3, 2, 4, t0=1003.0)
        ctl.store.add(next(e for e in events if e["type"] == "spans" and e["rank"] == 0))
        wb.refresh()
        assert fig.layout["title"]["text"].startswith("step 2: ")
        for e in events:
            ctl.store.add(e)
        wb.refresh()
        assert fig.layout["title"]["text"].startswith("step 3: ")
    finally:
        wb.close()
