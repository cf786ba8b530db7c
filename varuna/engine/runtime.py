"""The stage runtime: a loop that executes one stage's lowered action list for one step.

    RECV_F m  wait for micro-batch m's activation (its header was posted at the start of the step)
    F m       run the user's forward; the CutPoints splice in the received value and hand out ours
    SEND_F m  send it on; post the receives for its gradients
    R m       recompute m's forward with autograd, from the stored input and RNG state
    RECV_B m  wait for the gradient of our output
    B m       backward
    SEND_B m  send the gradient of our input back
    W m       the weight gradients of m's backward, where the list splits it
              (`varuna.schedule.split_backwards`): B m then computed only the input gradient
              (`varuna.engine.backward`), so SEND_B sent it before the weights were done
    ALLREDUCE start the data-parallel and tied-weight gradient reductions

With `opportunistic=True` (Varuna's schedule) the loop pulls the next forward ahead whenever it
is about to wait for a gradient that has not arrived and that forward's input is already here,
so a stage fills its own bubble instead of idling.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from varuna.comm.p2p import P2P, flatten_value
from varuna.cut.cutpoint import CutPoint, _handling, model_loss
from varuna.cut.standin import cross_stage_error, origin_of, stand_in_context
from varuna.engine.backward import WeightGrads, input_grads_first
from varuna.errors import PartitionError
from varuna.schedule import WEIGHT_KIND, Action, Span

__all__ = ["StageRuntime", "StepTimes", "Span", "Observer"]


@dataclass(slots=True)
class StepTimes:
    """Where one stage's time went during one step."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    total_s: float = 0.0
    spans: list[Span] = field(default_factory=list)
    split: int = 0
    """Backwards that ran as an input half (B) and a weight half (W) (see `split_backwards`)."""


class Observer(Protocol):
    """What the runtime tells whoever watches it (the engine's telemetry), through calls it makes
    itself: nothing of the runtime is replaced while it runs.

        with observer.step():              # around one step's actions (exceptions pass through)
            ... observer.on_send("SEND_F", m, nbytes) after each send
    """

    def step(self) -> AbstractContextManager[object]:
        """A context around one step's actions."""
        ...

    def on_send(self, kind: str, microbatch: int, nbytes: int) -> None:
        """`kind` ("SEND_F" or "SEND_B") of micro-batch `microbatch` put `nbytes` on the wire."""
        ...


