"""gloo under NCCL's point-to-point rules, so a CPU run shows what a GPU run would do.

NCCL differs from gloo in three ways that decide whether a pipeline's messages arrive:

1. it ignores tags: within one communicator, a rank pair's sends and receives match in the order
   they were posted, so a receive posted out of order gets another message's tensor;
2. it runs a communicator's operations one after another on one stream: an operation starts only
   once the one posted before it has finished, so a receive posted early holds back every later
   send on that communicator, and two ranks that each wait for the other's held-back send hang;
3. it creates a pair's communicator on the first send or receive there (torch's lazy start), and
   creation blocks the caller until the peer's first call there arrives too: two ranks whose first
   operations are on different groups each wait in creation for the other;
4. (``VARUNA_NCCL_RULES=strict`` only) NCCL does not promise that operations of different
   communicators on one GPU run at the same time (its guide: use them in separate epochs, or post
   them in the same order on every rank): strict runs every point-to-point operation of a rank,
   whatever its communicator, one after another in posting order, the worst case that promise
   allows. What passes strict needs no concurrency from the GPU.

gloo does neither (tags match, operations proceed independently), so a schedule can pass every CPU
test and hang on its first GPU step. Activations and gradients of a rank pair on one communicator
hang by rule 2, hence a group per direction and stage boundary (`varuna.comm.groups`); a stage whose
first operation is an early gradient receive while its peer's is an activation receive hangs by
rule 3, hence every group is created up front in one order (`varuna.comm.groups.warm`). The GPU
sessions page of the docs (docs/benchmarks/gpu.md) records the runs that hung so.

`install()` (``VARUNA_NCCL_RULES=1`` on gloo; `init_distributed` calls it) replaces
``torch.distributed.isend``, ``irecv`` and ``batch_isend_irecv`` (a batch's operations proceed
together, the batch taking one place in each communicator's order) with ones that keep the rules:
one FIFO worker per (group, rank pair) carries each operation to its end, with tag 0, before it
starts the next, and is created only once the peer's first operation on that pair has come (met
through the job's store). A mispairing then delivers a wrong tensor or fails on its size; a
hold-back makes ``wait()`` raise `NcclRuleError` after ``VARUNA_TIMEOUT`` seconds, naming the
communicator and the operation at its head, or a creation the peer never joined. Collectives keep
gloo's behaviour (they run in one order on every rank anyway).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from varuna.errors import VarunaError

__all__ = ["NcclRuleError", "install", "installed", "strict_wanted", "uninstall", "wanted"]

ENV = "VARUNA_NCCL_RULES"


class NcclRuleError(VarunaError, RuntimeError):
    """An operation that would hang (or pair wrongly) on NCCL, found on gloo."""


def wanted() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")


def strict_wanted() -> bool:
    """``VARUNA_NCCL_RULES=strict``: rule 4 as well (see the module docstring)."""
    return os.environ.get(ENV, "").strip().lower() == "strict"


class _Work:
    def __init__(self, stream: _Stream, what: str) -> None:
        self.stream = stream
        self.what = what
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        if not self.done.wait(_timeout_s()):
            head = self.stream.head()
            where = (
                "is at the head of its communicator, and the peer never posted its counterpart there "
                "(held behind another operation, or posted in another order)"
                if head.startswith(self.what)
                else f"waits behind {head} on its communicator"
            )
            raise NcclRuleError(
                f"{self.what} did not finish in {_timeout_s():g} s under NCCL's rules: it {where} "
                f"({self.stream.name}); on NCCL this hangs. Post a communicator's operations in the "
                "order its peer posts them, and put the two directions of a rank pair on two "
                "communicators (varuna.comm.groups)."
            )
        if self.error is not None:
            raise self.error
        return True


class _Stream:
    """One communicator's operations between one rank pair, carried out one after another."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._head: tuple[str, float] | None = None
        self._thread = threading.Thread(target=self._run, name=f"varuna-nccl-rules {name}", daemon=True)
        self._thread.start()

    def head(self) -> str:
        head = self._head
        return "nothing" if head is None else f"{head[0]} ({time.monotonic() - head[1]:.1f} s ago)"

    def post(self, run: Callable[[], object], what: str) -> _Work:
        """Queue `run` (which carries out one operation, or one batch, to its end)."""
        work = _Work(self, what)
        self._queue.put((run, work))
        return work

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            run, work = item
            self._head = (work.what, time.monotonic())
            try:
                run()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                work.error = exc
            finally:
                self._head = None
                work.done.set()

    def close(self) -> None:
        self._queue.put(None)


_original: tuple[Any, Any, Any, Any, Any] | None = None
_streams: dict[tuple[int, int, int], _Stream] = {}
_lock = threading.Lock()


_TIMEOUT_S = [120.0]  # install() sets the job's (VARUNA_TIMEOUT)


def _timeout_s() -> float:
    return _TIMEOUT_S[0]


def _stream(group: Any, peer: int) -> _Stream:
    me = dist.get_rank()
    key = (0 if group is None else id(group), min(me, peer), max(me, peer))
    with _lock:
        stream = _streams.get(key)
        if stream is None:
            gname = "default" if group is None else f"group {getattr(group, 'group_name', len(_streams))}"
            stream = _streams[key] = _Stream(f"{gname} ranks {key[1]}<->{key[2]}")
            new = True
        else:
            new = False
    if new:
        _create(stream, me, peer)
    return _SERIAL[0] or stream


_SERIAL: list[_Stream | None] = [None]  # rule 4 (strict): one order for every communicator


