"""Point-to-point for NCCL without concurrency between communicators: torch.distributed.pipelining's
discipline, behind the `P2P` interface the runtime uses.

NCCL runs a communicator's operations in posting order and does not promise that operations of
different communicators on one GPU run at the same time (its guide: post them in one order on
every rank). Varuna's `P2P` posts receives early, on a group per direction, so that messages move
while the stage computes; on NCCL that can wait forever in a two-rank job, as
`VARUNA_NCCL_RULES=strict` (every operation of a rank in one posting order) shows on a CPU. Here instead:

- one process group per pipeline replica carries every message of that pipeline (`replica_group`);
- nothing is posted early: a receive is posted when the runtime asks for the value, and waited for;
- each message crosses in one `batch_isend_irecv` on both ends, at its place in a table of ticks
  made from every rank's action list (`varuna.comm._ticks`, torch.distributed.pipelining's
  schedules are such tables): a rank's batch of tick t holds what it made at t and what its
  peers made for it at t, in the senders' order (NCCL pairs a communicator's messages by order
  alone; with two chunks per rank a rank pair carries the messages of several boundaries). Every
  rank posts its batches in tick order, so they pair whatever the timing: through tick t as soon
  as its sends of t are made, and when it needs a message (the receives are waited for only
  then; one that came before its chunk asked waits in an inbox). Posting each send on its own as
  it is made deadlocks instead: in Varuna's schedule stage 0 recomputes between sending
  activation 1 and receiving gradient 0, and stage 1 works between sending gradient 0 and
  receiving activation 1, so each rank's send waits for a receive queued behind the other's send
  (the strict rules showed it);
- every message's shapes are known before it comes: a cut's shapes follow its micro-batch's
  (`batch_key`), and a step with a key not seen before first sends one micro-batch of that key
  through the pipeline, stage after stage, without gradients (eval mode, the random state
  untouched), each activation after a header (the runtime's shape probe: `shape_probe`,
  `probe_send`, `probe_recv`; torch.distributed.pipelining infers shapes at start-up the same
  way). A value whose shapes then differ from its key's is a PartitionError on the sender;
  VARUNA_P2P_HEADERS=every probes every micro-batch of every step.

Varuna's pull-ahead (a forward run while a gradient is late) keeps the table's order: a message
counts as here once its batch is posted and reports completion (`Courier.arrived`; NCCL's works
do, gloo's only once waited for), and a forward run ahead holds its send until every send of
the earlier ticks is made. The price is the overlap the early receives bought (`P2P` keeps them
for gloo) and the pull-ahead of stages whose next activation's batch waits behind their own
late send. `VARUNA_P2P=serial`
chooses this path on gloo as well; NCCL and `VARUNA_NCCL_RULES=strict` choose it by default
(`wanted`); `VARUNA_P2P=early` keeps `P2P` everywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from varuna.comm import nccl_rules
from varuna.comm._shapes import (
    HEADER_LEN,
    Signature,
    batch_key,
    decode_signature,
    describe,
    empty,
    encode_signature,
    headers_every,
)
from varuna.comm._ticks import Message, exchange_ticks
from varuna.comm.p2p import Value, input_grads, outgoing
from varuna.errors import ConfigError, PartitionError

__all__ = ["Courier", "Plan", "SerialLink", "plan", "replica_group", "wanted"]

ENV = "VARUNA_P2P"


def wanted(device: torch.device, chunks_per_rank: int, schedule: str) -> bool:
    """Whether the pipeline's links are `SerialLink`s: on NCCL (a CUDA device) and under
    ``VARUNA_NCCL_RULES=strict``, unless ``VARUNA_P2P=early``; with ``VARUNA_P2P=serial`` on gloo
    too. Any number of chunks per rank (`chunks_per_rank`, `schedule`: for the message)."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode not in ("", "serial", "early"):
        raise ConfigError(
            f"{ENV}={mode!r} (schedule {schedule!r}, {chunks_per_rank} chunk(s) per rank): expected "
            "'serial' or 'early' (unset: serial on NCCL)"
        )
    if mode:
        return mode == "serial"
    return device.type == "cuda" or nccl_rules.strict_wanted()


