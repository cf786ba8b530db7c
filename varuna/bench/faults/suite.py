"""``python -m varuna.bench faults``: faults, attacks and bad inputs against the real library.

Each case provokes one thing issue #17 guards against and reports what it observed; ``ok`` is judged
from that observation. The cases live by subject: checkpoints (`checkpoints`), the signed channel
and process identity (`wire`), bad input (`inputs`), and multi-rank jobs (`jobs`, skipped by
``--quick``); `case` says what a case is. Everything is written under one temporary folder, and
every process a case started is ended before the report, whatever happened.

    python -m varuna.bench faults --json             # all cases, one JSON object on stdout
    python -m varuna.bench faults --quick --only ENOSPC

Like every bench it reports and never gates: the exit status is 0 even when a case does not hold.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from varuna.bench import log, print_report
from varuna.bench.faults.case import Case, first_line

__all__ = ["all_cases", "select", "run_cases", "table", "main"]


def all_cases() -> list[Case]:
    from varuna.bench.faults import checkpoints, inputs, jobs, wire

    return checkpoints.cases() + wire.cases() + inputs.cases() + jobs.cases()


def select(cases: list[Case], *, quick: bool, only: str | None) -> list[Case]:
    """The cases to run: without the multi-rank ones under `quick`; those whose name holds `only`."""
    return [c for c in cases if not (quick and c.job) and (only is None or only.lower() in c.name.lower())]


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    from varuna.bench.faults.jobs import JOBS

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="varuna-faults-") as tmp:
        JOBS.root = Path(tmp) / "jobs"
        try:
            for i, case in enumerate(cases):
                folder = Path(tmp) / "cases" / f"{i:02d}"
                folder.mkdir(parents=True)
                t0 = time.monotonic()
                try:
                    ok, observed = case.run(folder)
                except Exception as exc:  # noqa: BLE001 - a case that broke is a finding, not a crash
                    ok, observed = False, f"the case itself raised {first_line(exc)}"
                observed = observed.replace(f"{folder}/", "").replace(tmp, "$TMP")  # no temp paths
                row = {
                    "name": case.name,
                    "kind": case.kind,
                    "expected": case.expected,
                    "observed": observed,
                    "ok": bool(ok),
                    "wall_s": round(time.monotonic() - t0, 2),
                }
                log(f"{'ok  ' if ok else 'FAIL'} {case.name}: {observed}")
                rows.append(row)
        finally:
            JOBS.close()
    return rows


def _stdout_to_stderr(run: Any, *args: Any) -> Any:
    """Run with file descriptor 1 pointing at stderr: the engine and the libraries under test print,
    and stdout must carry the report alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        return run(*args)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def table(rows: list[dict[str, Any]]) -> str:
    width = max((len(r["name"]) for r in rows), default=4)
    lines = [f"{'':4} {'case':{width}}  {'kind':9}  observed"]
    for r in rows:
        lines.append(f"{'ok' if r['ok'] else 'FAIL':4} {r['name']:{width}}  {r['kind']:9}  {r['observed']}")
    lines.append(f"{sum(r['ok'] for r in rows)} of {len(rows)} hold")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from varuna.errors import ConfigError

    start = time.monotonic()
    chosen = select(all_cases(), quick=args.quick, only=getattr(args, "only", None))
    if not chosen:
        raise ConfigError(
            f"--only {args.only!r} matches no case; see `python -m varuna.bench faults` for names"
        )
    log(f"{len(chosen)} cases{' (quick: no multi-rank jobs)' if args.quick else ''}")
    rows = _stdout_to_stderr(run_cases, chosen)
    report = {
        "bench": "faults",
        "quick": bool(args.quick),
        "cases": rows,
        "passed": sum(r["ok"] for r in rows),
        "total": len(rows),
        "wall_s": round(time.monotonic() - start, 1),
    }
    return print_report(report, table(rows), args.json)
