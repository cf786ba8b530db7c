"""Point-to-point transfer of the values crossing a cut, with their shapes, and gradient buckets.

A value at a cut is a tensor or a tuple of tensors whose shapes may change from step to step
(variable sequence length). The receiver must know them before it can post a receive, and gloo and
NCCL move a message only once its receive is posted. So the receiver posts the receives of
micro-batch m's tensors at the start of the step with the shapes m had in the previous step
("early" receives, on their own tags), and the shapes travel only when they may have changed:

    step start   sender -> receiver   [M, h_0, ..., h_{M-1}]   one message per step (tag _STEP)
                 h_m = 1: micro-batch m's batch changed shape (or it is new): its activation
                 comes with a header (`_shapes`); h_m = 0: it has last step's shapes, no header
    per m        h_m = 0:  data -> early receives
                 h_m = 1:  header equal to m's last:  data -> early receives, header
                           header differs:            placeholders -> early receives (old shapes,
                                                      so none stays posted), header, data -> late

The sender decides h_m from the micro-batch's key (its tensors' shapes and scalars, `batch_key`):
the shapes at a cut follow the batch's in the models this serves (a fixed or a per-batch sequence
length). The receiver follows the sender's word, not its own batch, so two stages that see
different batches cannot disagree on what is sent. A value whose shapes changed while its batch's
did not raises PartitionError on the sender, naming VARUNA_P2P_HEADERS=every (a header with every
activation); it cannot be delivered, since the receiver waits with the old shapes. Without
`begin_step` (the profiler's direct use) every activation comes with a header.

On CUDA the step message costs the receiver one wait for a small copy to the host per step, where a
header per activation cost one per activation; the sender compares shapes on the host.

Gradients flow back with exactly the shapes of the activations sent, so they need no header and
their receives are posted as soon as the activation leaves, overlapping with compute.

Streams: a stage boundary carries activations one way and gradients the other, each on a process
group of its own (`varuna.comm.groups`): NCCL runs a communicator's operations one after another,
so with one group a receive posted early would hold back the other direction's sends and both
ranks would wait (`VARUNA_NCCL_RULES=1` reproduces that on gloo). Within a
stream messages match in order (FIFO); the tag also carries the micro-batch index so a mismatch
fails loudly on gloo. NCCL ignores tags, so each end also posts in one order: early receives, then
the header, then late.

Arrivals: Varuna's schedule pulls a forward ahead when the awaited gradient has not arrived, so
the runtime must learn that a message arrived without blocking on it. gloo's work objects report
completion only once waited for (`is_completed()` stays False until `wait()`), so on CPU, with
VARUNA_P2P_WATCH=1, a `_Watcher` thread per direction waits for the posted receives in posting
order (the order they arrive in) and flags each arrival; without it a CPU rank learns of an
arrival only by waiting for it. On CUDA, NCCL's `is_completed()` tells directly.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from varuna.comm import nccl_rules
from varuna.comm._shapes import (
    HEADER_LEN,
    Signature,
    batch_key,
    decode_header,
    decode_signature,
    describe,
    empty,
    encode_header,
    encode_signature,
    headers_every,
    signature,
)
from varuna.errors import PartitionError

__all__ = [
    "HEADER_LEN",
    "Value",
    "flatten_value",
    "outgoing",
    "input_grads",
    "encode_header",
    "decode_header",
    "P2P",
]

_SLOTS = 128  # tag = microbatch * _SLOTS + slot: 0 header, 1.. activations, 32.. gradients, 64.. early
_LATE, _GRAD, _EARLY = 1, 32, 64
_STEP = _SLOTS - 1  # micro-batch 0's last slot: the step message (a header fills at most 31 slots)
_STREAM = 1 << 20  # tag offset per stage boundary, with several chunks per rank (M < 8192)

Value = Any  # a tensor or a tuple of tensors


def flatten_value(value: Value) -> tuple[list[torch.Tensor], bool]:
    """The tensors of a cut value and whether it was a tuple."""
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), True
    raise PartitionError(
        f"a CutPoint received a {type(value).__name__}; pass a tensor or a tuple of tensors through "
        "CutPoints (other values needed later must be computable from the batch on every stage)"
    )


def outgoing(value: Value) -> tuple[list[torch.Tensor], Signature]:
    """A cut value's tensors as they are sent (detached, contiguous) and its signature."""
    tensors, is_tuple = flatten_value(value)
    tensors = [t.detach().contiguous() for t in tensors]
    return tensors, signature(tensors, is_tuple)