@dataclass(frozen=True)
class Plan:
    """This rank's part of the step's exchange table (`varuna.comm._ticks`): each of its messages'
    tick; per tick the messages it receives, (sending rank, message) in the sender's order, and
    how many it sends."""

    ticks: dict[Message, int]
    incoming: dict[int, list[tuple[int, Message]]]
    outgoing: dict[int, int]


def plan(
    schedule: Mapping[int, Sequence[Any]], rank_of: Callable[[int], int], position: int, rank: int
) -> Plan:
    """The `Plan` of this `rank`, at pipeline `position`, for every position's actions `schedule`
    (`rank_of`: virtual stage -> position)."""
    ticks: dict[Message, int] = {}
    incoming: dict[int, list[tuple[int, Message]]] = {}
    outgoing: dict[int, int] = {}
    for msg, (tick, sender) in exchange_ticks(schedule, rank_of).items():
        if sender == position:
            ticks[msg] = tick
            outgoing[tick] = outgoing.get(tick, 0) + 1
        elif rank_of(msg[1]) == position:
            ticks[msg] = tick
            incoming.setdefault(tick, []).append((rank - position + sender, msg))
    return Plan(ticks, incoming, outgoing)


def replica_group(pipeline: int, data: int, replica: int, device: torch.device) -> Any:
    """Create one group per pipeline replica (every rank creates all of them, in one order) and
    return this rank's, its communicators made up front: a collective on it (NCCL's batched
    point-to-point runs on the group's own communicator) and one batched exchange per neighbour
    pair, in pipeline order on every rank."""
    from varuna.comm.groups import warm
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
    """This rank's messages on its pipeline's group, and what every message's shapes are.

    With a `Plan`, each message crosses in the batch of its tick (`varuna.comm._ticks`). This rank
    posts its batches tick after tick, without waiting for them: through tick t once its sends of
    t are all made (so its neighbour gets an activation while it computes the next one), when it
    needs a message of tick t or later, and at `flush`. A received message waits, posted, in the
    inbox until its chunk asks; then its receive is waited for. Without a plan (a single link
    used directly), a receive takes just the message asked for, in one batch with every held send.
    """

    def __init__(self, group: Any, device: torch.device, plan: Plan | None = None) -> None:
        self.group = group
        self.device = device
        self.plan = plan
        self._last = max(plan.ticks.values(), default=-1) if plan is not None else -1
        self._held: dict[int, list[Any]] = {}  # tick -> P2POps of sends not posted yet (-1: no plan)
        self._made: dict[int, int] = {}  # tick -> messages made for it so far
        self._done = -1  # the last tick whose batch is posted
        self._inbox: dict[Message, tuple[list[torch.Tensor], list[_Once]]] = {}  # posted, not taken
        self._works: list[Any] = []  # sends in flight, waited for at `finish`
        self._buffers: list[torch.Tensor] = []  # their tensors, alive until then
        self._keys: list[Hashable] = []  # this step: micro-batch -> its key
        self._cuts: dict[tuple[int, Hashable], Signature] = {}  # (receiving stage, key) -> shapes
        self._sent: dict[tuple[int, int], list[torch.Tensor]] = {}  # (stage, m) -> floats sent
        self._unknown: list[int] = []  # this step's micro-batches to probe
        self._micro: Sequence[Mapping[str, Any]] | None = None  # this step's micro-batches

    def close(self) -> None:
        """Destroy the pipeline's group (after the last step's `finish`: nothing is in flight)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def replan(self, plan: Plan) -> None:
        """Between steps: the ticks of a new order's messages (`varuna.engine.refit`)."""
        self.plan = plan
        self._last = max(plan.ticks.values(), default=-1)

    # the step ----------------------------------------------------------------------------------
    def begin_step(self, micro: Sequence[Mapping[str, Any]]) -> None:
        """Start a step (once, whichever link asks first): the micro-batches' keys, and one
        micro-batch of each key whose cut shapes are not known yet (every one with
        VARUNA_P2P_HEADERS=every)."""
        if micro is self._micro:
            return
        self._micro = micro
        if self._inbox or any(self._held.values()):
            raise RuntimeError(
                f"serial links: the last step left messages {sorted(self._inbox)} unused and "
                f"{sum(map(len, self._held.values()))} sends unposted (did it stop half-way?)"
            )
        self._done = -1
        self._made.clear()
        self._sent.clear()
        if headers_every():
            self._cuts.clear()
            self._keys = [("every", m) for m in range(len(micro))]
        else:
            self._keys = [batch_key(b) for b in micro]
        known = {key for _, key in self._cuts}
        self._unknown = []
        for m, key in enumerate(self._keys):
            if key not in known:
                known.add(key)
                self._unknown.append(m)

    def unknown(self) -> list[int]:
        return list(self._unknown)

    def learn(self, stage: int, mb: int, sig: Signature) -> None:
        """Micro-batch `mb`'s value into `stage` has shapes `sig` (the probe's, on both ends)."""
        self._cuts[(stage, self._keys[mb])] = sig

    def cut(self, stage: int, mb: int) -> Signature:
        sig = self._cuts.get((stage, self._keys[mb]))
        if sig is None:
            raise RuntimeError(
                f"serial links: the shapes of micro-batch {mb}'s activation into stage {stage} were never "
                "probed; the runtime must run the shape probe (`shape_probe`) before the step's actions"
            )
        return sig

    # sending -----------------------------------------------------------------------------------
    def send(self, msg: Message, tensors: list[torch.Tensor], peer: int) -> None:
        """Hold `msg`'s tensors for `peer` until the batch of its tick (an activation's floating
        tensors give the shapes of the gradient coming back)."""
        kind, stage, mb = msg
        if kind == "F":
            self._sent[(stage - 1, mb)] = [t for t in tensors if t.is_floating_point()]
        tick = self._tick(msg) if self.plan is not None else -1
        self._held.setdefault(tick, []).extend(dist.P2POp(dist.isend, t, peer, self.group) for t in tensors)
        self._made[tick] = self._made.get(tick, 0) + 1
        if self.plan is not None:
            self._post_ready()

    def deliver(self, tensors: list[torch.Tensor], peer: int) -> None:
        """Send `tensors` to `peer` now, in one batch, and wait for them (the shape probe)."""
        self._post([dist.P2POp(dist.isend, t, peer, self.group) for t in tensors], sends=len(tensors))
        self._wait_sends()

    # receiving ---------------------------------------------------------------------------------
    def take(self, msg: Message, peer: int) -> list[torch.Tensor]:
        """Message `msg` from `peer`: from the inbox, or once this rank's batches up to its tick
        are through (without a plan: received now, with every held send)."""
        if msg not in self._inbox:
            if self.plan is None:
                sends = self._held.pop(-1, [])
                bufs = self._empty(msg)
                ops = sends + [dist.P2POp(dist.irecv, t, peer, self.group) for t in bufs]
                for once in self._post(ops, len(sends)):
                    once.wait()
                return bufs
            self._advance(self._tick(msg))
        bufs, waits = self._inbox.pop(msg)
        for once in waits:
            once.wait()
        return bufs

    def arrived(self, msg: Message) -> bool:
        """Whether `msg` is here, without waiting: its batch is posted and its receives report
        completion (NCCL's and the rules' works do; gloo's only once waited for)."""
        entry = self._inbox.get(msg)
        return entry is not None and all(once.completed() for once in entry[1])

    def receive(self, tensors: list[torch.Tensor], peer: int) -> None:
        """Receive `tensors` from `peer` now, in one batch (the shape probe)."""
        for once in self._post([dist.P2POp(dist.irecv, t, peer, self.group) for t in tensors], sends=0):
            once.wait()

    def _tick(self, msg: Message) -> int:
        assert self.plan is not None
        tick = self.plan.ticks.get(msg)
        if tick is None:
            raise RuntimeError(f"serial links: message {msg} is not in this rank's exchange table")
        return tick

    def _post_ready(self) -> None:
        """Post the next ticks' batches while this rank's sends of each are all made (the
        receives of ticks where it sends nothing go out with them)."""
        assert self.plan is not None
        while self._done < self._last and self._complete(self._done + 1):
            self._advance(self._done + 1)

    def _complete(self, tick: int) -> bool:
        assert self.plan is not None
        return self._made.get(tick, 0) >= self.plan.outgoing.get(tick, 0)

    def _advance(self, until: int) -> None:
        """Post this rank's batches of the ticks up to `until`, one after another (not waited)."""
        assert self.plan is not None
        for tick in range(self._done + 1, until + 1):
            if not self._complete(tick):  # its batch would go out without a send its peer expects
                raise RuntimeError(
                    f"serial links: tick {tick}'s batch is due (a message of tick {until} is wanted) but this "
                    f"rank made {self._made.get(tick, 0)} of its {self.plan.outgoing[tick]} sends of that tick: "
                    "the runtime ran its actions out of the exchange table's order"
                )
            sends = self._held.pop(tick, [])
            coming = [(peer, msg, self._empty(msg)) for peer, msg in self.plan.incoming.get(tick, [])]
            recvs = [dist.P2POp(dist.irecv, t, peer, self.group) for peer, _, bufs in coming for t in bufs]
            if not (sends or recvs):
                continue
            waits = self._post(sends + recvs, len(sends))
            for _, msg, bufs in coming:
                self._inbox[msg], waits = (bufs, waits[: len(bufs)]), waits[len(bufs) :]
        self._done = max(self._done, until)

    def _empty(self, msg: Message) -> list[torch.Tensor]:
        kind, stage, mb = msg
        if kind == "B":
            return [torch.empty_like(t) for t in self._sent.pop((stage, mb))]
        return empty(self.cut(stage, mb), self.device)

    def _post(self, ops: list[Any], sends: int) -> list[_Once]:
        """Post `ops` (their first `sends` are sends) in one batch; for each receive, what to wait
        for before using its tensor: its own work (gloo), or the batch's one work (NCCL coalesces
        a batch: waiting for it orders the sends too)."""
        works = dist.batch_isend_irecv(ops)
        self._buffers += [op.tensor for op in ops[:sends]]
        if len(works) == len(ops):  # one work per operation (gloo)
            self._works += works[:sends]
            return [_Once(w) for w in works[sends:]]
        (batch,) = [_Once(w) for w in works]
        self._works.append(batch)
        return [batch] * (len(ops) - sends)

    def flush(self) -> None:
        """Post the held sends (before a collective, and at the end of the step's actions: a
        peer waiting for them, or in a collective for this rank, would wait forever); with a plan,
        wait for every send too, so that a collective on another communicator starts only once
        this rank's point-to-point is through (NCCL's guide: use communicators in separate
        epochs; on a GPU the wait orders the streams)."""
        if self.plan is not None:
            if self._held:
                self._advance(max(self._held))
            self._wait_sends()
            return
        ops = self._held.pop(-1, [])
        if ops:
            self._works += dist.batch_isend_irecv(ops)
            self._buffers += [op.tensor for op in ops]

    def finish(self) -> None:
        """Post what is held and wait for every send (their buffers must live until then)."""
        self.flush()
        self._wait_sends()
        if self._inbox:
            raise RuntimeError(f"serial links: messages {sorted(self._inbox)} came and were never used")

    def _wait_sends(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._buffers.clear()


class _Once:
    """A work waited for at most once (a gloo work waited for twice never returns)."""

    __slots__ = ("work", "done")

    def __init__(self, work: Any) -> None:
        self.work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True

    def completed(self) -> bool:
        return self.done or bool(self.work.is_completed())


class SerialLink:
    """The `P2P` interface over a `Courier`: one chunk's (virtual stage `stage`'s) neighbours,
    each message crossing at its tick (see the module docstring)."""

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        courier: Courier,
        stage: int = 0,
    ) -> None:
        self.prev, self.next = prev_rank, next_rank
        self.device = device
        self.courier = courier
        self.stage = stage
        self.ordered = True
        self.idle_s = 0.0
        self.comm_s = 0.0
        self.bytes_sent = 0
        self.early_received = 0
        self.headers_sent = 0  # activations sent with a header (the shape probe's)

    def begin_step(self, micro: Sequence[Mapping[str, Any]]) -> None:
        self.courier.begin_step(micro)

    def shape_probe(self) -> list[int]:
        """The micro-batches the runtime must send through the pipeline before this step's
        actions (`probe_send`, `probe_recv`), so that every activation's shapes are known."""
        return self.courier.unknown()

    def probe_send(self, mb: int, value: Value) -> None:
        """Send micro-batch `mb`'s probe value (a header, then its tensors; each waited for)."""
        assert self.next is not None
        tensors, sig = outgoing(value)
        self.courier.deliver([encode_signature(sig).to(self.device)], self.next)
        self.courier.deliver(tensors, self.next)
        self.courier.learn(self.stage + 1, mb, sig)
        self.headers_sent += 1

    def probe_recv(self, mb: int) -> Value:
        assert self.prev is not None
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self.courier.receive([header], self.prev)
        sig = decode_signature(header)
        self.courier.learn(self.stage, mb, sig)
        tensors = empty(sig, self.device)
        self.courier.receive(tensors, self.prev)
        return tuple(tensors) if sig[0] else tensors[0]

    def post_activation_header(self, mb: int) -> None:
        """Nothing is posted early on this path."""

    def activation_ready(self, mb: int) -> bool:
        """Whether micro-batch `mb`'s activation is here (Varuna's pull-ahead asks): a forward
        run ahead keeps the exchange table's order, since its send waits for its tick's batch."""
        return self.courier.arrived(("F", self.stage, mb))

    def grad_ready(self, mb: int) -> bool:
        return self.courier.arrived(("B", self.stage, mb))

    def recv_activation(self, mb: int) -> Value:
        assert self.prev is not None
        t0 = time.perf_counter()
        tensors = self.courier.take(("F", self.stage, mb), self.prev)
        self.idle_s += time.perf_counter() - t0
        for t in tensors:
            if t.is_floating_point():
                t.requires_grad_()
        return tuple(tensors) if self.courier.cut(self.stage, mb)[0] else tensors[0]

    def send_activation(self, mb: int, value: Value, *, grad: bool = True) -> None:
        """Send it (its gradient comes in a message of its own, received when asked for: nothing
        is posted for it here, with `grad` or without)."""
        assert self.next is not None
        tensors, sig = outgoing(value)
        known = self.courier.cut(self.stage + 1, mb)
        if sig != known:  # the next stage receives with the probed shapes: this cannot be delivered
            raise PartitionError(
                f"micro-batch {mb}'s value at the cut after stage {self.stage} has shapes {describe(sig)}, not the "
                f"{describe(known)} a micro-batch of the same shapes had; the serial links (NCCL) learn a cut's "
                "shapes once per batch shape. Set VARUNA_P2P_HEADERS=every to learn them for every micro-batch"
            )
        self.courier.send(("F", self.stage + 1, mb), tensors, self.next)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def recv_grad(self, mb: int) -> list[torch.Tensor]:
        assert self.next is not None
        t0 = time.perf_counter()
        grads = self.courier.take(("B", self.stage, mb), self.next)
        self.idle_s += time.perf_counter() - t0
        return grads

    def send_grad(self, mb: int, inputs: Value) -> None:
        assert self.prev is not None
        grads = [g.contiguous() for g in input_grads(inputs)]
        self.courier.send(("B", self.stage - 1, mb), grads, self.prev)
        self.bytes_sent += sum(g.numel() * g.element_size() for g in grads)

    def flush(self) -> None:
        self.courier.flush()

    def finish(self) -> None:
        t0 = time.perf_counter()
        self.courier.finish()
        self.comm_s += time.perf_counter() - t0

    def close(self) -> None:
        pass
