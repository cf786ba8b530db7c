"""`PlotView`: one Plotly figure in a notebook, synced by replacement.

    view = PlotView(data=[{"type": "bar", "x": [1, 2], "y": [3, 4]}], layout={"height": 300})
    view.update(data=[...])          # replaces the whole figure; the browser redraws the newest

Why not plotly's own `FigureWidget`: it syncs deltas (`_py2js_restyle`, `_py2js_relayout`, ...)
that its view applies on top of the state it rendered first, so on a loaded machine a view whose
first render is slow never draws the updates sent meanwhile and stays blank for good while every
other widget updates. Here the only synced state is `figure`, replaced
whole on every update (traitlets sends a replaced value, never a mutated one), and the view draws
the newest value with `Plotly.react` whenever it renders or hears a change (static/plot.js).

plotly.js comes from the installed `plotly` package (`plotly.min.js`), sent to the browser with
the widget and evaluated once per page: nothing is fetched from the network.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import anywidget
from traitlets import Dict, Unicode

__all__ = ["PlotView"]


@functools.cache
def _plotly_js() -> str:
    return (resources.files("plotly") / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


class PlotView(anywidget.AnyWidget):  # type: ignore[misc]
    """A Plotly figure (`data`: trace dicts, `layout`: a layout dict) drawn by plotly.js."""

    _esm = Path(__file__).parent / "static" / "plot.js"
    _plotly_js = Unicode("").tag(sync=True)
    figure = Dict().tag(sync=True)
    """{"data": [trace, ...], "layout": {...}}, as plotly.js takes them; replaced, never mutated."""

    def __init__(
        self,
        data: Sequence[dict[str, Any]] = (),
        layout: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            _plotly_js=_plotly_js(), figure={"data": list(data), "layout": dict(layout or {})}, **kwargs
        )

    @property
    def data(self) -> list[dict[str, Any]]:
        """The traces drawn now (read them; change them with `update`)."""
        return list(self.figure.get("data", []))

    @property
    def layout(self) -> dict[str, Any]:
        """The layout drawn now (read it; change it with `update`)."""
        return dict(self.figure.get("layout", {}))

    def update(
        self, *, data: Sequence[dict[str, Any]] | None = None, layout: dict[str, Any] | None = None
    ) -> None:
        """Replace the traces and/or merge `layout`'s top-level keys into the layout, in one sync."""
        new_data = list(data) if data is not None else self.data
        new_layout = {**self.layout, **(layout or {})}
        self.figure = {"data": new_data, "layout": new_layout}