class _Unobserved:
    """The observer of a runtime nobody watches."""

    def step(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def on_send(self, kind: str, microbatch: int, nbytes: int) -> None:
        pass


class _StageDone(BaseException):
    """Raised by the CutPoint where a stage ends, once it holds the value the stage sends.

    Nothing after that CutPoint is this stage's work (a parameter used later is held, as a tied
    copy, by the stage that uses it), so the forward stops there instead of running the rest of
    the model on stand-ins. A BaseException, so that a model's `except Exception` does not catch
    it; only `StageRuntime._forward` does, and only this type.
    """


class _StageCuts:
    """Decides what each CutPoint returns while this stage runs the user's forward."""

    def __init__(
        self, index_of: Mapping[int, int], start: int | None, end: int | None, names: list[str]
    ) -> None:
        self.index_of = index_of
        self.start = start
        self.end = end
        self.names = names
        self.inputs: Any = None
        self.output: Any = None

    def on_cut(self, cut: CutPoint, value: Any) -> Any:
        index = self.index_of[id(cut)]
        if index == self.start:
            return self.inputs
        if index == self.end:
            self.output = value
            raise _StageDone
        return value


def _rng_state(device: torch.device) -> Any:
    """What dropout in a recomputed forward must replay: the CPU generator, and the device's."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _fresh(value: Any) -> Any:
    """A detached copy of a received value whose floating tensors require grad again."""
    tensors, is_tuple = flatten_value(value)
    out = [t.detach().requires_grad_() if t.is_floating_point() else t for t in tensors]
    return tuple(out) if is_tuple else out[0]


class StageRuntime:
    """Executes a stage's actions; owns nothing but the per-step state of its micro-batches."""

    def __init__(
        self,
        model: nn.Module,
        *,
        stage: int,
        num_stages: int,
        cut_index: Mapping[int, int],
        cut_names: list[str],
        start_cut: int | None,
        end_cut: int | None,
        p2p: P2P,
        autocast: Callable[[], AbstractContextManager[object]],
        recompute: bool,
        opportunistic: bool,
        where: str,
    ) -> None:
        self.model = model
        self.stage = stage
        self.last = stage == num_stages - 1
        self.first = stage == 0
        self.cuts = _StageCuts(cut_index, start_cut, end_cut, cut_names)
        self.p2p = p2p
        self.autocast = autocast
        self.recompute = recompute and not self.last
        self.opportunistic = opportunistic
        self.where = where
        self.observer: Observer = _Unobserved()
        """Told of each step and each send; the engine sets its telemetry here."""
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self._stand_ins = stand_in_context(
            stage, cut_names[start_cut] if start_cut is not None else None, names
        )

    # one step ----------------------------------------------------------------------------------
    def run(
        self,
        actions: list[Action],
        micro: Sequence[Mapping[str, Any]],
        *,
        loss_coef: float,
        allreduce: Callable[[], None],
    ) -> tuple[list[torch.Tensor], StepTimes]:
        """Run the step's actions; returns the detached micro-batch losses (last stage) and times."""
        with self.observer.step():
            return self._actions(actions, micro, loss_coef, allreduce)

    def _actions(
        self,
        actions: list[Action],
        micro: Sequence[Mapping[str, Any]],
        loss_coef: float,
        allreduce: Callable[[], None],
    ) -> tuple[list[torch.Tensor], StepTimes]:
        self.micro = micro
        self.loss_coef = loss_coef
        self.allreduce = allreduce
        self.inputs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.rng: dict[int, Any] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.times = StepTimes()
        self.weights: dict[int, WeightGrads] = {}
        self._split = {a.microbatch for a in actions if a.kind == WEIGHT_KIND}
        if self._split:
            self._params = [p for p in self.model.parameters() if p.requires_grad and not p.is_meta]
        idle0, comm0 = self.p2p.idle_s, self.p2p.comm_s
        start = time.perf_counter()
        self.p2p.begin_step(micro)  # which activations come with shapes; receives posted early
        queue = list(actions)
        while queue:
            head = queue[0]
            if self.opportunistic and head.kind == "RECV_B" and not self.p2p.grad_ready(head.microbatch or 0):
                ahead = self._forward_ready(queue)
                if ahead:
                    for a in ahead:
                        queue.remove(a)
                        self._execute(a)
                    continue
            self._execute(queue.pop(0))
        self.times.total_s = time.perf_counter() - start
        self.times.idle_s = self.p2p.idle_s - idle0
        self.times.comm_s += self.p2p.comm_s - comm0
        return self.losses, self.times

    def _forward_ready(self, queue: list[Action]) -> list[Action]:
        """The next forward's actions, if its input is here; else nothing."""
        for i, a in enumerate(queue):
            if a.kind == "F":
                m = a.microbatch
                if not self.first and not self.p2p.activation_ready(m or 0):
                    return []
                group = [a]
                if i > 0 and queue[i - 1].kind == "RECV_F":
                    group.insert(0, queue[i - 1])
                if i + 1 < len(queue) and queue[i + 1].kind == "SEND_F":
                    group.append(queue[i + 1])
                return group
        return []

    def _execute(self, action: Action) -> None:
        t0 = time.perf_counter()
        try:
            getattr(self, "_do_" + action.kind)(action.microbatch)
        except BaseException as exc:
            if not getattr(exc, "_varuna_noted", False):
                exc.add_note(f"varuna: raised on {self.where} while running action {action}")
                exc._varuna_noted = True  # type: ignore[attr-defined]
            raise
        t1 = time.perf_counter()
        if action.kind in ("F", "B", "R", WEIGHT_KIND):
            self.times.compute_s += t1 - t0
        self.times.spans.append(Span(action.kind, action.microbatch, t0, t1))

    # actions -----------------------------------------------------------------------------------
    def _do_RECV_F(self, m: int) -> None:
        self.inputs[m] = self.p2p.recv_activation(m)

    def _do_F(self, m: int) -> None:
        grad = not self.recompute
        if self.recompute:
            self.rng[m] = _rng_state(self.p2p.device)
        result = self._forward(m, self.inputs.get(m), grad=grad)
        if self.last:
            self.outputs[m] = result
            self.losses.append(result.detach())
        else:
            self.outputs[m] = result

    def _do_SEND_F(self, m: int) -> None:
        before = self.p2p.bytes_sent
        self.p2p.send_activation(m, self.outputs[m])
        self.observer.on_send("SEND_F", m, self.p2p.bytes_sent - before)
        if self.recompute:
            del self.outputs[m]

    def _do_R(self, m: int) -> None:
        inputs = self.inputs.get(m)
        if inputs is not None:
            inputs = self.inputs[m] = _fresh(inputs)
        device = self.p2p.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _set_rng_state(device, self.rng.pop(m))
            self.outputs[m] = self._forward(m, inputs, grad=True)

    def _do_RECV_B(self, m: int) -> None:
        self.grads[m] = self.p2p.recv_grad(m)

    def _do_B(self, m: int) -> None:
        out = self.outputs.pop(m)
        if self.last:
            pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = [(out * self.loss_coef, None)]
        else:
            tensors, _ = flatten_value(out)
            floating = [t for t in tensors if t.is_floating_point()]
            grads = self.grads.pop(m)
            pairs = [(t, g) for t, g in zip(floating, grads) if t.requires_grad]
        if not pairs:
            return
        if m in self._split and self._split_backward(m, pairs):
            return
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _split_backward(self, m: int, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> bool:
        """Only the input gradients of `m` now, its weight gradients kept for `_do_W`;
        False (nothing computed) where the graph does not split (see `input_grads_first`)."""
        inputs = self.inputs.get(m)
        if inputs is None:
            return False
        tensors = [t for t in flatten_value(inputs)[0] if t.is_floating_point() and t.requires_grad]
        if not tensors:
            return False
        split = input_grads_first([t for t, _ in pairs], [g for _, g in pairs], tensors, self._params)
        if split is None:
            return False
        found, self.weights[m] = split
        self.times.split += 1
        for t, g in zip(tensors, found):
            if g is not None:
                t.grad = g
        return True

    def _do_SEND_B(self, m: int) -> None:
        before = self.p2p.bytes_sent
        self.p2p.send_grad(m, self.inputs.pop(m))
        self.observer.on_send("SEND_B", m, self.p2p.bytes_sent - before)

    def _do_W(self, m: int) -> None:
        weights = self.weights.pop(m, None)
        if weights is not None:  # None: B(m) could not split and did the whole backward
            weights.run()

    def _do_ALLREDUCE(self, m: int | None) -> None:
        self.allreduce()

    # the user's forward ------------------------------------------------------------------------
    def _forward(self, m: int, inputs: Any, *, grad: bool) -> Any:
        cuts = self.cuts
        cuts.inputs = inputs
        cuts.output = None
        done = False
        try:
            with torch.set_grad_enabled(grad), self.autocast(), _handling(cuts), self._stand_ins:
                result = self.model(**self.micro[m])
        except _StageDone:
            done = True
        if self.last:
            loss = model_loss(result)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or origin_of(loss) is not None:
                raise self._bad_result(loss)
            return loss
        if not done:
            raise PartitionError(
                f"stage {self.stage}'s forward returned without calling CutPoint "
                f"{cuts.names[cuts.end or 0]!r}, where this stage ends; every CutPoint must be called once "
                "per forward, whatever the batch"
            )
        origin = origin_of(cuts.output)
        if origin is not None:
            with self._stand_ins:
                raise cross_stage_error(f"the value sent at CutPoint {cuts.names[cuts.end or 0]!r}", origin)
        return cuts.output

    def _bad_result(self, result: Any) -> Exception:
        origin = origin_of(result)
        if origin is not None:
            with self._stand_ins:
                return cross_stage_error("the loss", origin)
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        return PartitionError(
            f"the model's forward must return the loss as a scalar tensor (or an output with a .loss, as "
            f"transformers models do when given labels), got {shape}; compute the loss inside forward(**batch)"
        )