def input_grads(inputs: Value) -> list[torch.Tensor]:
    """The gradients of a received value's floating tensors, to send back (zeros where none came)."""
    tensors, _ = flatten_value(inputs)
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors if t.is_floating_point()]


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point()


@dataclass(slots=True)
class _Arrival:
    """Set by a `_Watcher` once every work of one message is complete (or one failed: `error`)."""

    done: threading.Event
    error: BaseException | None = None


_Then = Callable[[], list[Any]] | None


class _Watcher:
    """A daemon thread waiting for posted receives in posting order, flagging each arrival.

    `then` runs in this thread once the first works are complete and returns more to wait for
    before the arrival is flagged: an activation's header, once here, posts the receives of its
    data at once, so the data moves while the receiving stage still computes (gloo sends a message
    only when its receive is posted, so waiting for the stage's main thread to post it delays
    every activation by however long that thread computes first)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[list[Any], _Then, _Arrival] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def watch(self, works: list[Any], then: _Then = None) -> _Arrival:
        arrival = _Arrival(threading.Event())
        self._queue.put((works, then, arrival))
        return arrival

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            works, then, arrival = item
            try:
                for w in works:
                    w.wait()  # releases the GIL while it blocks
                for w in then() if then is not None else []:
                    w.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for it
                arrival.error = exc
            arrival.done.set()

    def close(self) -> None:
        self._queue.put(None)


@dataclass(slots=True)
class _Pending:
    works: list[Any]
    buffers: list[torch.Tensor]
    arrival: _Arrival | None = None
    data: list[torch.Tensor] | None = None
    """An activation's tensors, once known to be in the early receives or posted after the header."""
    is_tuple: bool = False
    early: tuple[Signature, list[torch.Tensor]] | None = None
    """The shapes the early receives were posted for and their tensors (in `works`)."""
    header: Any = None
    """The header's receive, once posted."""

    def ready(self) -> bool:
        if self.arrival is not None:
            return self.arrival.done.is_set()
        return bool(self.works) and all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        if self.arrival is None:
            for w in self.works:
                w.wait()
            return
        self.arrival.done.wait()
        if self.arrival.error is not None:
            raise self.arrival.error


def _watching(device: torch.device) -> bool:
    """Whether receives get a `_Watcher` to report arrivals: on CPU (gloo) with VARUNA_P2P_WATCH=1
    (off by default: the thread competes with the rank's compute for the host's cores, so it is
    for hosts with a core to spare)."""
    return device.type == "cpu" and os.environ.get("VARUNA_P2P_WATCH", "0") != "0"


