"""``python -m varuna.bench pipeline``: Varuna's schedules against torch.distributed.pipelining and one process.

    driver           the settings (`PipelineBench`, `full`, `quick`), one `varuna run` job per P, the report
    worker           what every rank of a job runs: each system and schedule, step by step in turn
    torch_baseline   torch.distributed.pipelining's stages cut at Varuna's boundaries, one runner per schedule
    report           ratios, the issue's targets, the compute ceilings, the text table
    step_overhead    a script: the fixed cost of a step outside its schedule (``varuna run`` it by path)

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.pipeline.driver import PipelineBench, full, main, quick, run
from varuna.bench.pipeline.report import compute_ceilings, compute_ratios, format_table

__all__ = [
    "PipelineBench",
    "full",
    "quick",
    "run",
    "main",
    "compute_ratios",
    "compute_ceilings",
    "format_table",
]
