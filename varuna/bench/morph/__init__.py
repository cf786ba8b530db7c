"""``python -m varuna.bench morph``: how long a resize takes, from the request to the first step in the new shape.

    config   the settings (`MorphBench`) and presets (`full`, `quick`), and the targets
    job      the elastic `varuna run` job, started and resized from outside as the user would
    worker   the training script every rank of that job runs; rank 0 logs timestamped events
    report   what each reported number means (`DEFINITIONS`), the analysis of the events, the table
    driver   the reference measurements (plain writes, a CRC-32 pass, a one-process dcp.save) and `run`

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.morph.config import MorphBench, full, quick
from varuna.bench.morph.driver import crc_rate, main, plain_write, run
from varuna.bench.morph.report import DEFINITIONS, format_table

__all__ = [
    "MorphBench",
    "full",
    "quick",
    "run",
    "main",
    "plain_write",
    "crc_rate",
    "format_table",
    "DEFINITIONS",
]
