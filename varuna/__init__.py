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
__version__ = "0.1.0"

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
    from varuna import data
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
    if name == "data":
        return importlib.import_module("varuna.data")
    if name == "simulate":  # the simulator's module, by the path it had before varuna.planner existed
        return importlib.import_module("varuna.planner.simulator")
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'varuna' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
