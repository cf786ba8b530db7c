"""``python -m varuna.bench network``: pipelining against data parallelism as the link between hosts slows.

    driver         the settings (`NetworkBench`, `full`, `quick`), the namespace hosts, the compute
                   profile, one job per placement (side by side, taking turns at each rate), the report
    worker         what every rank of a job runs: the compute profile, or each system built once,
                   the network profiled and every system measured at each rate in turn
    rates          the handshake by which the bench shapes the link and gives each job its turn
    ddp_baseline   torch's DistributedDataParallel with gradient accumulation under no_sync()
    planner        the planner's pick at each rate from the profiled network, against the measured best
    report         where the ranks ran, the crossover, the text table with the planner's picks
    plot           samples/s against the rate, one line per system and shape

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.network.driver import JOBS, Job, NetworkBench, full, main, quick, run
from varuna.bench.network.report import crossover, expected_hosts, format_table, placement_of

__all__ = [
    "NetworkBench",
    "Job",
    "JOBS",
    "full",
    "quick",
    "run",
    "main",
    "crossover",
    "expected_hosts",
    "placement_of",
    "format_table",
]
