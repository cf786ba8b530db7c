"""Varuna: train models too big for one device by cutting them into pipeline stages at CutPoints
and replicating the pipeline for data parallelism.

    import varuna
    engine = varuna.Varuna(model, global_batch_size=32, micro_batch_size=4, example_batch=batch)

`import varuna` imports torch and nothing from Jupyter, ipywidgets or Plotly.
"""

from varuna import data
from varuna.cutpoint import CutPoint
from varuna.engine import Varuna
from varuna.errors import (
    CheckpointError,
    ConfigError,
    LaunchError,
    PartitionError,
    ScheduleError,
    VarunaError,
)
from varuna.schedule import make_schedule

__all__ = [
    "CutPoint",
    "Varuna",
    "data",
    "make_schedule",
    "VarunaError",
    "ConfigError",
    "PartitionError",
    "ScheduleError",
    "LaunchError",
    "CheckpointError",
]
__version__ = "0.1.0"
