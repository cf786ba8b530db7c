"""``python -m varuna.bench telemetry``: what the workers' telemetry costs, and how fast the workbench redraws.

    driver   the settings (`TelemetryBench`, `full`, `quick`), the job under a live JobController,
             the overhead estimate (`analyse`), the widget refresh, the report
    worker   what every rank of the job runs: telemetry switched on and off step by step

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.telemetry.driver import TelemetryBench, analyse, format_table, full, main, quick, run

__all__ = ["TelemetryBench", "full", "quick", "run", "analyse", "format_table", "main"]