class P2P:
    """Activations to the next stage and gradients to the previous one, non-blocking.

    `idle_s` accumulates time spent waiting for a message that had not been sent yet (a bubble);
    `comm_s` the time spent moving data once it was on its way.
    """

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        *,
        ordered: bool | None = None,
        tags: tuple[int, int] | None = None,
        up: tuple[Any, Any] | None = None,
        down: tuple[Any, Any] | None = None,
    ) -> None:
        self.prev = prev_rank
        self.next = next_rank
        # (activations, gradients) process groups of the boundary with prev (up) and next (down);
        # None: the default group (one communicator for both directions: not for NCCL)
        none: tuple[Any, Any] = (None, None)
        self._in_act, self._in_grad = up or none
        self._out_act, self._out_grad = down or none
        self._groups = [g for g in (*(up or none), *(down or none)) if g is not None]
        """The groups this link was given, destroyed by `close` (gloo gives each its own threads
        and sockets, so an engine made after another would otherwise keep every earlier one's)."""
        # own streams per stage boundary where one rank pair carries several (two chunks per rank)
        self._in, self._out = (tags[0] * _STREAM, tags[1] * _STREAM) if tags is not None else (0, 0)
        self.device = device
        self.ordered = (device.type == "cuda" or nccl_rules.installed()) if ordered is None else ordered
        """NCCL ignores tags and pairs a direction's sends and receives in posting order, so on it (and
        on gloo under its rules) activation receives are posted one micro-batch ahead at most."""
        self._wanted: list[int] = []  # ordered: micro-batches whose receives wait for the one ahead
        watch = _watching(device)
        self._from_prev = _Watcher("varuna-p2p-from-prev") if watch and prev_rank is not None else None
        self._from_next = _Watcher("varuna-p2p-from-next") if watch and next_rank is not None else None
        self._headers: dict[int, _Pending] = {}
        self._grads: dict[int, _Pending] = {}
        self._last_in: dict[int, Signature] = {}  # micro-batch -> the shapes it last came with
        self._last_out: dict[int, Signature] = {}  # micro-batch -> the shapes it was last sent with
        self._keys: dict[int, Any] = {}  # micro-batch -> its batch's key in the last step (sender)
        self._promised: list[bool] | None = None  # this step: m -> sent without a header (sender)
        self._step_in: tuple[Any, torch.Tensor] | None = None  # this step's message, posted (receiver)
        self._told: list[bool] | None = None  # this step: m -> header follows, once read (receiver)
        self._sends: list[Any] = []
        self.idle_s = 0.0
        self.comm_s = 0.0
        self.bytes_sent = 0
        self.early_received = 0  # activations that came in the receives posted early with their shape
        self.headers_sent = 0  # activations sent with a header (the others: shapes as last step)

    # a step ------------------------------------------------------------------------------------
    def begin_step(self, micro: Sequence[Mapping[str, Any]]) -> None:
        """Start a step of `len(micro)` micro-batches: tell the next stage which activations come
        with a header (the micro-batches whose batch changed shape), and post the receives of this
        stage's activations early with last step's shapes (`post_activation_header`)."""
        n = len(micro)
        if self.next is not None:
            keys = [batch_key(b) for b in micro]
            every = headers_every()
            header = [every or m not in self._last_out or self._keys.get(m) != k for m, k in enumerate(keys)]
            self._keys = dict(enumerate(keys))
            self._promised = [not h for h in header]
            msg = torch.tensor([n, *map(int, header)], dtype=torch.int64, device=self.device)
            self._sends.append((dist.isend(msg, self.next, tag=self._out + _STEP, group=self._out_act), msg))
        if self.prev is not None:
            buf = torch.empty(n + 1, dtype=torch.int64, device=self.device)
            self._step_in = (dist.irecv(buf, self.prev, tag=self._in + _STEP, group=self._in_act), buf)
            self._told = None
            for m in range(n):
                self.post_activation_header(m)

    def _header_follows(self, mb: int) -> bool:
        """Whether micro-batch `mb`'s activation comes with a header this step (the step's message
        read on first use, in whichever thread resolves activations)."""
        if self._step_in is None:
            return True  # no begin_step: a header with every activation
        if self._told is None:
            work, buf = self._step_in
            work.wait()
            fields = buf.tolist()
            if fields[0] != len(fields) - 1:
                raise RuntimeError(
                    f"the step message says {fields[0]} micro-batches, expected {len(fields) - 1}"
                )
            self._told = [bool(f) for f in fields[1:]]
        if mb >= len(self._told):
            raise RuntimeError(f"micro-batch {mb} received in a step of {len(self._told)} micro-batches")
        return self._told[mb]

    # activations -------------------------------------------------------------------------------
    def post_activation_header(self, mb: int) -> None:
        """Start receiving micro-batch `mb`'s activation early, with the shapes of the previous
        step's `mb`, so waiting later costs nothing (`begin_step` posts every micro-batch's).

        On an ordered transport (NCCL) the receives of a micro-batch whose shape changed are posted
        only once its header is read, after those posted early; so the next micro-batch's are
        posted only when this one is in (queued until then), and both ends post in one order."""
        if self.ordered and self._headers:
            self._wanted.append(mb)
            return
        self._post_header(mb)

    def _post_header(self, mb: int) -> None:
        assert self.prev is not None
        works: list[Any] = []
        pending = self._headers[mb] = _Pending(works, [])
        last = self._last_in.get(mb)
        if last is not None:
            tensors = self._empty(last)
            works += [
                dist.irecv(t, self.prev, tag=self._in + mb * _SLOTS + _EARLY + i, group=self._in_act)
                for i, t in enumerate(tensors)
            ]
            pending.early = (last, tensors)
        if self._step_in is None:  # no step message: the header surely follows, post it now
            works.append(self._post_header_recv(mb, pending))
        if self._from_prev is not None:
            pending.arrival = self._from_prev.watch(works, then=lambda: self._post_data(mb, pending))

    def _post_header_recv(self, mb: int, pending: _Pending) -> Any:
        assert self.prev is not None
        buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        pending.header = dist.irecv(buf, self.prev, tag=self._in + mb * _SLOTS, group=self._in_act)
        pending.buffers.append(buf)
        return pending.header

    def _empty(self, sig: Signature) -> list[torch.Tensor]:
        return empty(sig, self.device)

    def _post_data(self, mb: int, pending: _Pending) -> list[Any]:
        """Resolve micro-batch `mb`'s tensors (blocking on the step message and its header, if one
        follows): the early receives' if it has their shapes (nothing more to wait for), else
        receives posted now, returned."""
        if not self._header_follows(mb):
            if pending.early is None:
                raise RuntimeError(
                    f"micro-batch {mb} came without a header and this stage never saw its shapes"
                )
            pending.is_tuple, pending.data = pending.early[0][0], pending.early[1]
            self.early_received += 1
            return []
        if pending.header is None:  # posted now (else it was among the works already waited for)
            self._post_header_recv(mb, pending).wait()  # a gloo work waited for twice never returns
        sig = decode_signature(pending.buffers[0])
        self._last_in[mb] = sig
        pending.is_tuple = sig[0]
        if pending.early is not None and sig == pending.early[0]:
            pending.data = pending.early[1]
            self.early_received += 1
            return []
        pending.data = self._empty(sig)
        return [
            dist.irecv(t, self.prev, tag=self._in + mb * _SLOTS + _LATE + i, group=self._in_act)
            for i, t in enumerate(pending.data)
        ]

    def activation_ready(self, mb: int) -> bool:
        """Whether micro-batch `mb`'s activation has arrived (with a watcher: all of it; without,
        its first messages, the rest following them)."""
        pending = self._headers.get(mb)
        return pending is not None and pending.ready()

    def recv_activation(self, mb: int) -> Value:
        if mb not in self._headers:
            if self.ordered and (self._headers or (self._wanted and self._wanted[0] != mb)):
                raise RuntimeError(
                    f"micro-batch {mb}'s activation received out of order on an ordered transport "
                    f"(NCCL); posted {sorted(self._headers)}, queued {self._wanted}"
                )
            if mb in self._wanted:
                self._wanted.remove(mb)
            self._post_header(mb)
        pending = self._headers.pop(mb)
        t0 = time.perf_counter()
        pending.wait()
        # no watcher resolved it: the step message and the header (waits for the sender), data posted
        late = self._post_data(mb, pending) if pending.data is None else []
        t1 = time.perf_counter()
        for w in late:
            if w is not None:  # None only for a rank outside the group, never here
                w.wait()
        tensors = pending.data
        assert tensors is not None
        if self.ordered and self._wanted and not self._headers:
            self._post_header(self._wanted.pop(0))
        self.idle_s += t1 - t0
        self.comm_s += time.perf_counter() - t1
        for t in tensors:
            if _floating(t):
                t.requires_grad_()
        return tuple(tensors) if pending.is_tuple else tensors[0]

    def send_activation(self, mb: int, value: Value, *, grad: bool = True) -> None:
        """Send the value at this stage's end cut, and post the receives for its gradients (none
        without `grad`: evaluation sends no gradient back, and a receive left posted would take the
        next step's)."""
        assert self.next is not None
        tensors, sig = outgoing(value)
        last = self._last_out.get(mb)
        t0 = time.perf_counter()
        if self._promised is not None and mb < len(self._promised) and self._promised[mb]:
            if sig != last:  # the next stage waits for the old shapes: this cannot be delivered
                raise PartitionError(
                    f"micro-batch {mb}'s value at the cut changed shape to {describe(sig)} from last step's "
                    f"{describe(last)} while its batch kept its shapes; the stages send shapes only when the "
                    "batch's change. Set VARUNA_P2P_HEADERS=every to send them with every activation"
                )
            early = True
        else:
            early = sig == last
            if last is not None and not early:  # the early receives wait for the old shapes: fill them
                for i, t in enumerate(self._empty(last)):
                    self._sends.append(
                        (
                            dist.isend(
                                t, self.next, tag=self._out + mb * _SLOTS + _EARLY + i, group=self._out_act
                            ),
                            t,
                        )
                    )
        if early:
            self._send_data(mb, _EARLY, tensors)
        if not self._promised or mb >= len(self._promised) or not self._promised[mb]:
            header = encode_signature(sig).to(self.device)
            self._sends.append(
                (dist.isend(header, self.next, tag=self._out + mb * _SLOTS, group=self._out_act), header)
            )
            self.headers_sent += 1
            self._last_out[mb] = sig
            if not early:
                self._send_data(mb, _LATE, tensors)
        if not grad:
            self.comm_s += time.perf_counter() - t0
            return
        grads = [torch.empty_like(t) for t in tensors if _floating(t)]
        works = [
            dist.irecv(g, self.next, tag=self._out + mb * _SLOTS + _GRAD + i, group=self._out_grad)
            for i, g in enumerate(grads)
        ]
        arrival = self._from_next.watch(works) if self._from_next is not None and works else None
        self._grads[mb] = _Pending(works, grads, arrival)
        self.comm_s += time.perf_counter() - t0

    def _send_data(self, mb: int, slot: int, tensors: list[torch.Tensor]) -> None:
        assert self.next is not None
        for i, t in enumerate(tensors):
            self._sends.append(
                (dist.isend(t, self.next, tag=self._out + mb * _SLOTS + slot + i, group=self._out_act), t)
            )
            self.bytes_sent += t.numel() * t.element_size()

    # gradients ---------------------------------------------------------------------------------
    def grad_ready(self, mb: int) -> bool:
        """Whether every gradient of micro-batch `mb`'s output has arrived."""
        pending = self._grads.get(mb)
        return pending is not None and pending.ready()

    def recv_grad(self, mb: int) -> list[torch.Tensor]:
        pending = self._grads.pop(mb)
        t0 = time.perf_counter()
        pending.wait()
        self.idle_s += time.perf_counter() - t0
        return pending.buffers

    def send_grad(self, mb: int, inputs: Value) -> None:
        """Send the gradients of the floating tensors this stage received for `mb`."""
        assert self.prev is not None
        t0 = time.perf_counter()
        for i, g in enumerate(input_grads(inputs)):
            g = g.contiguous()
            self._sends.append(
                (dist.isend(g, self.prev, tag=self._in + mb * _SLOTS + _GRAD + i, group=self._in_grad), g)
            )
            self.bytes_sent += g.numel() * g.element_size()
        self.comm_s += time.perf_counter() - t0

    def shape_probe(self) -> list[int]:
        """Nothing to probe: shapes travel in headers here (see `varuna.comm.serial`)."""
        return []

    def probe_send(self, mb: int, value: Value) -> None:
        """Never called: `shape_probe` lists no micro-batch (`varuna.comm.links.Link`)."""
        raise RuntimeError(f"P2P links carry shapes in headers; micro-batch {mb} needs no probe")

    def probe_recv(self, mb: int) -> Value:
        """Never called: `shape_probe` lists no micro-batch (`varuna.comm.links.Link`)."""
        raise RuntimeError(f"P2P links carry shapes in headers; micro-batch {mb} needs no probe")

    def flush(self) -> None:
        """Nothing is held back here (see `varuna.comm.serial`)."""

    def finish(self) -> None:
        """Wait for every send of the step (their buffers must stay alive until then)."""
        t0 = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._promised = None
        self._step_in = self._told = None
        self.comm_s += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the watcher threads and destroy this link's groups (after the last step's `finish`:
        nothing is in flight then)."""
        for watcher in (self._from_prev, self._from_next):
            if watcher is not None:
                watcher.close()
        for group in self._groups:
            dist.destroy_process_group(group)
        self._groups = []
