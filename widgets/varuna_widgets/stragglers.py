"""The workbench's straggler panel: a rank x step heatmap of compute time, the flagged hosts named,
and an "Exclude host" button that relaunches the job without the flagged host.

    heatmap_traces(grid, flagged)   pure: Plotly dicts from `JobController.compute_grid()` and
    heatmap_layout(grid, flagged)   `JobController.stragglers()` (tested without a browser)
    StragglerPanel                  the widgets; `draw(ctl)` redraws when the grid or the flags change

DOM contract: the figure has class `varuna-stragglers`, the line naming flagged hosts
`varuna-straggler-line`, the button is labelled "Exclude host".
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from varuna.telemetry.stragglers import ComputeGrid

if TYPE_CHECKING:
    from varuna.controller import JobController

__all__ = ["heatmap_traces", "heatmap_layout", "flagged_line", "StragglerPanel"]


def _label(rank: int, host: str | None) -> str:
    return f"rank {rank} @ {host or '?'}"


def heatmap_traces(grid: ComputeGrid, flagged: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One heatmap (rows: ranks, labelled with their host, rank 0 on top; columns: steps; colour:
    compute milliseconds) and a marker on each flagged rank's slow steps."""
    labels = [_label(r, grid.hosts.get(r)) for r in grid.ranks]
    z = [[None if v is None else round(v * 1e3, 3) for v in row] for row in grid.values]
    traces: list[dict[str, Any]] = [
        {
            "type": "heatmap",
            "name": "compute ms",
            "x": list(grid.steps),
            "y": labels,
            "z": z,
            "colorscale": "YlOrRd",
            "colorbar": {"title": {"text": "ms"}},
            "hovertemplate": "%{y}<br>step %{x}: %{z} ms<extra></extra>",
        }
    ]
    xs, ys, texts = [], [], []
    for event in flagged:
        shown = [s for s in event.get("steps") or [] if s in grid.steps]
        xs += shown
        ys += [_label(event["rank"], event.get("host"))] * len(shown)
        texts += [f"{event.get('ratio')}x its peers"] * len(shown)
    traces.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "straggler",
            "x": xs,
            "y": ys,
            "text": texts,
            "marker": {"symbol": "x", "size": 9, "color": "#1f1f1f"},
            "hovertemplate": "%{y}<br>step %{x}: %{text}<extra></extra>",
        }
    )
    return traces


def flagged_line(flagged: Sequence[dict[str, Any]]) -> str:
    """One line for people: who is a straggler now, on which host (empty when nobody is)."""
    return "; ".join(
        f"straggler: rank {e['rank']} on host {e.get('host')} ({e.get('ratio')}x its peers since step "
        f"{(e.get('steps') or [e.get('step')])[0]})"
        for e in flagged
    )


def heatmap_layout(grid: ComputeGrid, flagged: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Title naming the flagged hosts, ranks top-down, steps across."""
    title = flagged_line(flagged) or "compute time per rank and step: no straggler"
    return {
        "title": {"text": title, "font": {"size": 13, "color": "#C62828" if flagged else "#333"}},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"autorange": "reversed", "type": "category"},
        "height": max(160, 60 + 24 * len(grid.ranks)),
        "margin": {"l": 130, "r": 20, "t": 40, "b": 40},
        "showlegend": False,
    }


class StragglerPanel:
    """The heatmap, the flagged line and the button. `run_action(label, fn)` is the workbench's way
    of running a button's call off the kernel's thread; `controller()` returns the job's controller
    (or raises, saying why there is none)."""

    def __init__(
        self,
        run_action: Callable[[str, Callable[[], Any]], None],
        controller: Callable[[], JobController],
        *,
        replay: bool = False,
        last_steps: int = 50,
    ) -> None:
        import ipywidgets as w

        from varuna_widgets.plot import PlotView

        self._controller = controller
        self.last_steps = last_steps
        self.flagged: list[dict[str, Any]] = []
        self._key: Any = None
        empty = ComputeGrid([], [], {}, [])
        self.figure = PlotView(data=heatmap_traces(empty), layout=heatmap_layout(empty))
        self.figure.add_class("varuna-stragglers")
        self.line = w.HTML("")
        self.line.add_class("varuna-straggler-line")
        self.button = w.Button(description="Exclude host", icon="ban", button_style="warning", disabled=True)
        self.button.tooltip = (
            "relaunch the job without the flagged host (checkpoint, morph to the hosts left)"
        )
        self.button.on_click(lambda _b: run_action("Exclude host", self.exclude))
        controls = [self.line] if replay else [self.button, self.line]
        self.view = w.VBox([w.HBox(controls), self.figure])

    def exclude(self) -> str:
        """Exclude the first flagged host (the button's action)."""
        if not self.flagged:
            return "no straggler flagged: nothing to exclude"
        host = self.flagged[0].get("host")
        state = self._controller().exclude_host(str(host))
        return f"excluding host {host}: checkpoint, then relaunch on the other hosts ({state})"

    def draw(self, ctl: JobController) -> bool:
        """Redraw when the flags or the grid's last cell changed; True if it did."""
        flagged = ctl.stragglers()
        grid = ctl.compute_grid(self.last_steps)
        key = ([e["id"] for e in flagged], grid.ranks, grid.steps[-1:] if grid.steps else None)
        if key == self._key:
            return False
        self._key, self.flagged = key, flagged
        self.figure.update(data=heatmap_traces(grid, flagged), layout=heatmap_layout(grid, flagged))
        text = flagged_line(flagged)
        self.line.value = f'<b style="color:#C62828">{html.escape(text)}</b>' if text else ""
        self.button.disabled = not flagged
        return True
