"""Benchmarks of the library, run as ``python -m varuna.bench SUBCOMMAND``; they report, never gate.

    python -m varuna.bench pipeline --json     # Varuna's schedules vs torch.distributed.pipelining

Each subcommand is a subpackage (`pipeline`, `morph`, `telemetry`, `planner`, `standin`, `memory`,
`faults`, `network`; see `__main__`) whose `main(args)` runs it; it starts its measured jobs as
separate processes (their `worker` modules), so importing this package costs nothing. `common` holds
what several benches share beyond the helpers here; `netns` makes the namespace hosts that the
network bench and the multihost tests run on.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ROOT", "log", "bench_env", "print_report", "require_positive", "split_half_gap"]

ROOT = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the JSON)."""
    print(f"varuna bench: {msg}", file=sys.stderr, flush=True)


def bench_env(timeout_s: int) -> dict[str, str]:
    """The environment of a measured job: one thread, this very `varuna` importable (from a source
    tree or an installed package alike: the folder that holds it), a collective timeout."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        "VARUNA_TIMEOUT": os.environ.get("VARUNA_TIMEOUT", str(timeout_s)),
    }


def print_report(report: dict[str, object], table: str, as_json: bool) -> int:
    """With --json: the table on stderr and one JSON object on stdout; else the table on stdout."""
    import json

    if as_json:
        print(table, file=sys.stderr)
        print(json.dumps(report, indent=1))
    else:
        print(table)
    return 0


def fresh_out(out: Path) -> Path:
    """Make the run's folder `out`; a folder that already holds files is refused (ConfigError): the
    benches read their jobs' event logs back, and a second run's jobs would be read with the first's."""
    from varuna.errors import ConfigError

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out {out} already holds files (an earlier run?): name a new or empty folder, "
            "or leave --out out for a fresh one under runs/"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def require_positive(config: object, *names: str) -> None:
    """Raise ConfigError naming the first of `config`'s fields `names` that is not an int >= 1."""
    from varuna.errors import ConfigError

    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{type(config).__name__}.{name} must be a positive integer (got {value!r})")


def split_half_gap(steps: Sequence[float]) -> float | None:
    """A measurement's own resolution, an A/A check: the relative gap between the medians of its
    alternate timed steps (the 1st, 3rd, ... against the 2nd, 4th, ..., in the order they were timed),
    |a - b| / min(a, b). Both halves are the same configuration over the same stretch of time, so the
    gap is what the host's noise alone moves a median of half the steps: two configurations whose
    medians differ by much less than it are not told apart by the measurement. None with fewer than
    two steps."""
    if len(steps) < 2:
        return None
    a, b = statistics.median(steps[0::2]), statistics.median(steps[1::2])
    return abs(a - b) / min(a, b)
