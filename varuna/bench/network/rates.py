"""The link's rate during the bench's jobs: the parent shapes it, each job asks for every turn in order.

A job keeps its processes, engines and connections for every rate (one start-up, every system
measured by the same processes), so the rate changes while it runs; and the bench's jobs (one per
placement) are all alive at once and take turns at each rate, so that the systems of different jobs
are measured minutes apart at most, not a whole job apart (a shared host's speed drifts over
minutes). A rate may give each job several turns: the jobs then go in the order A B at the first
turn and B A at the second (A B B A), so that a slow spell of the host a few steps long falls on
every job alike rather than on the one whose turn it was. The two sides meet through files in a
folder per job on the shared file system (the ranks see it on every host; only the parent may run
`tc`); turns are numbered over the whole run:

    a job (every rank)                      the parent (`LinkSchedule.serve`)
    rank 0 writes want-<t>  ────────────>   for each rate, for each of its turns, for each job in
    every rank waits for go-<t>  <───────     that turn's order: shape the link to the rate (once
    barrier; measure at its rate;             per rate), write that job's go-<t>, wait for its
    rank 0 writes want-<t+1> ...              want-<t+1> (it is done with turn t)
                                            then unshape the link and write every go-<last + 1>

While one job measures, the others' ranks wait for their go file (polling: no collective to time out).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from varuna.errors import ConfigError

__all__ = ["LinkSchedule", "wait_rate"]

POLL_S = 0.05


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_rate(folder: Path, index: int, *, ask: bool, timeout_s: float) -> float | None:
    """A job's side: ask for turn `index` (rank 0 only: `ask`) and wait until the parent has set its
    rate; the rate in Mbit/s (None: unshaped). TimeoutError when no answer comes within `timeout_s`."""
    if ask:
        _write(folder / f"want-{index}", "")
    answer = folder / f"go-{index}"
    deadline = time.monotonic() + timeout_s
    while not answer.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {answer} within {timeout_s:g} s: the bench did not start turn {index}")
        time.sleep(POLL_S)
    rate = json.loads(answer.read_text())["rate"]
    return None if rate is None else float(rate)


class LinkSchedule:
    """The parent's side: ``shape(rate)`` sets the link (None: unshaped; the link starts unshaped),
    `ready` waits until a job asks for a turn, `serve` runs every turn of every rate for every job.
    `turns[i]`: how many turns each job takes at `rates[i]` (default one each).

    >>> link = LinkSchedule([None, 1000.0, 50.0], shape, turns=[2, 2, 1])  # doctest: +SKIP
    >>> link.serve([folder_a, folder_b], alive=job_is_running)              # doctest: +SKIP
    """

    def __init__(
        self,
        rates: Sequence[float | None],
        shape: Callable[[float | None], None],
        turns: Sequence[int] | None = None,
    ) -> None:
        self.rates, self.shape = list(rates), shape
        self.turns = [1] * len(self.rates) if turns is None else list(turns)
        if len(self.turns) != len(self.rates) or any(k < 1 for k in self.turns):
            raise ConfigError(f"turns {self.turns}: give one count >= 1 per rate ({len(self.rates)} rates)")
        self.current: float | None = None

    def schedule(self, jobs: int) -> list[tuple[int, float | None, list[int]]]:
        """(turn number, rate, the jobs' order in it) of every turn: A B, then B A, A B, ..."""
        out, t = [], 0
        for rate, turns in zip(self.rates, self.turns, strict=True):
            for k in range(turns):
                order = list(range(jobs))
                out.append((t, rate, order if k % 2 == 0 else order[::-1]))
                t += 1
        return out

    def ready(self, folder: Path, index: int, alive: Callable[[Path], bool]) -> None:
        """Wait until the job of `folder` asks for turn `index`; RuntimeError once `alive(folder)`
        says the job ended without asking."""
        asked = folder / f"want-{index}"
        while not asked.exists():
            if not alive(folder) and not asked.exists():
                raise RuntimeError(f"the job of {folder} ended before asking for turn {index}")
            time.sleep(POLL_S)

    def _go(self, folder: Path, index: int, rate: float | None) -> None:
        if rate != self.current:
            self.shape(rate)
            self.current = rate
        _write(folder / f"go-{index}", json.dumps({"rate": rate}))

    def serve(self, folders: Sequence[Path], alive: Callable[[Path], bool]) -> None:
        """Every turn of every rate in order; in each, every job in the turn's order measures alone;
        then the link unshaped and every job told it is done."""
        plan = self.schedule(len(folders))
        for index, rate, order in plan:
            for j in order:
                self.ready(folders[j], index, alive)
                self._go(folders[j], index, rate)
                self.ready(folders[j], index + 1, alive)
        for folder in folders:
            self._go(folder, len(plan), None)