def _forget(group: Any) -> None:
    """Stop the workers of `group`'s rank pairs (every worker for None: the whole job's groups)."""
    with _lock:
        for key in [k for k in _streams if group is None or k[0] == id(group)]:
            _streams.pop(key).close()


def _create(stream: _Stream, me: int, peer: int) -> None:
    """Rule 3: the first operation on a communicator returns only once the peer's first operation
    on it has come too (NCCL's creation is collective and blocking)."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"varuna-nccl-rules/{stream.name}/"
    store.set(prefix + str(me), "1")
    try:
        store.wait([prefix + str(peer)], timedelta(seconds=_timeout_s()))
    except Exception as exc:  # noqa: BLE001 - the store's timeout (its type differs across versions)
        raise NcclRuleError(
            f"the first operation on {stream.name} waited {_timeout_s():g} s for rank {peer}'s first "
            f"operation there: NCCL creates a communicator on first use and blocks until both ranks "
            f"arrive, so rank {peer}, starting another communicator first, would wait for this one; "
            "on NCCL this hangs. Create every communicator up front in one order on every rank "
            "(varuna.comm.groups.warm)."
        ) from exc


def _run_batch(ops: list[Any], gloo_isend: Any, gloo_irecv: Any, isend: Any) -> None:
    started = [
        (gloo_isend if op.op is isend else gloo_irecv)(op.tensor, op.peer, group=op.group, tag=0)
        for op in ops
    ]
    for w in started:
        if w is not None:
            w.wait()


def install(timeout_s: float = 120.0, *, strict: bool = False) -> None:
    """Route ``torch.distributed.isend``/``irecv`` through NCCL's rules (idempotent); a send or
    receive not done after `timeout_s` raises `NcclRuleError`. `strict`: rule 4 too."""
    global _original
    _TIMEOUT_S[0] = timeout_s
    if _original is not None:
        return
    if strict:
        _SERIAL[0] = _Stream("every communicator of this rank, in posting order (strict: rule 4)")
    c10d = dist.distributed_c10d
    _original = (dist.isend, dist.irecv, dist.batch_isend_irecv, c10d._check_op, dist.destroy_process_group)
    send, recv = dist.send, dist.recv
    destroy = dist.destroy_process_group
    gloo_isend, gloo_irecv = dist.isend, dist.irecv

    # NCCL ignores tags: pairing is by order alone, so every operation goes with tag 0
    def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any) -> _Work:
        what = f"send of {tuple(tensor.shape)} to rank {dst} (tag {tag})"
        return _stream(group, dst).post(lambda: send(tensor, dst, group=group, tag=0), what)

    def irecv(
        tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any
    ) -> _Work:
        if src is None:
            raise NcclRuleError("a receive from any source has no NCCL counterpart: name the source rank")
        what = f"receive of {tuple(tensor.shape)} from rank {src} (tag {tag})"
        return _stream(group, src).post(lambda: recv(tensor, src, group=group, tag=0), what)

    def batch_isend_irecv(ops: list[Any]) -> list[_Work]:
        """NCCL runs a batch as one group call: its operations proceed together, and the batch as a
        whole takes its place in each communicator's order."""
        works: list[_Work] = []
        by_pair: dict[tuple[int, int], list[Any]] = {}
        for op in ops:
            by_pair.setdefault((id(op.group), op.peer), []).append(op)
        done: dict[tuple[int, int], _Work] = {}
        if _SERIAL[0] is not None:  # strict: the whole batch is one unit of the rank's one order
            for mine in by_pair.values():
                _stream(mine[0].group, mine[0].peer)  # each pair's communicator is made first
            unit = _SERIAL[0].post(
                lambda: _run_batch(ops, gloo_isend, gloo_irecv, isend), f"batch of {len(ops)}"
            )
            return [unit for _ in ops]
        for key, mine in by_pair.items():

            def run(mine: list[Any] = mine) -> None:
                _run_batch(mine, gloo_isend, gloo_irecv, isend)

            kinds = ", ".join("send" if op.op is isend else "receive" for op in mine)
            what = f"batch ({kinds}) with rank {mine[0].peer}"
            done[key] = _stream(mine[0].group, mine[0].peer).post(run, what)
        for op in ops:
            works.append(done[(id(op.group), op.peer)])
        return works

    def check_op(op: Any) -> None:  # P2POp(dist.isend, ...) must accept these two as well
        if op not in (isend, irecv):
            check_original(op)

    def destroy_process_group(group: Any = None) -> None:
        """A destroyed group's workers stop with it (a new group may get its id)."""
        _forget(group)
        destroy(group)

    check_original = c10d._check_op
    dist.isend, dist.irecv, dist.batch_isend_irecv = isend, irecv, batch_isend_irecv  # type: ignore[assignment]
    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    c10d._check_op = check_op
    if dist.get_rank() == 0:
        said = "strict" if strict else "1"
        print(
            f"varuna: point-to-point follows NCCL's rules on gloo ({ENV}={said})", file=sys.stderr, flush=True
        )


def installed() -> bool:
    return _original is not None


def uninstall() -> None:
    """Put gloo's own isend/irecv back and stop the workers (tests)."""
    global _original
    if _original is None:
        return
    (
        dist.isend,
        dist.irecv,
        dist.batch_isend_irecv,
        dist.distributed_c10d._check_op,
        dist.destroy_process_group,
    ) = _original  # type: ignore[assignment]
    _original = None
    _forget(None)
    if _SERIAL[0] is not None:
        _SERIAL[0].close()
        _SERIAL[0] = None
