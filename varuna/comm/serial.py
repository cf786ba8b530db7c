"""Point-to-point for NCCL without concurrency between communicators: torch.distributed.pipelining's
discipline, behind the `P2P` interface the runtime uses.

NCCL runs a communicator's operations in posting order and does not promise that operations of
different communicators on one GPU run at the same time (its guide: post them in one order on
every rank). Varuna's `P2P` posts receives early, on a group per direction, so that messages move
while the stage computes; the GPU runs hung in every two-rank job, and `VARUNA_NCCL_RULES=strict`
(every operation of a rank in one posting order) hangs them the same way on a CPU. Here instead:

- one process group per pipeline replica carries every message of that pipeline (`replica_group`);
- nothing is posted early: a receive is posted when the runtime asks for the value, and waited for;
- sends wait in this rank's `Courier` until its next receive and go out in one `batch_isend_irecv`
  with it: the batches of two neighbours then pair up in order (stage s's "send activation k,
  receive gradient j" against stage s+1's "send gradient j, receive activation k"), as
  torch.distributed.pipelining's do. Sending earlier, before the rank computes, deadlocks: in
  Varuna's schedule stage 0 recomputes between sending activation 1 and receiving gradient 0, and
  stage 1 works between sending gradient 0 and receiving activation 1, so each rank's send would
  wait for a receive queued behind the other's send (the strict rules showed it);
- an activation's shapes travel in a fixed-size header before it (the receiver posts its data
  receive once the header is in), so shapes may change from step to step.

The price is the overlap the early receives bought (`P2P` keeps them for gloo), and Varuna's
pull-ahead, which would change the order the neighbours' batches pair with. `VARUNA_P2P=serial`
chooses this path on gloo as well; NCCL and `VARUNA_NCCL_RULES=strict` choose it by default for
one chunk per rank (`wanted`); `VARUNA_P2P=early` keeps `P2P` everywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from varuna.comm import nccl_rules
from varuna.comm._shapes import HEADER_LEN, decode_signature, encode_signature, signature
from varuna.comm.p2p import Value, flatten_value, input_grads
from varuna.errors import ConfigError

__all__ = ["Courier", "SerialLink", "replica_group", "wanted"]

ENV = "VARUNA_P2P"


def wanted(device: torch.device, chunks_per_rank: int, schedule: str) -> bool:
    """Whether the pipeline's links are `SerialLink`s: with one chunk per rank, on NCCL (a CUDA
    device) and under ``VARUNA_NCCL_RULES=strict``, unless ``VARUNA_P2P=early``; with
    ``VARUNA_P2P=serial`` on gloo too. Several chunks per rank keep `P2P` (a group per virtual
    boundary): one group per pipeline pairs a rank pair's messages of different boundaries by
    posting order alone, which their schedules do not keep. Receiving each peer's messages in its
    own send order (the schedule says it) fixes that, but not the header: the receiver posts an
    activation's header and its data in two batches while the sender posts both in one, and with
    two chunks per rank those batches stop pairing (interleaved-1f1b deadlocked so under strict).
    That needs the shapes known before the data arrives, as torch.distributed.pipelining has them
    from its shape inference at start-up."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode not in ("", "serial", "early"):
        raise ConfigError(f"{ENV}={mode!r}: expected 'serial' or 'early' (unset: serial on NCCL)")
    if mode == "serial" and chunks_per_rank > 1:
        raise ConfigError(
            f"{ENV}=serial runs one chunk per rank; schedule {schedule!r} places {chunks_per_rank}. "
            f"Choose a one-chunk schedule (gpipe, 1f1b, varuna, zb-h1) or unset {ENV}"
        )
    if mode:
        return mode == "serial"
    return chunks_per_rank == 1 and (device.type == "cuda" or nccl_rules.strict_wanted())


def replica_group(pipeline: int, data: int, replica: int, device: torch.device) -> Any:
    """Create one group per pipeline replica (every rank creates all of them, in one order) and
    return this rank's, its communicators made up front: a collective on it (NCCL's batched
    point-to-point runs on the group's own communicator) and one batched exchange per neighbour
    pair, in pipeline order on every rank."""
    from varuna.comm.links import warm
    from varuna.comm.rendezvous import group_timeout

    groups = [
        dist.new_group(list(range(r * pipeline, (r + 1) * pipeline)), timeout=group_timeout())
        for r in range(data)
    ]
    mine = groups[replica]
    dist.all_reduce(torch.zeros(1, device=device), group=mine)
    first = replica * pipeline
    pairs = [(mine, low, low + 1) for low in range(first, first + pipeline - 1)]
    warm(pairs, dist.get_rank(), device, batched=True)
    return mine


