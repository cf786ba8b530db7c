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

With `opportunistic=True` (Varuna's and eager-1F1B's schedules) the loop pulls the next forward
ahead whenever it is about to wait for a gradient that has not arrived, that forward's input is
already here and the stage has room for its activations (`pull_ahead_room`: 1F1B's most plus
one), so a stage fills its own bubble instead of idling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from varuna.comm.links import Link
from varuna.comm.p2p import flatten_value
from varuna.cut.cutpoint import CutPoint, handling, model_loss
from varuna.cut.standin import cross_stage_error, origin_of, stand_in_context
from varuna.engine.backward import WeightGrads, input_grads_first
from varuna.engine.chunks import guard_chunks
from varuna.engine.observer import Observer, Unobserved
from varuna.errors import PartitionError
from varuna.schedule import WEIGHT_KIND, Action, Span, pull_ahead_room

__all__ = ["StageRuntime", "Chunk", "StepTimes", "Span", "Observer"]


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
    pulled_ahead: int = 0
    """Forwards run ahead of a gradient that was not here yet (Varuna's pull-ahead)."""


class GradSync(Protocol):
    """Who starts the data-parallel all-reduce early (`varuna.comm.buckets.GradBuckets`): told when
    a chunk's last backward runs and when its weight gradients are final."""

    def final_pass(self, stage: int) -> AbstractContextManager[object]:
        """Around the last whole backward that adds to chunk `stage`'s weight gradients this step."""
        ...

    def stage_done(self, stage: int) -> None:
        """Chunk `stage` has added its last weight gradient of the step."""
        ...


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
        self.before_start = False
        """True while a forward runs the model before this chunk's input CutPoint."""

    def on_cut(self, cut: CutPoint, value: Any) -> Any:
        index = self.index_of[id(cut)]
        if index == self.start:
            self.before_start = False
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


@dataclass(slots=True)
class Chunk:
    """One model chunk a rank runs: its virtual stage, where it starts and ends in the model, and the
    links it receives on (`up`: activations in, gradients out) and sends on (`down`). With one chunk
    per rank both are the rank's `P2P`; a chunk whose neighbour is on the same rank (the turn of
    zb-v's V) gets a `varuna.comm.local.LocalLink`."""

    stage: int
    start_cut: int | None
    end_cut: int | None
    up: Link | None = None
    down: Link | None = None


class _ChunkRun:
    """A chunk while the runtime runs it: the CutPoint handler and one step's micro-batch state."""

    def __init__(self, chunk: Chunk, cuts: _StageCuts, last: bool, recompute: bool) -> None:
        self.stage = chunk.stage
        self._up, self._down = chunk.up, chunk.down
        self.cuts = cuts
        self.first = chunk.stage == 0
        self.last = last
        self.recompute = recompute and not last
        self.reset(set())

    @property
    def up(self) -> Link:
        """The link to the stage before (activations in, gradients out)."""
        if self._up is None:
            raise RuntimeError(f"virtual stage {self.stage} has no link to a stage before it")
        return self._up

    @property
    def down(self) -> Link:
        """The link to the stage after (activations out, gradients in)."""
        if self._down is None:
            raise RuntimeError(f"virtual stage {self.stage} has no link to a stage after it")
        return self._down

    def reset(self, split: set[int | None]) -> None:
        self.inputs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.rng: dict[int, Any] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.weights: dict[int, WeightGrads] = {}
        self.split = split


