"""Launching a job: mpiexec and its ranks (`Job`, `run_job`), the worker entry point, and the
post-mortem of a failed rank."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "Job": "job",
    "run_job": "job",
    "Launch": "launches",
    "DeadRank": "launches",
    "ConsoleTail": "launches",
    "post_mortem": "launches",
    "read_reports": "postmortem",
    "summarise": "postmortem",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
