"""Benchmarks of the library, run as ``python -m varuna.bench SUBCOMMAND``; they report, never gate.

    python -m varuna.bench pipeline --json     # Varuna's schedules vs torch.distributed.pipelining

Each subcommand lives in its own module (`pipeline.py`; `morph`, `planner`, `telemetry` later) and
starts its measured jobs as separate processes, so importing this package costs nothing.
"""

__all__: list[str] = []
