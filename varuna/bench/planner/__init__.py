"""``python -m varuna.bench planner``: the planner's predicted step time against the measured one.

    driver   the settings (`PlannerBench`, `full`, `quick`), the profile and measuring jobs, the
             planner's choices, the statistics (`spearman`, `summarize`), the report
    worker   what every rank of a job runs: profile, or train each configuration and predict it
    load     the host-load probe both sides use: the cores other processes kept busy
    scale    ``--scale``: plan times for 8 ... 1024 GPUs of a GPT worked out on paper (no jobs)

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.planner.driver import (
    PlannerBench,
    format_table,
    full,
    main,
    quick,
    run,
    spearman,
    summarize,
)

__all__ = ["PlannerBench", "full", "quick", "run", "spearman", "summarize", "format_table", "main"]
