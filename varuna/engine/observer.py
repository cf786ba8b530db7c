"""What the engine and its runtime tell whoever watches a rank: the observer contract.

The engine makes its observer (`varuna.telemetry.recorder.Telemetry`, made by `Telemetry.attach`
at the end of construction) and hands it to its runtime; both call it, and nothing of either is
replaced while it runs:

    want = observer.poll()              # before the step's small all-reduce: a checkpoint wanted?
    observer.on_notice(notice)          # before it too: a preemption notice this rank got, once each
    with observer.step():               # the runtime, around one step's actions
        ... observer.on_send("SEND_F", m, nbytes) after each send
    observer.on_stop(decision)          # the ranks agreed to stop after this step (once)
    observer.on_step(loss, times)       # after the optimizer step
    observer.checkpoint_done(info)      # after a checkpoint was written, blocking or in the background
                                        # (exit_code: the job morphs)

`poll` runs before the per-step all-reduce because rank 0's answer rides it: every rank then acts
on the same step. `Unobserved` is the observer of a rank nobody watches.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = ["Observer", "Unobserved"]


class Observer(Protocol):
    """The calls the engine and its runtime make to whoever watches the rank."""

    def step(self) -> AbstractContextManager[object]:
        """A context around one step's actions (an exception leaving it passes through)."""
        ...

    def on_send(self, kind: str, microbatch: int, nbytes: int) -> None:
        """`kind` ("SEND_F" or "SEND_B") of micro-batch `microbatch` put `nbytes` on the wire."""
        ...

    def poll(self) -> bool:
        """Take pending commands without waiting; True when a checkpoint is wanted after this step."""
        ...

    def on_step(self, loss: float, times: Any) -> None:
        """A step ended with global mean `loss`; `times` is its `varuna.engine.runtime.StepTimes`."""
        ...

    def checkpoint_done(self, info: dict[str, Any] | None, *, exit_code: int | None = None) -> None:
        """A checkpoint was committed (`engine.last_checkpoint`; ``info["blocking"]`` is False for one
        written in the background); `exit_code`: the rank now exits with it (to morph)."""
        ...

    def on_notice(self, notice: dict[str, Any]) -> None:
        """This rank got a preemption notice: reason, deadline (epoch seconds), hosts (None: all),
        source ("signal" or "file") and seconds_left (`varuna.engine.notice`)."""
        ...

    def on_stop(self, decision: dict[str, Any]) -> None:
        """The ranks agreed to stop after this step, with what this rank knew: reason, deadline and
        seconds_left (None without a notice), whether this rank's own rule decided it, and the
        step_s, checkpoint_s and needed_s it weighed (`varuna.engine.notice.Decision`)."""
        ...


class Unobserved:
    """The observer of a rank nobody watches."""

    def step(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def on_send(self, kind: str, microbatch: int, nbytes: int) -> None:
        pass

    def poll(self) -> bool:
        return False

    def on_step(self, loss: float, times: Any) -> None:
        pass

    def checkpoint_done(self, info: dict[str, Any] | None, *, exit_code: int | None = None) -> None:
        pass

    def on_notice(self, notice: dict[str, Any]) -> None:
        pass

    def on_stop(self, decision: dict[str, Any]) -> None:
        pass
