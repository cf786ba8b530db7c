"""What the engine and its runtime tell whoever watches a rank: the observer contract.

The engine makes its observer (`varuna.telemetry.recorder.Telemetry`, made by `Telemetry.attach`
at the end of construction) and hands it to its runtime; both call it, and nothing of either is
replaced while it runs:

    want = observer.poll()              # before the step's small all-reduce: a checkpoint wanted?
    with observer.step():               # the runtime, around one step's actions
        ... observer.on_send("SEND_F", m, nbytes) after each send
    observer.on_step(loss, times)       # after the optimizer step
    observer.checkpoint_done(info)      # after a checkpoint the step wrote (exit_code: the job morphs)

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
        """The step wrote a checkpoint (`engine.last_checkpoint`); `exit_code`: the rank now exits
        with it (to morph)."""
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
