"""Point-to-point transfer of the values crossing a cut, with their shapes, and gradient buckets.

A value at a cut is a tensor or a tuple of tensors whose shapes may change from step to step
(variable sequence length), so every activation travels behind a small int64 header:

    [is_tuple, n, dtype_0, ndim_0, d0, d1, ..., dtype_1, ndim_1, ...]   (HEADER_LEN slots)

Gradients flow back with exactly the shapes of the activations sent, so they need no header and
their receives are posted as soon as the activation leaves, overlapping with compute.

gloo and NCCL move a message only once its receive is posted. So that an activation too moves
while the receiving stage still computes, the receiver posts the receives of micro-batch m's
tensors at the start of the step with the shapes m had in the previous step, on their own tags
("early" receives). Both ends keep the last header of every m: when the new header equals it,
the sender sends the tensors to the early receives; when it differs (or for the first step, with
no early receives), it sends the tensors after the header as usual, and placeholders of the old
shapes to any early receives, so that no receive is left posted with the wrong size.

Tags keep the streams apart: one pair of neighbouring ranks carries activations one way and
gradients the other; within a stream messages match in order (FIFO), and the tag also carries
the micro-batch index so a mismatch fails loudly instead of silently pairing wrong tensors.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from varuna.errors import PartitionError

__all__ = ["HEADER_LEN", "Value", "flatten_value", "encode_header", "decode_header", "P2P", "GradBuckets"]

HEADER_LEN = 64
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_SLOTS = 128  # tag = microbatch * _SLOTS + slot: 0 header, 1.. activations, 32.. gradients, 64.. early
_LATE, _GRAD, _EARLY = 1, 32, 64

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


def encode_header(tensors: list[torch.Tensor], is_tuple: bool) -> torch.Tensor:
    fields = [int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise PartitionError(f"cannot send a {t.dtype} tensor across a cut; supported: {_DTYPES}")
        fields += [_CODE[t.dtype], t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise PartitionError(
            f"the value at a cut has too many tensors or dimensions to describe in {HEADER_LEN} slots "
            f"({len(tensors)} tensors); pass fewer tensors through the CutPoint"
        )
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[list[tuple[torch.dtype, tuple[int, ...]]], bool]:
    fields = header.tolist()
    is_tuple, n = bool(fields[0]), fields[1]
    specs, pos = [], 2
    for _ in range(n):
        dtype, ndim = _DTYPES[fields[pos]], fields[pos + 1]
        shape = tuple(fields[pos + 2 : pos + 2 + ndim])
        specs.append((dtype, shape))
        pos += 2 + ndim
    return specs, is_tuple


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
    only when its receive is posted; waiting for the stage's main thread to post it cost 2-7 ms
    per activation on a loaded host)."""

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
    early: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    """The header the early receives were posted for and their tensors (in `works`, after the header)."""

    def ready(self) -> bool:
        if self.arrival is not None:
            return self.arrival.done.is_set()
        return all(w.is_completed() for w in self.works)

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
    (off by default until measured on a quiet host; see the README)."""
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
    ) -> None:
        self.prev = prev_rank
        self.next = next_rank
        self.device = device
        self.ordered = device.type == "cuda" if ordered is None else ordered
        """NCCL ignores tags and pairs a direction's sends and receives in posting order, so on it
        activation receives are posted one micro-batch ahead at most (`post_activation_header`)."""
        self._wanted: list[int] = []  # ordered: micro-batches whose receives wait for the one ahead
        watch = _watching(device)
        self._from_prev = _Watcher("varuna-p2p-from-prev") if watch and prev_rank is not None else None
        self._from_next = _Watcher("varuna-p2p-from-next") if watch and next_rank is not None else None
        self._headers: dict[int, _Pending] = {}
        self._grads: dict[int, _Pending] = {}
        self._last_in: dict[int, torch.Tensor] = {}  # micro-batch -> the header it last came with
        self._last_out: dict[int, torch.Tensor] = {}  # micro-batch -> the header it was last sent with
        self._sends: list[Any] = []
        self.idle_s = 0.0
        self.comm_s = 0.0
        self.bytes_sent = 0
        self.early_received = 0  # activations that came in the receives posted early with their shape

    # activations -------------------------------------------------------------------------------
    def post_activation_header(self, mb: int) -> None:
        """Start receiving micro-batch `mb`'s header early, and its tensors too with the shapes
        of the previous step's `mb`, so waiting later costs nothing.

        On an ordered transport (NCCL) the receives of a micro-batch whose shape changed are posted
        only once its header is read, after those posted early; so the next micro-batch's are
        posted only when this one is in (queued until then), and both ends post in one order."""
        if self.ordered and self._headers:
            self._wanted.append(mb)
            return
        self._post_header(mb)

    def _post_header(self, mb: int) -> None:
        assert self.prev is not None
        buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        works = [dist.irecv(buf, self.prev, tag=mb * _SLOTS)]
        pending = self._headers[mb] = _Pending(works, [buf])
        last = self._last_in.get(mb)
        if last is not None:
            tensors = self._empty(last)
            works += [dist.irecv(t, self.prev, tag=mb * _SLOTS + _EARLY + i) for i, t in enumerate(tensors)]
            pending.early = (last, tensors)
        if self._from_prev is not None:
            pending.arrival = self._from_prev.watch(works, then=lambda: self._post_data(mb, pending))

    def _empty(self, header: torch.Tensor) -> list[torch.Tensor]:
        specs, _ = decode_header(header)
        return [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs]

    def _post_data(self, mb: int, pending: _Pending) -> list[Any]:
        """Micro-batch `mb`'s tensors, whose header `pending` holds: the early receives' if it
        matches theirs (nothing more to wait for), else receives posted now."""
        header = pending.buffers[0]
        self._last_in[mb] = header
        if pending.early is not None and torch.equal(header, pending.early[0]):
            pending.data = pending.early[1]
            self.early_received += 1
            return []
        pending.data = self._empty(header)
        return [dist.irecv(t, self.prev, tag=mb * _SLOTS + _LATE + i) for i, t in enumerate(pending.data)]

    def activation_ready(self, mb: int) -> bool:
        """Whether micro-batch `mb`'s activation has arrived (with a watcher: all of it; without,
        its header, the data following it)."""
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
        t1 = time.perf_counter()
        _, is_tuple = decode_header(pending.buffers[0])
        if pending.data is None:  # no watcher posted them: post the data's receives now
            for w in self._post_data(mb, pending):
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
        return tuple(tensors) if is_tuple else tensors[0]

    def send_activation(self, mb: int, value: Value) -> None:
        """Send the value at this stage's end cut, and post the receives for its gradients."""
        assert self.next is not None
        tensors, is_tuple = flatten_value(value)
        tensors = [t.detach().contiguous() for t in tensors]
        header = encode_header(tensors, is_tuple).to(self.device)
        t0 = time.perf_counter()
        self._sends.append((dist.isend(header, self.next, tag=mb * _SLOTS), header))
        last = self._last_out.get(mb)
        early = last is not None and torch.equal(header, last)
        if last is not None and not early:  # the early receives wait for the old shapes: fill them
            for i, t in enumerate(self._empty(last)):
                self._sends.append((dist.isend(t, self.next, tag=mb * _SLOTS + _EARLY + i), t))
        self._last_out[mb] = header
        slot = _EARLY if early else _LATE
        for i, t in enumerate(tensors):
            self._sends.append((dist.isend(t, self.next, tag=mb * _SLOTS + slot + i), t))
            self.bytes_sent += t.numel() * t.element_size()
        grads = [torch.empty_like(t) for t in tensors if _floating(t)]
        works = [dist.irecv(g, self.next, tag=mb * _SLOTS + _GRAD + i) for i, g in enumerate(grads)]
        arrival = self._from_next.watch(works) if self._from_next is not None and works else None
        self._grads[mb] = _Pending(works, grads, arrival)
        self.comm_s += time.perf_counter() - t0

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
        tensors, _ = flatten_value(inputs)
        t0 = time.perf_counter()
        for i, t in enumerate(x for x in tensors if _floating(x)):
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            g = g.contiguous()
            self._sends.append((dist.isend(g, self.prev, tag=mb * _SLOTS + _GRAD + i), g))
            self.bytes_sent += g.numel() * g.element_size()
        self.comm_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for every send of the step (their buffers must stay alive until then)."""
        t0 = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self.comm_s += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the watcher threads (after the last step; they hold nothing then)."""
        for watcher in (self._from_prev, self._from_next):
            if watcher is not None:
                watcher.close()