class Courier:
    """This rank's outgoing messages, held until they can go out together with the next receive."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._pending: list[Any] = []  # P2POps of sends not posted yet
        self._works: list[Any] = []  # sends in flight, waited for at `finish`
        self._buffers: list[torch.Tensor] = []  # their tensors, alive until then

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self._pending.append(dist.P2POp(dist.isend, tensor, peer, self.group))

    def recv(self, tensors: list[torch.Tensor], peer: int) -> None:
        """Post `tensors`' receives from `peer` with every held send, in one batch; wait for them."""
        sends = len(self._pending)
        ops = self._pending + [dist.P2POp(dist.irecv, t, peer, self.group) for t in tensors]
        self._pending = []
        works = dist.batch_isend_irecv(ops)
        self._buffers += [op.tensor for op in ops[:sends]]
        if len(works) == len(ops):  # one work per operation (gloo)
            self._works += works[:sends]
            todo = works[sends:]
        else:  # NCCL coalesces the batch into one work: waiting for it orders the sends too
            todo = works
        for work in todo:
            work.wait()

    def flush(self) -> None:
        """Post the held sends (before a collective, and at the end of the step's actions: a
        collective the peer waits in would otherwise wait for them)."""
        if self._pending:
            ops, self._pending = self._pending, []
            self._works += dist.batch_isend_irecv(ops)
            self._buffers += [op.tensor for op in ops]

    def finish(self) -> None:
        """Post what is held and wait for every send (their buffers must live until then)."""
        self.flush()
        for work in self._works:
            work.wait()
        self._works.clear()
        self._buffers.clear()


class SerialLink:
    """The `P2P` interface over a `Courier`: one chunk's neighbours, every message posted just in
    time (see the module docstring)."""

    def __init__(
        self, prev_rank: int | None, next_rank: int | None, device: torch.device, courier: Courier
    ) -> None:
        self.prev, self.next = prev_rank, next_rank
        self.device = device
        self.courier = courier
        self.ordered = True
        self._sent: dict[int, list[torch.Tensor]] = {}  # micro-batch -> floating tensors sent (grad shapes)
        self.idle_s = 0.0
        self.comm_s = 0.0
        self.bytes_sent = 0
        self.early_received = 0
        self.headers_sent = 0

    def begin_step(self, micro: Sequence[Mapping[str, Any]]) -> None:
        self._sent.clear()

    def post_activation_header(self, mb: int) -> None:
        """Nothing is posted early on this path."""

    def activation_ready(self, mb: int) -> bool:
        return True  # see grad_ready

    def grad_ready(self, mb: int) -> bool:
        """Always "yes": Varuna's pull-ahead (running forwards while a gradient is late) would
        change this rank's order of sends and receives, which must stay the one its neighbours'
        batches pair with (under the strict rules it deadlocks), so the runtime just waits."""
        return True

    def recv_activation(self, mb: int) -> Value:
        assert self.prev is not None
        t0 = time.perf_counter()
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self.courier.recv([header], self.prev)
        t1 = time.perf_counter()
        is_tuple, specs = decode_signature(header)
        tensors = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs]
        self.courier.recv(tensors, self.prev)
        self.idle_s += t1 - t0
        self.comm_s += time.perf_counter() - t1
        for t in tensors:
            if t.is_floating_point():
                t.requires_grad_()
        return tuple(tensors) if is_tuple else tensors[0]

    def send_activation(self, mb: int, value: Value) -> None:
        assert self.next is not None
        tensors, is_tuple = flatten_value(value)
        tensors = [t.detach().contiguous() for t in tensors]
        self.courier.send(encode_signature(signature(tensors, is_tuple)).to(self.device), self.next)
        for t in tensors:
            self.courier.send(t, self.next)
            self.bytes_sent += t.numel() * t.element_size()
        self.headers_sent += 1
        self._sent[mb] = [t for t in tensors if t.is_floating_point()]

    def recv_grad(self, mb: int) -> list[torch.Tensor]:
        assert self.next is not None
        grads = [torch.empty_like(t) for t in self._sent.pop(mb)]
        t0 = time.perf_counter()
        self.courier.recv(grads, self.next)
        self.idle_s += time.perf_counter() - t0
        return grads

    def send_grad(self, mb: int, inputs: Value) -> None:
        assert self.prev is not None
        for g in input_grads(inputs):
            g = g.contiguous()
            self.courier.send(g, self.prev)
            self.bytes_sent += g.numel() * g.element_size()

    def flush(self) -> None:
        self.courier.flush()

    def finish(self) -> None:
        t0 = time.perf_counter()
        self.courier.finish()
        self.comm_s += time.perf_counter() - t0

    def close(self) -> None:
        pass
