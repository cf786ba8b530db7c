"""The link's rate during the bench's jobs: the parent shapes it, each job asks for every rate in turn.

A job keeps its processes, engines and connections for every rate (one start-up, every system
measured by the same processes), so the rate changes while it runs; and the bench's jobs (one per
placement) are all alive at once and take turns at each rate, so that the systems of different jobs
are measured minutes apart at most, not a whole job apart (a shared host's speed drifts over
minutes). The two sides meet through files in a folder per job on the shared file system (the
ranks see it on every host; only the parent may run `tc`):

    a job (every rank)                      the parent (`LinkSchedule.serve`)
    rank 0 writes want-<i>  ────────────>   for each rate i, for each job in turn:
    every rank waits for go-<i>  <───────     shape the link to rates[i], write that job's go-<i>,
    barrier; measure at rates[i];             wait for its want-<i+1> (it is done with rates[i])
    rank 0 writes want-<i+1> ...            then unshape the link and write every go-<len(rates)>

While one job measures, the others' ranks wait for their go file (polling: no collective to time out).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["LinkSchedule", "wait_rate"]

POLL_S = 0.05


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_rate(folder: Path, index: int, *, ask: bool, timeout_s: float) -> float | None:
    """A job's side: ask for rate `index` (rank 0 only: `ask`) and wait until the parent has set it;
    the rate in Mbit/s (None: unshaped). TimeoutError when no answer comes within `timeout_s`."""
    if ask:
        _write(folder / f"want-{index}", "")
    answer = folder / f"go-{index}"
    deadline = time.monotonic() + timeout_s
    while not answer.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {answer} within {timeout_s:g} s: the bench did not set rate {index}")
        time.sleep(POLL_S)
    rate = json.loads(answer.read_text())["rate"]
    return None if rate is None else float(rate)


class LinkSchedule:
    """The parent's side: ``shape(rate)`` sets the link (None: unshaped; the link starts unshaped),
    `ready` waits until a job asks for a rate, `serve` runs every rate for every job in turn.

    >>> link = LinkSchedule([None, 1000.0, 50.0], shape)      # doctest: +SKIP
    >>> link.serve([folder_a, folder_b], alive=job_is_running)  # doctest: +SKIP
    """

    def __init__(self, rates: Sequence[float | None], shape: Callable[[float | None], None]) -> None:
        self.rates, self.shape = list(rates), shape
        self.current: float | None = None

    def ready(self, folder: Path, index: int, alive: Callable[[Path], bool]) -> None:
        """Wait until the job of `folder` asks for rate `index`; RuntimeError once `alive(folder)`
        says the job ended without asking."""
        asked = folder / f"want-{index}"
        while not asked.exists():
            if not alive(folder) and not asked.exists():
                raise RuntimeError(f"the job of {folder} ended before asking for rate {index}")
            time.sleep(POLL_S)

    def _go(self, folder: Path, index: int, rate: float | None) -> None:
        if rate != self.current:
            self.shape(rate)
            self.current = rate
        _write(folder / f"go-{index}", json.dumps({"rate": rate}))

    def serve(self, folders: Sequence[Path], alive: Callable[[Path], bool]) -> None:
        """Every rate in order; at each, every job in turn measures alone; then the link unshaped
        and every job told it is done."""
        for index, rate in enumerate(self.rates):
            for folder in folders:
                self.ready(folder, index, alive)
                self._go(folder, index, rate)
                self.ready(folder, index + 1, alive)
        for folder in folders:
            self._go(folder, len(self.rates), None)