class GradBuckets:
    """Gradients as views into a few flat buffers, all-reduced (averaged) bucket by bucket.

    Making `p.grad` a view of the bucket means backward accumulates straight into the buffer the
    all-reduce sends: no copies in either direction.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], bucket_bytes: int = 25 * 2**20) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for p in self.params:
            if bucket and (size + p.numel() * p.element_size() > bucket_bytes or p.dtype != bucket[0].dtype):
                self._add_bucket(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel() * p.element_size()
        if bucket:
            self._add_bucket(bucket)

    def _add_bucket(self, params: list[torch.nn.Parameter]) -> None:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            self._views.append((p, flat[offset : offset + p.numel()].view_as(p)))
            offset += p.numel()
        self.buffers.append(flat)

    def zero_and_attach(self) -> None:
        """Zero the buffers and point every parameter's .grad at its view (undoing zero_grad(None))."""
        for flat in self.buffers:
            flat.zero_()
        for p, view in self._views:
            if p.grad is not view:
                p.grad = view

    def allreduce_mean(self, group: Any, world: int) -> list[Any]:
        """Start the averaging all-reduce of every bucket; returns the works to wait for."""
        works = []
        for flat in self.buffers:
            flat.div_(world)
            works.append(dist.all_reduce(flat, group=group, async_op=True))
        return works
