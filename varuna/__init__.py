"""Varuna: train models too big for one device by cutting them into pipeline stages at CutPoints
and replicating the pipeline for data parallelism.

    import varuna
    engine = varuna.Varuna(model, global_batch_size=32, micro_batch_size=4, example_batch=batch)

`import varuna` imports torch and nothing from Jupyter, ipywidgets or Plotly. Names load lazily, so
the `varuna` command line starts without importing torch until a command needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CutPoint",
    "Varuna",
    "VarunaConfig",
    "data",
    "metrics",
    "make_schedule",
    "auto_cut",
    "consolidate",
    "init_weights",
    "VarunaError",
    "ConfigError",
    "PartitionError",
    "ScheduleError",
    "LaunchError",
    "CheckpointError",
    "MemoryLimitError",
]


def _version() -> str:
    """The installed distribution's version: pyproject.toml is its one source. Read on first use of
    ``varuna.__version__`` (importlib.metadata costs tens of milliseconds that `import varuna` need not pay)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("varuna")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


_WHERE = {
    "CutPoint": "varuna.cut.cutpoint",
    "Varuna": "varuna.auto",
    "VarunaConfig": "varuna.engine.config",
    "make_schedule": "varuna.schedule",
    "auto_cut": "varuna.cut.autocut",
    "consolidate": "varuna.checkpoint.consolidation",
    "init_weights": "varuna.engine.materialize",
    **{
        name: "varuna.errors"
        for name in (
            "VarunaError",
            "ConfigError",
            "PartitionError",
            "ScheduleError",
            "LaunchError",
            "CheckpointError",
            "MemoryLimitError",
        )
    },
}

if TYPE_CHECKING:
    __version__: str

    from varuna import data, metrics
    from varuna.auto import Varuna
    from varuna.checkpoint.consolidation import consolidate
    from varuna.cut.autocut import auto_cut
    from varuna.cut.cutpoint import CutPoint
    from varuna.engine.materialize import init_weights
    from varuna.errors import (
        CheckpointError,
        ConfigError,
        LaunchError,
        MemoryLimitError,
        PartitionError,
        ScheduleError,
        VarunaError,
    )
    from varuna.schedule import make_schedule


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    if name in ("data", "metrics"):
        return importlib.import_module(f"varuna.{name}")
    if name == "simulate":  # the simulator's module, by the path it had before varuna.planner existed
        return importlib.import_module("varuna.planner.simulator")
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'varuna' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
