"""``python -m varuna.bench spot``: a job's goodput while spot machines come and go, against two baselines.

    trace    the host-availability trace (Bamboo's `ms,add|remove,node`, plus notices), scaled to the run
    worker   what every rank runs: a GPT trained until stopped, background checkpoints, resumes
    driver   the hosts, the ideal, one replay per policy (elastic, restart_only, static), the analysis

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.spot.driver import POLICIES, SpotBench, analyse, full, main, quick, run
from varuna.bench.spot.trace import DEFAULT_TRACE, QUICK_TRACE, Event, Trace, read_trace

__all__ = [
    "SpotBench",
    "POLICIES",
    "full",
    "quick",
    "run",
    "main",
    "analyse",
    "Trace",
    "Event",
    "read_trace",
    "DEFAULT_TRACE",
    "QUICK_TRACE",
]
