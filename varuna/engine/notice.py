"""Preemption notices in the engine: when to stop so that the checkpoint is committed before a deadline.

A notice is a stop request with a deadline (`varuna.launch.signals.StopRequest`): a SIGTERM on a rank
given a notice window (`notice_s`), or a stop file with a ``deadline`` that rank 0 reads
(`varuna.launch.notices.StopFiles`). At the end of every step, each rank decides alone::

    remaining = deadline - now
    stop now  if  remaining < STEP_MARGIN * step_s + CHECKPOINT_MARGIN * checkpoint_s * writes + SLACK_S
                  (writes: 1, or 2 while a background checkpoint is still being written: the stop's
                   checkpoint waits for it first)

and its answer rides the stop flag of the per-step all-reduce, so any rank's "stop now" stops every
rank after the same step: the job checkpoints and exits with the morph status. Going on one more step
is safe exactly when that step and a checkpoint after it, with the margins, still end before the
deadline; so the first step after which they no longer fit is the last one.

- ``step_s`` is the longest of the last `STEP_WINDOW` step periods, each from the end of one
  ``step()`` to the end of the next one's pipeline (the script's own work and data loading between
  steps count; checkpoints written inside ``step()`` do not).
- ``checkpoint_s`` is the longest of the last `CHECKPOINT_WINDOW` checkpoints' measured seconds in
  this process: a blocking checkpoint's save, a background one's copy and write up to its commit.
- No checkpoint measured yet in this process: stop at once. A guess from the state's size and an
  assumed disk speed could be far off on a shared file system, and stopping at once loses at most
  the notice window's training, never the checkpoint.
- The margins: `STEP_MARGIN` and `CHECKPOINT_MARGIN` (1.5) absorb the noise of a step's and a
  write's time; `SLACK_S` (2 s) covers the rest of the step after the decision (the optimizer), the
  process exit after the commit, and clocks of hosts that differ a little.

A request without a deadline stops at the end of this step, as it always did.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varuna.launch.notices import StopFiles, launch_info
from varuna.launch.signals import Notice, StopRequest

__all__ = [
    "STEP_MARGIN",
    "CHECKPOINT_MARGIN",
    "SLACK_S",
    "POLL_S",
    "Decision",
    "decide",
    "NoticeWatch",
]

STEP_MARGIN = 1.5
"""How many times the longest recent step one more step is counted as."""
CHECKPOINT_MARGIN = 1.5
"""How many times the longest recent checkpoint the stop's checkpoint is counted as."""
SLACK_S = 2.0
"""Seconds kept free before the deadline besides the step and the checkpoint."""
POLL_S = 0.5
"""Rank 0 lists the stop files at most this often (at the end of a step)."""
STEP_WINDOW = 5
CHECKPOINT_WINDOW = 3


@dataclass(frozen=True, slots=True)
class Decision:
    """One rank's answer at the end of a step: stop now, and on what figures."""

    stop: bool
    remaining_s: float | None
    """Seconds left to the earliest deadline (None: no notice)."""
    step_s: float | None
    checkpoint_s: float | None
    needed_s: float | None
    """What going on one more step would need before the deadline (None: no notice, or no
    checkpoint measured yet)."""


def decide(
    remaining_s: float, step_s: float, checkpoint_s: float | None, *, writing: bool = False
) -> tuple[bool, float | None]:
    """Whether to stop after this step `remaining_s` seconds before a deadline, and the seconds one
    more step and a checkpoint would need (None: no checkpoint measured, so stop at once).

        decide(30.0, step_s=1.0, checkpoint_s=4.0)   # (False, 9.5): 1.5 * 1 + 1.5 * 4 + 2 fits in 30 s
        decide(9.0, step_s=1.0, checkpoint_s=4.0)    # (True, 9.5)

    `writing`: a background checkpoint is in flight, which the stop's checkpoint waits for first.
    """
    if checkpoint_s is None:
        return True, None
    writes = 2 if writing else 1
    needed = STEP_MARGIN * step_s + CHECKPOINT_MARGIN * checkpoint_s * writes + SLACK_S
    return remaining_s < needed, needed


