"""Jupyter workbench for Varuna jobs (separate distribution `varuna-widgets`).

    from varuna_widgets import Workbench
    wb = Workbench(["-m", "varuna.demo", "--steps", "100"], pipeline=2, data=2, steps=100)
    wb   # Start, watch the per-stage timeline and memory, Checkpoint, Resize, Resume, Stop

The dependency goes one way: this package imports `varuna` (the controller and its plain-data
views); `varuna` never imports this package, ipywidgets or plotly. `varuna_widgets.figures` holds
the pure functions that turn those views into Plotly traces; `varuna_widgets.bench` measures how
fast the workbench redraws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from varuna_widgets.workbench import Workbench

__all__ = ["Workbench"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Workbench":  # imports ipywidgets and plotly only when asked for
        from varuna_widgets.workbench import Workbench

        return Workbench
    raise AttributeError(f"module 'varuna_widgets' has no attribute {name!r}")
