"""Telemetry in the workers: lifecycle events, per-action spans, per-step metrics and memory.

    engine ──attach──> Telemetry ──> RUN_DIR/events/rank{r}.jsonl      (always, when there is a run dir)
                           │    └──> ZeroMQ PUSH to VARUNA_EVENTS      (signed; dropped, never waited for)
                           └──<── ZeroMQ SUB from VARUNA_COMMANDS      (checkpoint / stop / set)

The engine makes three calls: `Telemetry.attach(engine)` at the end of construction (emits
`hello` and `ready`), `poll()` before the per-step all-reduce (rank 0's `checkpoint`/`stop`
commands ride that all-reduce, so every rank acts on the same step) and `on_step(loss, times)`;
and, as they happen, `checkpoint_done` (blocking or background), `on_notice` (a preemption notice:
a `notice` event) and `on_stop` (the ranks agreed to stop: a `stop_decided` event).
It is the engine's and the runtime's observer (`varuna.engine.observer.Observer`): the
runtime calls `step()` around each step's actions (to count the bytes autograd saves for backward
on sampled steps, and to report an exception as an `error` event) and `on_send` after each send;
`attach` adds optimizer step hooks.

Heartbeats (`varuna.telemetry.heartbeat`): with a controller, a thread sends a `heartbeat` event
every ``VARUNA_HEARTBEAT_S`` (1) seconds with the rank's host and its last ``action`` ("step 7",
"step 7: sent F mb 3", "step 7: all-reduce", "after step 7", which includes checkpoints and the
script's own work between steps) and since when; heartbeats are sent, not logged. The socket is
shared with the main thread under a lock, and each message is stamped (sender, seq) and sent under
that same lock, so sequence numbers reach the controller in order. Commands are verified like the
controller verifies events (`varuna.telemetry.events.Receiver`); a dropped one is reported once in
a `commands_dropped` event with the counts by reason.

Environment: ``VARUNA_TELEMETRY=0`` turns it off; ``VARUNA_TELEMETRY_SPANS_EVERY=N`` records the
spans of every N-th step (default 1) and ``VARUNA_TELEMETRY_MIN_INTERVAL_S`` at most one spans
event per that many seconds; per-step metrics are always sent. Counting the activations saved for
backward costs a Python call per saved tensor (a visible share of a small step), so it runs on the first
recorded step of the process and every ``VARUNA_TELEMETRY_MEMORY_EVERY`` (20) recorded steps; the
other steps repeat the last figure, and so do the gradient and optimizer-state bytes (a walk over
every parameter), which are redone on those steps or when the optimizer changes. Times are
wall-clock seconds (``time.time()``): the runtime's perf_counter stamps are shifted by one offset
per process.

Pausing: ``paused = True`` (or the controller's ``set(paused=True)``, acted on by every rank at its
next step) records, logs and sends nothing per step until resumed; lifecycle events and commands
still go through: `python -m varuna.bench telemetry` uses it as the "off" of its on/off comparison
(what "on" costs is nearly all the two per-step events, JSON-encoded for the log and the message).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from varuna._log import log
from varuna.errors import ConfigError
from varuna.telemetry import heartbeat as _heartbeat
from varuna.telemetry.activations import activation_peak
from varuna.telemetry.events import COMMAND_FIELDS, MAX_MESSAGE_BYTES, EventLog, Receiver, Sender, encode
from varuna.telemetry.settings import SETTINGS, check_settings

__all__ = ["Telemetry"]

_KIND = {"RECV_F": "recv", "RECV_B": "recv", "SEND_F": "send", "SEND_B": "send", "ALLREDUCE": "allreduce"}
_HWM = 10_000


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int | None:
    """The current resident set size (Linux), else None."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)  # os.* not pathlib: this runs every step
        try:
            return int(os.read(fd, 256).split()[1]) * _PAGE
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return None