def _process_start() -> float:
    """When this process started (epoch seconds, from /proc), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[-1].split()[19])
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def launch_start(run_dir: Path, job: str | None) -> float:
    """When launch `job` started: ``job.json``'s start when it names that launch, else when this
    process started (a stop file that names no launch and is older belongs to an earlier one)."""
    info = launch_info(run_dir)
    if info is not None and job and info.get("job_id") == job and isinstance(info.get("start"), (int, float)):
        return float(info["start"])
    return _process_start()


class NoticeWatch:
    """One rank's view of its stop request at the end of each step: rank 0's stop files read into
    it, the step and checkpoint times measured, the notices not yet reported, and the decision.

        watch = NoticeWatch(request, run_dir=env.run_dir, job=os.environ.get("VARUNA_JOB_ID"), rank=rank)
        watch.begin_step()                 # step() starts
        watch.poll()                       # rank 0: new stop files (at most every POLL_S)
        decision = watch.decide(writing=pending is not None)    # before the step's all-reduce
        watch.end_step()                   # step() returns
    """

    def __init__(
        self,
        request: StopRequest,
        *,
        run_dir: Path | None,
        job: str | None,
        rank: int,
        poll_s: float = POLL_S,
    ) -> None:
        self.request = request
        self.files = (
            StopFiles(run_dir, job, since=launch_start(run_dir, job))
            if rank == 0 and run_dir is not None
            else None
        )
        self.poll_s = poll_s
        self._next_poll = 0.0
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._checkpoints: deque[float] = deque(maxlen=CHECKPOINT_WINDOW)
        self._from: float | None = None
        self._last_end: float | None = None
        self._announced = 0
        self.stop_announced = False
        """Whether the stop this request led to was reported (once per process)."""

    # measurements --------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """step() starts: its period counts from the previous step()'s end (or from now)."""
        now = time.perf_counter()
        self._from = self._last_end if self._last_end is not None else now

    def end_step(self) -> None:
        """step() returns (after any checkpoint it wrote)."""
        self._last_end = time.perf_counter()

    def checkpoint_measured(self, seconds: float) -> None:
        """A checkpoint of this process took `seconds` (save, or background copy and write)."""
        self._checkpoints.append(float(seconds))

    @property
    def step_s(self) -> float | None:
        return max(self._steps, default=None)

    @property
    def checkpoint_s(self) -> float | None:
        return max(self._checkpoints, default=None)

    # the request ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Rank 0: read the stop files that arrived (at most every `poll_s` seconds) into the request."""
        if self.files is None or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + self.poll_s
        for request in self.files.new():
            deadline = request.get("deadline")
            self.request.set(
                str(request.get("reason") or "a stop request"),
                deadline=float(deadline) if isinstance(deadline, (int, float)) else None,
                hosts=request.get("hosts"),
                source="file",
            )

    def new_notices(self) -> list[Notice]:
        """The notices this rank holds that were not returned before (to report each once)."""
        fresh = self.request.notices[self._announced :]
        self._announced += len(fresh)
        return fresh

    def decide(self, *, writing: bool = False) -> Decision:
        """Stop after this step? Immediately asked: yes; a deadline: by `decide`; else no. Call it
        once per step, before the step's all-reduce (it measures the step's period)."""
        now = time.perf_counter()
        if self._from is not None:
            self._steps.append(now - self._from)
        deadline = self.request.deadline
        if deadline is None:
            return Decision(bool(self.request.immediate), None, self.step_s, self.checkpoint_s, None)
        remaining = deadline - time.time()
        stop, needed = decide(remaining, self.step_s or 0.0, self.checkpoint_s, writing=writing)
        return Decision(stop or self.request.immediate, remaining, self.step_s, self.checkpoint_s, needed)

    def describe(self, notice: Notice) -> dict[str, Any]:
        """A notice as its `notice` event says it."""
        return {
            "reason": notice.reason,
            "deadline": notice.deadline,
            "hosts": list(notice.hosts) if notice.hosts is not None else None,
            "source": notice.source,
            "seconds_left": notice.deadline - time.time(),
        }
