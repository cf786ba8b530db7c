"""The host-load probe of the benchmarks: how many cores other processes kept busy.

The host is shared: the planner bench's driver and every round of its measuring jobs, and the
network bench's driver before its compute profile, compare the host's busy CPU time (/proc/stat)
with their own CPU time, and wait for a quiet moment before they measure.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["host_busy_s", "foreign_cores", "foreign_cores_during", "wait_quiet"]


def host_busy_s() -> float | None:
    """CPU seconds the whole host has spent busy since boot (all cores; None off Linux)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user


def foreign_cores(
    busy_before: float | None, busy_after: float | None, own_cpu_s: float, wall_s: float
) -> float | None:
    """Cores other processes kept busy on average: host busy time minus our own, over the wall time."""
    if busy_before is None or busy_after is None or wall_s <= 0:
        return None
    return max(busy_after - busy_before - own_cpu_s, 0.0) / wall_s


def wait_quiet(max_foreign: float, timeout_s: float, window_s: float = 0.5) -> float | None:
    """Wait (up to `timeout_s`) for a `window_s` in which the host is busier than `max_foreign`
    cores by no one but us (call it while this job idles); returns the last window's load."""
    deadline = time.monotonic() + timeout_s
    while True:
        before, own, t0 = host_busy_s(), time.process_time(), time.perf_counter()
        time.sleep(window_s)
        load = foreign_cores(before, host_busy_s(), time.process_time() - own, time.perf_counter() - t0)
        if load is None or load <= max_foreign or time.monotonic() >= deadline:
            return load


def foreign_cores_during(run: Callable[[], object]) -> float | None:
    """Call `run` (which starts child processes and waits for them); the cores other processes kept
    busy meanwhile: the host's busy time less this process's and its waited-for children's CPU time,
    over the wall time (None off Linux)."""

    def own_cpu_s() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return children.ru_utime + children.ru_stime + time.process_time()

    busy, own, t0 = host_busy_s(), own_cpu_s(), time.perf_counter()
    run()
    return foreign_cores(busy, host_busy_s(), own_cpu_s() - own, time.perf_counter() - t0)