def _tensor_bytes(value: Any) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Telemetry:
    """One rank's telemetry; a disabled one (no run dir, no controller, or VARUNA_TELEMETRY=0) does nothing."""

    def __init__(self, engine: Any = None) -> None:
        self.enabled = False
        self.drops = 0
        self.spans_every = max(int(os.environ.get("VARUNA_TELEMETRY_SPANS_EVERY", "1") or 1), 1)
        self.min_interval_s = float(os.environ.get("VARUNA_TELEMETRY_MIN_INTERVAL_S", "0") or 0)
        self.memory_every = max(int(os.environ.get("VARUNA_TELEMETRY_MEMORY_EVERY", "20") or 20), 1)
        self._engine = engine
        self._log: EventLog | None = None
        self._push: Any = None
        self._sub: Any = None
        self._key = b""
        self._sender = Sender(f"rank{getattr(engine, 'rank', '')}")
        self._commands: Receiver | None = None
        self._reported_drops = 0
        self._send_lock = threading.Lock()
        self._beater: _heartbeat.Beater | None = None
        self.action, self._action_since = "starting", time.time()
        """What this rank does now, for its heartbeats."""
        self._offset = time.time() - time.perf_counter()
        self._last_spans = -float("inf")
        self.paused = False
        """True: nothing recorded, logged or sent per step (lifecycle events and commands still are)."""
        self._recorded = 0
        self._recording = True
        self._sampled = False
        self._counting = False
        self._packs: list[tuple[float, int]] = []
        self._seen: set[int] = set()
        self._send_bytes: dict[tuple[str, int], int] = {}
        self._activations = 0
        self._run_end: float | None = None
        self._optim: list[float] = []
        self._optim_hooked: Any = None
        self._state_bytes: tuple[int, int] | None = None
        self._state_key: tuple[int, int] | None = None
        self._checkpoint_wanted = False
        self._job = ""
        self._launch = 1
        self._param_ptrs: set[int] = set()
        self._params_bytes = 0

    # construction ------------------------------------------------------------------------------
    @classmethod
    def attach(cls, engine: Any) -> Telemetry:
        """The engine's telemetry: open the sinks from the environment, observe, say hello and ready."""
        self = cls(engine)
        run_dir = engine.config.run_dir
        address = os.environ.get("VARUNA_EVENTS")
        if os.environ.get("VARUNA_TELEMETRY", "1") == "0" or (run_dir is None and not address):
            return self
        self.enabled = True
        self._job = os.environ.get("VARUNA_JOB_ID", "")
        self._launch = int(os.environ.get("VARUNA_LAUNCH", "1") or 1)
        if run_dir is not None:
            self._log = EventLog(Path(run_dir) / "events" / f"rank{engine.rank}.jsonl")
        if address:
            self._connect(address, os.environ.get("VARUNA_COMMANDS"), os.environ.get("VARUNA_EVENTS_KEY", ""))
        self._param_ptrs = {p.untyped_storage().data_ptr() for _, p in engine.named_parameters()}
        self._params_bytes = sum(p.numel() * p.element_size() for p in engine.parameters())
        cfg = engine.config
        self.emit(
            "hello",
            host=socket.gethostname(),
            pid=os.getpid(),
            device=str(engine.device),
            pipeline=cfg.pipeline,
            data=cfg.data,
            world=engine.world_size,
            schedule=cfg.schedule,
            num_microbatches=cfg.num_microbatches,
            global_batch_size=cfg.global_batch_size,
            resumed_from=str(engine.resumed_from) if engine.resumed_from else None,
        )
        self.emit("ready")
        self._set_action("idle")
        interval = _heartbeat.heartbeat_interval()
        if self._push is not None and interval > 0:
            self._beater = _heartbeat.Beater(self._beat, interval)
            atexit.register(self._last_beat)
        return self

    def _set_action(self, action: str) -> None:
        self.action, self._action_since = action, time.time()

    def _beat(self) -> None:
        try:
            self._emit(
                "heartbeat",
                {"host": socket.gethostname(), "action": self.action, "action_since": self._action_since},
                log=False,
            )
        except Exception:  # noqa: BLE001, S110 - a socket closed at exit must not print from a daemon thread
            pass

    def _last_beat(self) -> None:
        """At interpreter exit: stop the beats and say "exited", so the controller expects no more."""
        if self._beater is not None:
            self._beater.stop()
            self._set_action("exited")
            self._beat()

    def _connect(self, events: str, commands: str | None, key_hex: str) -> None:
        import zmq  # only workers that report to a controller need it

        self._key = bytes.fromhex(key_hex)
        self._commands = Receiver(self._key, COMMAND_FIELDS, "cmd")
        ctx: Any = zmq.Context.instance()
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, _HWM)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(events)
        if commands:
            self._sub = ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_MESSAGE_BYTES)  # memory guard; Receiver counts
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.connect(commands)

    # the runtime's calls (`varuna.engine.observer.Observer`) ---------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's actions: decide what this step records, count the bytes autograd saves
        for backward on counting steps, report an exception as an `error` event."""
        engine = self._engine
        step = engine.step_count + 1 if engine is not None else 0
        self._sampled = self._should_sample(step)
        self._set_action(f"step {step - 1}")
        # `paused` as the step starts holds for the whole step (a `set` lands in the middle)
        self._recording = recording = self.enabled and not self.paused
        self._recorded += recording
        self._counting = recording and (self._recorded == 1 or self._recorded % self.memory_every == 0)
        self._packs, self._seen = [], set()
        try:
            if self._counting:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                    yield
            else:
                yield
        except BaseException as exc:
            if not isinstance(exc, SystemExit):
                self.error(exc)
            raise
        finally:
            self._run_end = time.perf_counter()
            self._set_action(f"step {step - 1}: all-reduce")

    def on_send(self, kind: str, microbatch: int, nbytes: int) -> None:
        """Bytes of one send, for the span's `bytes` field."""
        self._send_bytes[(kind, microbatch)] = nbytes
        if self._beater is not None:
            self._set_action(f"{self.action.split(':')[0]}: sent {kind[-1]} mb {microbatch}")

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """A saved-for-backward tensor: count its storage once unless it is a parameter's.

        Returns it detached: the same storage, without its grad_fn. A node saving its own output
        would otherwise hold that output, which holds the node: a cycle through autograd's C++ that
        Python's collector cannot see, so the graph of any forward not followed by its backward
        stayed alive with everything it reached (the engine among it, through this method)."""
        if not t.is_meta:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._param_ptrs and ptr not in self._seen:
                self._seen.add(ptr)
                self._packs.append((time.perf_counter(), storage.nbytes()))
        return t.detach()

    def _should_sample(self, step: int) -> bool:
        if not self.enabled or self.paused or step % self.spans_every:
            return False
        return time.monotonic() - self._last_spans >= self.min_interval_s

    # sending -----------------------------------------------------------------------------------
    def emit(self, kind: str, **fields: Any) -> None:
        """Stamp an event (type, rank, stage, replica, step, time, job, sender, seq), log it, send it."""
        self._emit(kind, fields, log=True)

    def _emit(self, kind: str, fields: dict[str, Any], *, log: bool) -> None:
        if not self.enabled:
            return
        engine = self._engine
        event = {
            "type": kind,
            "rank": engine.rank if engine else None,
            "stage": engine.stage if engine else None,
            "replica": engine.replica if engine else None,
            "step": engine.step_count if engine else None,
            "time": time.time(),
            "job": self._job,
            "launch": self._launch,
            **fields,
        }
        with self._send_lock:
            self._sender.stamp(event)
            if self._log is not None and log:
                self._log.write(event)
            if self._push is not None:
                import zmq

                frames = encode(self._key, event)
                if sum(map(len, frames)) > MAX_MESSAGE_BYTES:
                    self.drops += 1  # the controller would refuse it; the log has it
                    return
                try:
                    self._push.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    self.drops += 1

    def error(self, exc: BaseException) -> None:
        """An `error` event for an exception leaving the step."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.emit("error", error_type=type(exc).__name__, message=str(exc), traceback=text)

    def checkpoint_done(self, info: dict[str, Any] | None, *, exit_code: int | None = None) -> None:
        """After a checkpoint's commit: a `checkpoint_done` event (``blocking`` False, with the
        ``copy_s`` the step spent, for one written in the background), and `exit` (with `exit_code`,
        the engine's morph exit status) when the job now morphs."""
        blocking = info is None or info.get("blocking", True) is not False
        if blocking:  # a background write that ends is not the checkpoint a controller asked for
            self._checkpoint_wanted = False
        if info is not None:
            extra = {} if blocking else {"copy_s": info.get("copy_s")}
            self.emit(
                "checkpoint_done",
                **{k: info[k] for k in ("path", "bytes", "seconds")},
                saved_step=info["step"],
                blocking=blocking,
                **extra,
            )
        if exit_code is not None and self._engine is not None:
            self.emit("exit", code=exit_code, reason=f"stop requested ({self._engine.stop_request.reason})")

    def on_notice(self, notice: dict[str, Any]) -> None:
        """A `notice` event: this rank got a preemption notice (reason, deadline, hosts, source,
        seconds_left)."""
        self.emit("notice", **notice)

    def on_stop(self, decision: dict[str, Any]) -> None:
        """A `stop_decided` event: the ranks stop after this step (reason, deadline, seconds_left,
        decided_here, step_s, checkpoint_s, needed_s)."""
        self.emit("stop_decided", **decision)

    # commands ----------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Read pending commands without waiting; True when rank 0 was asked for a checkpoint now.

        `stop` sets the engine's stop request (the morph path then checkpoints and exits); `set`
        changes the sampling on every rank; `checkpoint` and `stop` are acted on by rank 0 only, so
        that the per-step all-reduce makes every rank act on the same step.
        """
        engine = self._engine
        if engine is not None and engine.optimizer is not None and self._optim_hooked is not engine.optimizer:
            self._hook_optimizer(engine.optimizer)
        if self._sub is None or engine is None or self._commands is None:
            return False
        import zmq

        while True:
            try:
                frames = self._sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            command = self._commands.accept(frames)
            if command is None:
                continue
            name = command.get("cmd")
            if name == "set":
                self._apply_settings(command)
            elif engine.rank == 0 and name == "checkpoint":
                self._checkpoint_wanted = True
            elif engine.rank == 0 and name == "stop":
                engine.stop_request.set("controller")
        dropped = sum(self._commands.dropped.values())
        if dropped != self._reported_drops:
            self._reported_drops = dropped
            self.emit("commands_dropped", counts=dict(self._commands.dropped))
        return self._checkpoint_wanted

    def _apply_settings(self, command: dict[str, Any]) -> None:
        """A `set` command: every value checked first; a bad one is reported and nothing changes."""
        try:
            settings = check_settings({k: v for k, v in command.items() if k in SETTINGS})
        except ConfigError as exc:
            log.warning("varuna: ignored the controller's set command: %s", exc)
            return
        for name, value in settings.items():
            setattr(self, name, value)

    @property
    def last_step_counted_memory(self) -> bool:
        """Whether the last step counted the activations saved for backward (the costly sample)."""
        return self._counting

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(lambda *_: self._optim.append(time.perf_counter()))
        optimizer.register_step_post_hook(lambda *_: self._optim.append(time.perf_counter()))
        self._optim_hooked = optimizer

    # per step ----------------------------------------------------------------------------------
    def on_step(self, loss: float, times: Any) -> None:
        """The step's spans (when sampled) and its metrics and memory (always)."""
        if not self.enabled or self._engine is None:
            return
        self._set_action(f"after step {self._engine.step_count - 1}")
        if not self._recording:
            self._optim.clear()
            self._send_bytes.clear()
            return
        cfg = self._engine.config
        done = self._engine.step_count - 1  # per-step events carry the index of the step they describe
        if self._sampled:
            self._last_spans = time.monotonic()
            self.emit("spans", spans=self._spans(times), step=done)
        if self._counting:
            self._activations = self._activation_peak(times)
        self._optim.clear()
        self._send_bytes.clear()
        total = max(times.total_s, 1e-12)
        self.emit(
            "step_metrics",
            step=done,
            loss=loss,
            time_s=times.total_s,
            compute_s=times.compute_s,
            comm_s=times.comm_s,
            idle_s=times.idle_s,
            samples_per_s=cfg.global_batch_size / total,
            bubble=max(0.0, 1.0 - times.compute_s / total),
            memory=self.memory(),
            drops=self.drops,
        )

    def _spans(self, times: Any) -> list[dict[str, Any]]:
        engine, off = self._engine, self._offset
        assert engine is not None
        prev, nxt = engine.rank - 1, engine.rank + 1
        out: list[dict[str, Any]] = []
        for s in times.spans:
            kind = _KIND.get(s.kind, s.kind)
            span: dict[str, Any] = {
                "kind": kind,
                "mb": s.microbatch,
                "start": s.start + off,
                "end": s.end + off,
            }
            if s.stage is not None:  # several chunks per rank: the virtual stage it ran for
                span["vstage"] = s.stage
            if kind in ("send", "recv"):
                direction = s.kind[-1]
                span["dir"] = direction
                span["peer"] = nxt if (direction == "F") == (kind == "send") else prev
                if s.stage is not None:
                    span["peer"] = engine.rank_of_stage(s.stage + (1 if span["peer"] == nxt else -1))
                if kind == "send":
                    span["bytes"] = self._send_bytes.get((s.kind, s.microbatch or 0))
            elif kind == "allreduce":
                span["bytes"] = sum(b.numel() * b.element_size() for b in engine._buckets.buffers)
            out.append(span)
        if self._run_end is not None:
            end = self._optim[0] if self._optim else time.perf_counter()
            out.append(
                {
                    "kind": "allreduce",
                    "mb": None,
                    "start": self._run_end + off,
                    "end": end + off,
                    "wait": True,
                }
            )
        if len(self._optim) >= 2:
            out.append(
                {"kind": "optim", "mb": None, "start": self._optim[0] + off, "end": self._optim[-1] + off}
            )
        return out

    def _activation_peak(self, times: Any) -> int:
        """Peak bytes saved for backward during the step (`activation_peak`)."""
        return activation_peak(self._packs, times.spans)

    def memory(self) -> dict[str, Any]:
        """This stage's memory: parameters, gradients, optimizer state, activations, peak."""
        engine = self._engine
        assert engine is not None
        opt = engine.optimizer
        key = (id(opt), len(opt.state) if opt is not None else 0)
        if self._state_bytes is None or self._counting or key != self._state_key:
            self._state_bytes, self._state_key = self._grads_and_optimizer_bytes(), key
        grads, optimizer = self._state_bytes
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        mem: dict[str, Any] = {
            "params_bytes": self._params_bytes,
            "grads_bytes": grads,
            "optimizer_bytes": optimizer,
            "activations_bytes": self._activations,
            "rss_bytes": _rss_bytes(),
            "peak_rss_bytes": ru if sys.platform == "darwin" else ru * 1024,
        }
        if engine.device.type == "cuda":
            mem["cuda_allocated_bytes"] = torch.cuda.memory_allocated(engine.device)
            mem["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(engine.device)
            mem["cuda_reserved_bytes"] = torch.cuda.memory_reserved(engine.device)
            torch.cuda.reset_peak_memory_stats(engine.device)
        return mem

    def _grads_and_optimizer_bytes(self) -> tuple[int, int]:
        """Bytes of the gradients' storages and of the optimizer's state tensors (a walk over every
        parameter, whose cost grows with the number of tensors, so `memory` redoes it only on the
        steps that count activations, or when the optimizer or its number of states changed)."""
        engine = self._engine
        assert engine is not None
        grads: dict[int, int] = {}
        for p in engine.parameters():
            if p.grad is not None:
                grads[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
        optimizer = 0
        if engine.optimizer is not None:
            for state in engine.optimizer.state.values():
                optimizer += sum(_tensor_bytes(v) for v in state.values())
        return sum(grads.values()), optimizer
