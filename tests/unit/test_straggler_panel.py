"""The workbench's straggler panel (widgets/varuna_widgets/stragglers.py) in plain pytest: the heatmap's
traces from a compute grid, the flagged host named, and the button calling exclude_host."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from varuna_widgets.stragglers import StragglerPanel, heatmap_layout, heatmap_traces  # noqa: E402

from varuna.telemetry.stragglers import ComputeGrid  # noqa: E402

GRID = ComputeGrid([3, 4, 5], [0, 1], {0: "h1", 1: "h2"}, [[0.010, 0.011, None], [0.030, 0.031, 0.032]])
FLAG = {"id": "a", "type": "straggler", "rank": 1, "host": "h2", "ratio": 2.9, "steps": [2, 3, 4], "step": 4}


def test_heatmap_has_a_row_per_rank_named_by_host_in_ms_and_marks_the_slow_steps() -> None:
    heat, marks = heatmap_traces(GRID, [FLAG])
    assert heat["type"] == "heatmap"
    assert heat["y"] == ["rank 0 @ h1", "rank 1 @ h2"] and heat["x"] == [3, 4, 5]
    assert heat["z"] == [[10.0, 11.0, None], [30.0, 31.0, 32.0]]
    assert (marks["x"], marks["y"]) == ([3, 4], ["rank 1 @ h2"] * 2)  # step 2 is off the grid
    title = heatmap_layout(GRID, [FLAG])["title"]["text"]
    assert title == "straggler: rank 1 on host h2 (2.9x its peers since step 2)"
    assert heatmap_layout(GRID)["title"]["text"].endswith("no straggler")


class FakeController:
    def __init__(self) -> None:
        self.flagged: list[dict] = []
        self.excluded: list[str] = []

    def stragglers(self) -> list[dict]:
        return self.flagged

    def compute_grid(self, last_steps: int = 50) -> ComputeGrid:
        return GRID

    def exclude_host(self, host: str) -> str:
        self.excluded.append(host)
        return "morphing"


def test_the_button_is_enabled_by_a_flag_and_excludes_that_host() -> None:
    ctl = FakeController()
    ran: list[str] = []
    panel = StragglerPanel(lambda label, fn: ran.append(fn()), lambda: ctl)  # type: ignore[arg-type, return-value]
    assert panel.draw(ctl) is True  # type: ignore[arg-type]
    assert panel.button.disabled and panel.line.value == ""
    assert panel.draw(ctl) is False  # type: ignore[arg-type]  # nothing changed: no redraw
    ctl.flagged = [FLAG]
    assert panel.draw(ctl) is True  # type: ignore[arg-type]
    assert not panel.button.disabled and "rank 1 on host h2" in panel.line.value
    assert panel.figure.layout["title"]["text"].startswith("straggler: rank 1 on host h2")
    panel.button.click()
    assert ctl.excluded == ["h2"] and ran == [
        "excluding host h2: checkpoint, then relaunch on the other hosts (morphing)"
    ]


def test_the_workbench_shows_the_panel(tmp_path: Path) -> None:
    from test_widgets import fed

    ctl, wb = fed(tmp_path, background=False)
    try:
        assert wb.stragglers.view in wb.view.children
        wb.refresh(force=True)
        assert wb.stragglers.button.disabled  # no launch, no flag
    finally:
        wb.close()
        ctl.close()