class StageRuntime:
    """Executes a rank's actions over its chunks; owns nothing but the per-step state of its
    micro-batches. With several chunks, a chunk's forward skips the rank's other chunks' modules
    that run before its start (`varuna.engine.chunks.guard_chunks`)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        chunks: Sequence[Chunk],
        num_stages: int,
        cut_index: Mapping[int, int],
        cut_names: list[str],
        device: torch.device,
        autocast: Callable[[], AbstractContextManager[object]],
        recompute: bool,
        opportunistic: bool,
        where: str,
        traced: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.autocast = autocast
        self.opportunistic = opportunistic
        self.num_stages = num_stages
        self.where = where
        self.observer: Observer = Unobserved()
        """Told of each step and each send; the engine sets its telemetry here."""
        self.chunks = {
            c.stage: _ChunkRun(
                c,
                _StageCuts(cut_index, c.start_cut, c.end_cut, cut_names),
                last=c.stage == num_stages - 1,
                recompute=recompute,
            )
            for c in chunks
        }
        self.links = list(
            {id(link): link for c in chunks for link in (c.up, c.down) if link is not None}.values()
        )
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self._stand_ins = {
            c.stage: stand_in_context(
                c.stage, cut_names[c.start_cut] if c.start_cut is not None else None, names
            )
            for c in chunks
        }
        self._current: _ChunkRun | None = None
        self._result: Any = None
        if len(chunks) > 1:
            guard_chunks(model, device, traced or {}, self.before_cut, cut_index)

    def before_cut(self, last: int | None) -> bool:
        """Whether the running forward has not reached its chunk's input CutPoint yet, and that
        CutPoint comes after CutPoint index `last` (None: any)."""
        current = self._current
        if current is None or not current.cuts.before_start:
            return False
        start = current.cuts.start
        return last is None or (start is not None and last < start)

    # one step ----------------------------------------------------------------------------------
    def run(
        self,
        actions: list[Action],
        micro: Sequence[Mapping[str, Any]],
        *,
        loss_coef: float,
        allreduce: Callable[[], None],
        grads: GradSync | None = None,
    ) -> tuple[list[torch.Tensor], StepTimes]:
        """Run the step's actions; returns the detached micro-batch losses (last stage) and times.
        `allreduce` runs at the schedule's ALLREDUCE action; `grads`, when given, is told when each
        chunk's last backward starts and when its weight gradients are final, so that their
        all-reduce can start before that action."""
        with self.observer.step():
            return self._actions(actions, micro, loss_coef, allreduce, grads)

    def _actions(
        self,
        actions: list[Action],
        micro: Sequence[Mapping[str, Any]],
        loss_coef: float,
        allreduce: Callable[[], None],
        grads: GradSync | None,
    ) -> tuple[list[torch.Tensor], StepTimes]:
        self.micro = micro
        self.loss_coef = loss_coef
        self.allreduce = allreduce
        self.grads = grads
        # per chunk: micro-batches whose weight gradients are not all added yet (their B, or the W
        # of a split B, still to run); at 0 the chunk's gradients are final for this step
        self._pending = {v: sum(1 for a in actions if a.kind == "B" and a.stage == v) for v in self.chunks}
        self.losses: list[torch.Tensor] = []
        self.times = StepTimes()
        for v, c in self.chunks.items():
            c.reset({a.microbatch for a in actions if a.kind == WEIGHT_KIND and a.stage == v})
        if any(c.split for c in self.chunks.values()):
            self._params = [p for p in self.model.parameters() if p.requires_grad and not p.is_meta]
        idle0 = sum(link.idle_s for link in self.links)
        comm0 = sum(link.comm_s for link in self.links)
        start = time.perf_counter()
        for link in self.links:
            link.begin_step(micro)  # which activations come with shapes; receives posted early
        probe = sorted({m for link in self.links for m in link.shape_probe()})
        if probe:  # links that need every activation's shapes before it arrives
            self._probe_shapes(probe)
        queue = list(actions)
        while queue:
            head = queue[0]
            if (
                self.opportunistic
                and head.kind == "RECV_B"
                and not self.chunks[head.stage].down.grad_ready(head.microbatch or 0)
            ):
                ahead = self._forward_ready(queue)
                if ahead:
                    self.times.pulled_ahead += 1
                    for a in ahead:
                        queue.remove(a)
                        self._execute(a)
                    continue
            self._execute(queue.pop(0))
        self._flush()
        self.times.total_s = time.perf_counter() - start
        self.times.idle_s = sum(link.idle_s for link in self.links) - idle0
        self.times.comm_s += sum(link.comm_s for link in self.links) - comm0
        return self.losses, self.times

    def evaluate(
        self,
        actions: list[Action],
        micro: Sequence[Mapping[str, Any]],
        on_result: Callable[[int, torch.Tensor, Any], None],
    ) -> None:
        """Forward-only over `micro` (`varuna.schedule.forward_only`): no gradients, and nothing held
        once sent. On the last stage `on_result(m, loss, result)` gets each micro-batch's loss and
        what the model returned. The caller sets the model's mode (eval) and the links' plan."""
        self.micro = micro
        for link in self.links:
            link.begin_step(micro)
        probe = sorted({m for link in self.links for m in link.shape_probe()})
        if probe:
            self._probe_shapes(probe)
        for action in actions:
            c, m = self.chunks[action.stage], action.microbatch or 0
            try:
                if action.kind == "RECV_F":
                    c.inputs[m] = c.up.recv_activation(m)
                elif action.kind == "F":
                    out = self._forward(c, m, c.inputs.pop(m, None), grad=False)
                    if c.last:
                        on_result(m, out.detach(), self._result)
                    else:
                        c.outputs[m] = out
                elif action.kind == "SEND_F":
                    c.down.send_activation(m, c.outputs.pop(m), grad=False)
                else:
                    raise ValueError(f"evaluation runs forwards only, not {action}")
            except BaseException as exc:
                exc.add_note(f"varuna: raised on {self.where} while evaluating (action {action})")
                raise
        self._flush()
        self.finish()

    def _probe_shapes(self, mbs: list[int]) -> None:
        """Send micro-batches `mbs` through the pipeline once, stage after stage, without gradients,
        so that links posting each message just in time (`varuna.comm.serial`) know the shapes of
        every activation before it comes. In eval mode, the random state forked: nothing training
        sees changes (no dropout draw, no running statistic)."""
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                for m in mbs:
                    for c in (self.chunks[v] for v in sorted(self.chunks)):
                        inputs = None if c.first else c.up.probe_recv(m)
                        if not c.last:
                            c.down.probe_send(m, self._forward(c, m, inputs, grad=False))
        finally:
            for module, training in modes:
                module.training = training

    def _flush(self) -> None:
        """Held sends go out before the step's collectives (`varuna.comm.serial`): a peer waiting
        in a collective for this rank would otherwise wait for them."""
        for link in self.links:
            link.flush()

    def finish(self) -> None:
        """Wait for every send of the step (after the reductions started)."""
        for link in self.links:
            link.finish()

    def close(self) -> None:
        for link in self.links:
            link.close()

    def _forward_ready(self, queue: list[Action]) -> list[Action]:
        """The next forward's actions, if its input is here and its chunk has room for its
        activations; else nothing."""
        for i, a in enumerate(queue):
            if a.kind == "F":
                m = a.microbatch
                c = self.chunks[a.stage]
                if len(c.outputs) + len(c.weights) >= pull_ahead_room(a.stage, self.num_stages):
                    return []
                if not c.first and not c.up.activation_ready(m or 0):
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
            if action.kind == "ALLREDUCE":
                self._flush()
                self.allreduce()
            else:
                getattr(self, "_do_" + action.kind)(self.chunks[action.stage], action.microbatch)
        except BaseException as exc:
            if not getattr(exc, "_varuna_noted", False):
                exc.add_note(f"varuna: raised on {self.where} while running action {action}")
                exc._varuna_noted = True  # type: ignore[attr-defined]
            raise
        t1 = time.perf_counter()
        if action.kind in ("F", "B", "R", WEIGHT_KIND):
            self.times.compute_s += t1 - t0
        stage = action.stage if len(self.chunks) > 1 and action.kind != "ALLREDUCE" else None
        self.times.spans.append(Span(action.kind, action.microbatch, t0, t1, stage))

    # actions -----------------------------------------------------------------------------------
    def _do_RECV_F(self, c: _ChunkRun, m: int) -> None:
        c.inputs[m] = c.up.recv_activation(m)

    def _do_F(self, c: _ChunkRun, m: int) -> None:
        grad = not c.recompute
        if c.recompute:
            c.rng[m] = _rng_state(self.device)
        result = self._forward(c, m, c.inputs.get(m), grad=grad)
        c.outputs[m] = result
        if c.last:
            self.losses.append(result.detach())

    def _do_SEND_F(self, c: _ChunkRun, m: int) -> None:
        before = c.down.bytes_sent
        c.down.send_activation(m, c.outputs[m])
        self.observer.on_send("SEND_F", m, c.down.bytes_sent - before)
        if c.recompute:
            del c.outputs[m]

    def _do_R(self, c: _ChunkRun, m: int) -> None:
        inputs = c.inputs.get(m)
        if inputs is not None:
            inputs = c.inputs[m] = _fresh(inputs)
        device = self.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _set_rng_state(device, c.rng.pop(m))
            c.outputs[m] = self._forward(c, m, inputs, grad=True)

    def _do_RECV_B(self, c: _ChunkRun, m: int) -> None:
        c.grads[m] = c.down.recv_grad(m)

    def _do_B(self, c: _ChunkRun, m: int) -> None:
        self._backward(c, m)
        if m not in c.weights:  # a whole backward (or none): its weight gradients are in
            self._weights_added(c)

    def _backward(self, c: _ChunkRun, m: int) -> None:
        out = c.outputs.pop(m)
        if c.last:
            pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = [(out * self.loss_coef, None)]
        else:
            tensors, _ = flatten_value(out)
            floating = [t for t in tensors if t.is_floating_point()]
            grads = c.grads.pop(m)
            pairs = [(t, g) for t, g in zip(floating, grads) if t.requires_grad]
        if not pairs:
            return
        if m in c.split and self._split_backward(c, m, pairs):
            return
        if self.grads is not None and self._pending[c.stage] == 1:  # the chunk's last weight gradients
            with self.grads.final_pass(c.stage):
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        else:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _split_backward(
        self, c: _ChunkRun, m: int, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> bool:
        """Only the input gradients of `m` now, its weight gradients kept for `_do_W`;
        False (nothing computed) where the graph does not split (see `input_grads_first`)."""
        inputs = c.inputs.get(m)
        if inputs is None:
            return False
        tensors = [t for t in flatten_value(inputs)[0] if t.is_floating_point() and t.requires_grad]
        if not tensors:
            return False
        split = input_grads_first([t for t, _ in pairs], [g for _, g in pairs], tensors, self._params)
        if split is None:
            return False
        found, c.weights[m] = split
        self.times.split += 1
        for t, g in zip(tensors, found):
            if g is not None:
                t.grad = g
        return True

    def _do_SEND_B(self, c: _ChunkRun, m: int) -> None:
        before = c.up.bytes_sent
        c.up.send_grad(m, c.inputs.pop(m))
        self.observer.on_send("SEND_B", m, c.up.bytes_sent - before)

    def _do_W(self, c: _ChunkRun, m: int) -> None:
        weights = c.weights.pop(m, None)
        if weights is not None:  # None: B(m) could not split and did the whole backward
            weights.run()
            self._weights_added(c)

    def _weights_added(self, c: _ChunkRun) -> None:
        """One more micro-batch's weight gradients of chunk `c` are in; after its last, they are final."""
        self._pending[c.stage] -= 1
        if self._pending[c.stage] == 0 and self.grads is not None:
            self.grads.stage_done(c.stage)

    # the user's forward ------------------------------------------------------------------------
    def _forward(self, c: _ChunkRun, m: int, inputs: Any, *, grad: bool) -> Any:
        cuts = c.cuts
        cuts.inputs = inputs
        cuts.output = None
        cuts.before_start = cuts.start is not None
        done = False
        stand_ins = self._stand_ins[c.stage]
        self._current = c
        try:
            with torch.set_grad_enabled(grad), self.autocast(), handling(cuts), stand_ins:
                result = self.model(**self.micro[m])
        except _StageDone:
            done = True
        finally:
            self._current = None
        if c.last:
            self._result = result  # what the model returned, for evaluation's metrics
            loss = model_loss(result)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or origin_of(loss) is not None:
                raise self._bad_result(c, loss)
            return loss
        if not done:
            raise PartitionError(
                f"stage {c.stage}'s forward returned without calling CutPoint "
                f"{cuts.names[cuts.end or 0]!r}, where this stage ends; every CutPoint must be called once "
                "per forward, whatever the batch"
            )
        origin = origin_of(cuts.output)
        if origin is not None:
            with stand_ins:
                raise cross_stage_error(f"the value sent at CutPoint {cuts.names[cuts.end or 0]!r}", origin)
        return cuts.output

    def _bad_result(self, c: _ChunkRun, result: Any) -> Exception:
        origin = origin_of(result)
        if origin is not None:
            with self._stand_ins[c.stage]:
                return cross_stage_error("the loss", origin)
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        return PartitionError(
            f"the model's forward must return the loss as a scalar tensor (or an output with a .loss, as "
            f"transformers models do when given labels), got {shape}; compute the loss inside forward(**batch)"
        )
