"""``python -m varuna.bench faults``: faults, attacks and bad inputs against the real library.

    suite         every case (`all_cases`), the selection (`select`), the run and the table
    case          what a case is (`Case`, `Result`) and the small observers the case modules share
    checkpoints   forged files, `latest` pointing elsewhere, damage, a full disk
    wire          the signed channel and process identity: forged, replayed, oversize, stale
    inputs        bad input: typed errors that say what was expected and what to change
    jobs          real multi-rank jobs: killed and stopped processes, crashes, leaked keys
    train         the training script the job cases launch (``varuna run`` it by path)

The method is the suite's docstring.
"""

from __future__ import annotations

from varuna.bench.faults.suite import all_cases, main, run_cases, select, table

__all__ = ["all_cases", "select", "run_cases", "table", "main"]
