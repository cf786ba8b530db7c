"""``python -m varuna.bench standin``: what the stand-ins cost a stage's forward on real models.

driver   the settings (`StandinBench`, `full`, `quick`), one `varuna run` job per P, the report
worker   what every rank of a job runs: a transformers model cut by `auto_cut`, its stage timed
"""

from __future__ import annotations

from varuna.bench.standin.driver import StandinBench, format_table, full, main, quick, run

__all__ = ["StandinBench", "full", "quick", "run", "format_table", "main"]
