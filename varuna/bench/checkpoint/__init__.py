"""``python -m varuna.bench checkpoint``: what a background checkpoint costs the training steps, against a blocking one.

    driver   the settings (`CheckpointBench`), the presets (`full`, `quick`), `run`, the table and `main`

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.checkpoint.driver import MODES, CheckpointBench, format_table, full, main, quick, run

__all__ = ["CheckpointBench", "MODES", "full", "quick", "run", "main", "format_table"]
