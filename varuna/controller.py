"""`JobController`: start, watch and steer a job from a Python process that is never an MPI rank.

    ctl = JobController.start(["train.py"], pipeline=2, data=2)     # the job's agent launches it
    ctl.state                       # starting, running, checkpointing, morphing, stopped, failed, finished
    ctl.timeline(); ctl.step_metrics(); ctl.memory(); ctl.ranks()    # plain data for the widgets
    ctl.checkpoint()                # every rank checkpoints at the end of the same step
    ctl.resize(pipeline=4, data=1)  # stop with a checkpoint, relaunch in the new shape from it
    ctl.stop(); ctl.resume()        # ... and later relaunch from checkpoints/latest
    JobController.attach("runs/x")  # after a kernel restart: full control again, and the live view
    ctl.silent_ranks()              # ranks not heard from for silent_after_s (default 10 s): host, last action
    ctl.stragglers()                # [{"rank": 3, "host": "node7", "ratio": 1.9, "steps": [4, 5, 6], ...}]
    ctl.compute_grid()              # rank x step compute seconds, hosts: the workbench's heatmap
    ctl.exclude_host("node7")       # relaunch without node7: a resize to the shape its other hosts fit

The job does not live in this process: `start` hands it to its own supervisor process
(`varuna.elastic.agent`), which runs mpiexec in a session of its own and relaunches after morphs, so a
kernel that crashes or restarts takes nothing with it. This process talks to the agent through files in
the run directory (the agent's state and notes; the intents it writes) and to the ranks over ZeroMQ:
they PUSH signed events to this process's PULL socket and SUBscribe to its PUB socket for commands (bound
to loopback, or when the hostfile names other hosts to the address routing toward them, unless `interface=`
says otherwise; see varuna.telemetry.events). The key reaches the agent and the ranks in their environment
only, kept for `attach` in controller.json (0600). A stop (`stop`, `resize`) goes both ways: the command,
heard at the end of the step, and a stop file (`varuna.launch.notices`) rank 0 reads within half a
second, because a PUB socket drops what it sends before a rank's SUB has (re)connected, as it has not
yet for a moment after `attach` binds the addresses again. A thread notes `rank_silent`/`rank_back` as ranks'
heartbeats stop and resume (varuna.telemetry.heartbeat); another `host_dead` when every rank of a host
went silent, and the agent relaunches without it (varuna.elastic.hosts; `error` names the host). Stragglers
are detected in the launcher (`varuna.telemetry.straggler_watch`), which records its events in
``RUN_DIR/events/stragglers.jsonl``; the controller reads them into its store. No Jupyter here.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import zmq

from varuna.elastic import agent as _agent
from varuna.elastic.agent import host_source, legacy_state
from varuna.elastic.hosts import HostWatch, controller_interface, host_down
from varuna.elastic.hostset import DEFAULT_SETTLE_S, check_settle
from varuna.elastic.protocol import request_resize
from varuna.elastic.reshape import ShapeChoice, shape_for_gpus
from varuna.errors import ConfigError, LaunchError, check_int
from varuna.launch.exclude import write_without
from varuna.launch.job import Job
from varuna.launch.launches import ConsoleTail, DeadRank, FileTail, LaunchView
from varuna.launch.notices import post_stop
from varuna.launch.pids import check_status
from varuna.planner.cluster import Placement
from varuna.telemetry import events as _events
from varuna.telemetry.channel import Channel
from varuna.telemetry.heartbeat import DEFAULT_SILENT_AFTER_S, Liveness, SilentRank, watch_silence
from varuna.telemetry.settings import check_settings
from varuna.telemetry.store import EventStore, StoreViews
from varuna.telemetry.straggler_watch import LOG as STRAGGLER_LOG
from varuna.telemetry.stragglers import ComputeGrid, compute_grid

__all__ = ["JobController", "JobState", "DeadRank", "LaunchView", "SilentRank"]

JobState = Literal["starting", "running", "checkpointing", "morphing", "stopped", "failed", "finished"]
TERMINAL = ("stopped", "failed", "finished")


class JobController(StoreViews):
    """One job's controller; make it with `start` or `attach`."""

    def __init__(
        self,
        run_dir: Path,
        *,
        interface: str | None = None,
        key: str | None = None,
        silent_after_s: float = DEFAULT_SILENT_AFTER_S,
    ) -> None:
        self.liveness = Liveness(silent_after_s)  # validates silent_after_s first
        self.hosts = HostWatch()  # a host of the launch silent for hosts.dead_after_s (5 s) is dead
        self.run_dir = Path(run_dir).absolute()
        self.interface = interface
        """Where the sockets bind; None: loopback, or toward the hosts of a hostfile naming others."""
        self.key = key or _events.new_key()
        self.store = EventStore()
        self.console = ConsoleTail()
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._channel: Channel | None = None
        self._threads: list[threading.Thread] = []
        self._views: dict[str, LaunchView] = {}
        self._order: list[str] = []
        self._agent_state: dict[str, Any] | None = None
        self._overlay: tuple[str, str | None] | None = None  # ("morphing", from job) / ("checkpointing", job)
        self._notes = FileTail(self.run_dir / _agent.NOTES)
        self._console_log = FileTail(self.run_dir / "logs" / "console.log")
        self._straggler_log = FileTail(self.run_dir / STRAGGLER_LOG)
        self._reconciled: set[str] = set()
        self._legacy: JobState | None = None  # a run without an agent (`varuna run`): attach only
        self.error: str | None = None
        """Why the job's supervisor failed, when it did."""

    # sockets and files -------------------------------------------------------------------------
    def _bind(
        self, events: str | None = None, commands: str | None = None, hostfile: str | Path | None = None
    ) -> None:
        interface = self.interface or controller_interface(Path(hostfile) if hostfile else None)
        self._channel = Channel(
            self.run_dir, self.key, self._on_event, interface=interface, events=events, commands=commands
        )
        self.events_address = self._channel.events_address
        self.commands_address = self._channel.commands_address
        self._spawn(lambda: watch_silence(self.silent_ranks, self._note, self._closing))
        self._spawn(lambda: self.hosts.watch(self._running_hellos, self._host_dead, self._closing))

    def _running_hellos(self) -> tuple[str, list[dict[str, Any]]] | None:
        job = self.job
        if job is None or job.code is not None:
            return None
        return job.job_id, self.store.events("hello", job=job.job_id)

    def _host_dead(self, job: str, host: str, ranks: list[int], silent_s: float) -> None:
        """A host whose ranks all went silent: a `host_dead` event, and the agent relaunches without it."""
        self._note(
            "host_dead",
            host=host,
            how="silent",
            ranks=ranks,
            silent_s=round(silent_s, 1),
            reason=f"no word from any rank on {host} for {silent_s:.1f} s",
        )
        self._intent("host_lost", hosts=[host], job=job)

    def _on_event(self, event: dict[str, Any]) -> None:
        self.liveness.see(event)
        self.hosts.see(event)
        if event["type"] != "heartbeat":  # a beat a second per rank: counted as life, not stored
            self.store.add(event)

    def _spawn(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, daemon=True, name="varuna-controller")
        self._threads.append(thread)
        thread.start()

    def _send(self, cmd: str, **fields: Any) -> None:
        if self._channel is None:
            raise LaunchError("this controller has no command socket (the job is not running under it)")
        self._channel.send(cmd, **fields)

    def _note(self, kind: str, **fields: Any) -> None:
        """An event of the controller's own, stored and logged to events/controller.jsonl."""
        job = self._order[-1] if self._order else None
        event = {
            "type": kind,
            "rank": None,
            "time": time.time(),
            "job": job,
            "id": uuid.uuid4().hex,
            **fields,
        }
        self._add(event)
        log = _events.EventLog(self.run_dir / "events" / "controller.jsonl")
        log.write(event)
        log.close()

    def _add(self, event: dict[str, Any]) -> None:
        """Store one of the controller's or the agent's notes; a dead host becomes the `error`."""
        self.store.add(event)
        self.error = host_down(event) or self.error

    def _pump(self) -> None:
        """Bring in what the agent wrote since the last call: its state, notes and the console; the
        ranks' own logs of a launch that ended (messages lost at exit)."""
        with self._lock:
            self._agent_state = _agent.read_state(self.run_dir) or self._agent_state
            for line in self._notes.lines():
                try:
                    self._add(json.loads(line))
                except ValueError:
                    continue
            for line in self._console_log.lines():
                self.console.write(line + "\n")
            for record in (self._agent_state or {}).get("launches", []):
                self._view(record)
            ended = [
                v.job_id
                for v in self._views.values()
                if v.code is not None and v.job_id not in self._reconciled
            ]
            if ended:
                for event in _events.read_events(self.run_dir):
                    if event.get("job") in ended:
                        self.store.add(event)
                self._reconciled.update(ended)

    def _view(self, record: dict[str, Any]) -> LaunchView:
        view = self._views.get(record["job_id"])
        if view is None:
            view = LaunchView(record["job_id"], record["pipeline"], record["data"], record["world"])
            self._views[view.job_id] = view
            self._order.append(view.job_id)
        view.code, view.summary = record.get("code"), list(record.get("summary") or [])
        view.dead = [DeadRank(**d) for d in record.get("dead") or []]
        return view

    def _loop(self) -> None:
        while not self._closing.wait(0.1):
            self._pump()

    def _intent(self, what: str, **fields: Any) -> None:
        """Tell the agent what the next exit means (or to signal the job now)."""
        seq = int((self._agent_state or {}).get("intent_seq") or 0)
        _agent.write_intent(self.run_dir, what, after=seq, **fields)

    # starting ----------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        script_argv: list[str],
        *,
        pipeline: int,
        data: int,
        run_dir: str | Path | None = None,
        hostfile: str | Path | None = None,
        elastic: bool = True,
        interface: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        grace_s: float = 10.0,
        resume: str | None = None,
        max_restarts: int = 0,
        silent_after_s: float = DEFAULT_SILENT_AFTER_S,
        watch_hosts: str | None = None,
        settle_s: float = DEFAULT_SETTLE_S,
        placement: Placement = "block",
    ) -> JobController:
        """Launch `script_argv` at `pipeline` x `data` under its own agent process; return at once.

        The arguments are checked here, in the caller. With `elastic`, a morph exit relaunches in the
        queued shape; a failure relaunches from the latest checkpoint up to `max_restarts` times. A rank
        not heard from for `silent_after_s` seconds is reported (`silent_ranks()`).

        `watch_hosts` makes the job follow a live host set (`varuna.elastic.hostset`): "hostfile" (the
        `hostfile`, whose edits and `varuna hosts RUN_DIR add|remove` take effect) or "slurm" (the
        allocation). The job shrinks when a host it runs on goes and grows onto hosts that stayed
        `settle_s` seconds, in the shape the planner picks for the slots (same global batch).

        `placement` is how every launch puts the ranks on the hosts: "block" (hosts filled in rank
        order) or "cyclic" (dealt to them in turn), as `varuna run --placement`."""
        run_dir = (
            Path(run_dir) if run_dir is not None else Path.cwd() / "runs" / time.strftime("%Y%m%d-%H%M%S")
        )
        hostfile = Path(hostfile).absolute() if hostfile else None
        Job(
            list(script_argv),
            pipeline=pipeline,
            data=data,
            run_dir=run_dir,
            hostfile=hostfile,
            timeout_s=timeout_s,
            placement=placement,
        )
        check_int(max_restarts, "max_restarts", minimum=0)
        settle_s = check_settle(settle_s)
        host_source(
            {"watch_hosts": watch_hosts, "hostfile": hostfile}
        )  # a ConfigError here, not in the agent
        self = cls(run_dir, interface=interface, silent_after_s=silent_after_s)
        self._bind(hostfile=hostfile)
        spec = {
            "argv": list(script_argv),
            "hostfile": str(hostfile) if hostfile else None,
            "timeout_s": timeout_s,
            "grace_s": grace_s,
            "elastic": elastic,
            "max_restarts": max_restarts,
            "env": dict(env or {}),
            "watch_hosts": watch_hosts,
            "settle_s": settle_s,
            "placement": placement,
        }
        try:
            self._launch_agent(spec, pipeline, data, resume)
        except BaseException:
            self.close()
            raise
        return self

    def _launch_agent(self, spec: dict[str, Any], pipeline: int, data: int, resume: str | None) -> None:
        """Start the job's agent in a session of its own; the key goes in its environment only."""
        spec = {**spec, "pipeline": pipeline, "data": data, "resume": resume}
        spec["env"] = {
            **spec["env"],
            "VARUNA_EVENTS": self.events_address,
            "VARUNA_COMMANDS": self.commands_address,
        }
        proc = _agent.spawn(self.run_dir, spec, self.key)
        with self._lock:
            self._agent_state = None  # the previous agent's state (of a resumed job) is history
        # The agent writes its state first thing; until then its state is "starting".
        self._spawn(self._loop)
        deadline = time.monotonic() + 30.0
        while (st := _agent.read_state(self.run_dir)) is None or st.get("pid") != proc.pid:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(
                    f"the job's agent did not start (exit code {proc.poll()}); see {self.run_dir / 'logs' / 'agent.log'}"
                )
            time.sleep(0.02)

    # attaching ---------------------------------------------------------------------------------
    @classmethod
    def attach(
        cls, run_dir: str | Path, *, reconnect: bool = True, silent_after_s: float = DEFAULT_SILENT_AFTER_S
    ) -> JobController:
        """Reattach to the job of `run_dir`: replay its events and, while it runs, take over its
        addresses (after the first controller closed or died) with full control."""
        run_dir = Path(run_dir).absolute()
        if not (run_dir / "job.json").exists() and _agent.read_state(run_dir) is None:
            raise ConfigError(f"{run_dir} is not a varuna run directory (it has no job.json)")
        info = _events.read_controller_info(run_dir) or {}
        self = cls(run_dir, key=info.get("key"), silent_after_s=silent_after_s)
        for event in _events.read_events(run_dir):
            self.store.add(event)
        self._pump()
        if self._agent_state is None:
            self._legacy = legacy_state(run_dir)  # type: ignore[assignment]
            return self
        if self.state not in TERMINAL and reconnect and info.get("events"):
            try:
                self._bind(info["events"], info.get("commands"))
            except zmq.ZMQError as exc:
                raise LaunchError(
                    f"cannot listen on {info['events']} again ({exc}): is the job's first controller still "
                    "open? close() it, or attach with reconnect=False to replay only"
                ) from exc
        self._spawn(self._loop)
        return self

    # state and health --------------------------------------------------------------------------
    @property
    def state(self) -> JobState:
        """starting, running, checkpointing, morphing, stopped, failed or finished."""
        if self._legacy is not None:
            return self._legacy
        self._pump()
        with self._lock:
            st = self._agent_state or {}
            word = st.get("state", "starting")
            last = self._views[self._order[-1]] if self._order else None
            if word in TERMINAL:
                self._overlay, self.error = None, st.get("error")
                return word  # type: ignore[no-any-return]
            if st and not check_status(st).live:
                self.error = f"the job's agent (pid {st.get('pid')}) is gone; see {self.run_dir / 'logs' / 'agent.log'}"
                return "failed"
            if self._overlay is not None:
                kind, job = self._overlay
                if (
                    kind == "checkpointing"
                    or (last is not None and last.job_id == job)
                    or last is None
                    or last.code is not None
                ):
                    return kind  # type: ignore[return-value]
                self._overlay = None
            if last is not None and last.code is None:
                ready = {e["rank"] for e in self.store.events("ready", job=last.job_id)}
                if len(ready) == last.world:
                    return "running"
            return "morphing" if word == "morphing" else "starting"

    @property
    def job(self) -> LaunchView | None:
        """The current (or last) launch."""
        self._pump()
        return self._views[self._order[-1]] if self._order else None

    @property
    def exit_code(self) -> int | None:
        """The last launch's exit code, None while it runs."""
        job = self.job
        return job.code if job is not None else None

    def dead_ranks(self) -> list[DeadRank]:
        """The ranks of the last launch that died (the first to die marked `first`)."""
        job = self.job
        return list(job.dead) if job is not None else []

    def summary(self) -> list[str]:
        """The launcher's summary of the last launch (which rank failed first, and why)."""
        job = self.job
        return list(job.summary) if job is not None else []

    def hellos(self) -> set[int]:
        """Ranks of the current launch that said hello."""
        job = self.job.job_id if self.job else None
        return {e["rank"] for e in self.store.events("hello", job=job)}

    def silent_ranks(self) -> list[SilentRank]:
        """Ranks of the running launch not heard from (heartbeat or any event) for `silent_after_s`
        seconds, with their host and last action; empty when no launch runs."""
        job = self.job
        return self.liveness.silent(job.job_id) if job is not None and job.code is None else []

    def dropped_messages(self) -> dict[str, int]:
        """Messages the controller refused, by reason (too_big, bad_signature, malformed, replay, stale)."""
        return self._channel.drops if self._channel is not None else {}

    def log_tail(self, rank: int, lines: int = 40) -> str:
        """The last `lines` lines of RUN_DIR/logs/rank{rank}.log."""
        path = self.run_dir / "logs" / f"rank{rank}.log"
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait(
        self, timeout: float | None = None, *, states: tuple[str, ...] = ("stopped", "failed", "finished")
    ) -> JobState:
        """Block until the job reaches one of `states` (or `timeout` passes); the state."""
        return self._wait_until(lambda: self.state in states, timeout)

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
        return self.state

    # commands ----------------------------------------------------------------------------------
    def checkpoint(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Ask for a checkpoint at the end of the current step; the `checkpoint_done` events of all ranks.

        Raises TimeoutError when not every rank reported within `timeout` seconds.
        """
        launch = self._running_launch("checkpoint")

        def asked() -> list[dict[str, Any]]:  # not the background writes of `checkpoint_every`
            return [
                e
                for e in self.store.events("checkpoint_done", job=launch.job_id)
                if e.get("blocking", True) is not False
            ]

        before = len(asked())
        with self._lock:
            self._overlay = ("checkpointing", launch.job_id)
        try:
            self._send("checkpoint")

            def done() -> bool:
                return len(asked()) >= before + launch.world or self.exit_code is not None

            self._wait_until(done, timeout)
        finally:
            with self._lock:
                if self._overlay is not None and self._overlay[0] == "checkpointing":
                    self._overlay = None
        events = asked()[before:]
        if len(events) < launch.world:
            raise TimeoutError(
                f"{len(events)} of {launch.world} ranks reported checkpoint_done within {timeout:g} s"
            )
        return events

    def stop(self, checkpoint: bool = True, timeout: float = 60.0) -> JobState:
        """Stop the job: with `checkpoint`, every rank checkpoints at the end of the step and exits
        (the morph path); without, at once (SIGKILL). Falls back to SIGTERM after `timeout` s."""
        launch = self._running_launch("stop")
        if not checkpoint:
            self._intent("kill")
            return self.wait(timeout)
        self._intent("stop")
        with self._lock:
            self._overlay = ("checkpointing", launch.job_id)
        self._ask_stop(launch.job_id)
        if self.wait(timeout) not in TERMINAL:
            self._intent("terminate")
        return self.wait(timeout)

    def resize(
        self, pipeline: int | None = None, data: int | None = None, *, gpus: int | None = None
    ) -> JobState:
        """Morph to `pipeline` x `data`, or to `shape_for(gpus)` (noted as a "resize_plan" event)."""
        if gpus is not None:
            choice = self.shape_for(gpus)
            pipeline, data = choice.shape.pipeline, choice.shape.data
            self._note(
                "resize_plan",
                gpus=gpus,
                pipeline=pipeline,
                data=data,
                chosen_by=choice.chosen_by,
                reason=choice.reason,
            )
        if pipeline is None or data is None:
            raise ConfigError("resize needs pipeline= and data=, or gpus=")
        launch = self._running_launch("resize")
        request_resize(self.run_dir, pipeline=pipeline, data=data, notify=False)
        self._intent("resize")
        with self._lock:
            self._overlay = ("morphing", launch.job_id)
        self._ask_stop(launch.job_id, reason="resize")
        return self.state

    def _ask_stop(self, job: str, reason: str = "stop") -> None:
        """Ask launch `job` to checkpoint and exit at the end of a step: the command, which a rank
        hears at once when its SUB socket is connected, and a stop file for it, which rank 0 reads
        even when the command was dropped (a rank still reconnecting after an attach)."""
        self._send("stop", checkpoint=True, reason=reason)
        post_stop(self.run_dir, reason="controller", job=job)

    def shape_for(self, gpus: int) -> ShapeChoice:
        """The P x D `resize(gpus=N)` would ask for, and how it was chosen: the planner when the run
        directory has a profile, else the keep-the-depth rule (`varuna.elastic.reshape.shape_for_gpus`)."""
        return shape_for_gpus(self.run_dir, gpus)

    def resume(
        self, checkpoint: str | Path = "latest", *, pipeline: int | None = None, data: int | None = None
    ) -> JobState:
        """Relaunch a stopped or failed job from `checkpoint` ("latest" or a checkpoint directory),
        in its last shape unless `pipeline`/`data` (positive integers) say otherwise."""
        for name, value in (("pipeline", pipeline), ("data", data)):
            if value is not None:
                check_int(
                    value,
                    name,
                    message=f"resume({name}=...) takes a positive integer or None (the last shape), got {value!r}",
                )
        if not isinstance(checkpoint, (str, Path)):
            raise ConfigError(
                f"resume(checkpoint=...) takes 'latest' or a checkpoint directory, got {checkpoint!r}"
            )
        if self.state not in TERMINAL:
            raise LaunchError(f"resume() needs a stopped or failed job; this one is {self.state}")
        last = self.job
        spec = _agent.relaunch_spec(self.run_dir)
        pipeline = (
            (last.pipeline if last is not None else int(spec["pipeline"])) if pipeline is None else pipeline
        )
        data = (last.data if last is not None else int(spec["data"])) if data is None else data
        Job(list(spec["argv"]), pipeline=pipeline, data=data, run_dir=self.run_dir)  # checks the shape here
        if self._channel is None:
            self._bind(hostfile=spec.get("hostfile"))
        self._legacy = None
        self._closing.clear()
        self._launch_agent(spec, pipeline, data, str(checkpoint))
        self._wait_until(lambda: self.job is not last, 10.0)
        return self.state

    def set(self, **options: Any) -> None:
        """Change telemetry settings on every rank, e.g. `set(spans_every=10)` (names and values in
        `varuna.telemetry.settings.SETTINGS`); checked here first, a ConfigError before anything is sent."""
        self._send("set", **check_settings(options))

    # stragglers ----------------------------------------------------------------------------------
    def _straggler_events(self) -> None:
        for line in self._straggler_log.lines():
            try:
                self.store.add(json.loads(line))
            except ValueError:
                continue

    def stragglers(self) -> list[dict[str, Any]]:
        """The ranks of the current launch flagged as stragglers now (their last ``straggler`` event:
        rank, host, stage, replica, ratio, steps), by rank; `varuna.telemetry.stragglers` says how."""
        self._straggler_events()
        job = self.job
        if job is None:
            return []
        flagged: dict[int, dict[str, Any]] = {}
        for event in self.store.events(job=job.job_id):
            if event["type"] == "straggler":
                flagged[event["rank"]] = event
            elif event["type"] == "straggler_gone":
                flagged.pop(event["rank"], None)
        return [flagged[r] for r in sorted(flagged)]

    def compute_grid(self, last_steps: int = 50) -> ComputeGrid:
        """Each rank's compute seconds for the last steps of the newest launch, with its host."""
        return compute_grid([*self.store.events("hello"), *self.store.step_events()], last_steps=last_steps)

    def exclude_host(self, host: str) -> str:
        """Relaunch the running job without `host`: its hostfile minus that host, in the shape
        `shape_for` gives the slots left (same global batch), through the morph protocol (checkpoint,
        stop, relaunch from the checkpoint). Noted as an ``exclude_host`` event; returns the state."""
        if not isinstance(host, str) or not host:
            raise ConfigError(f"exclude_host() takes a host name as in the hostfile, got {host!r}")
        self._running_launch("exclude_host")
        hostfile = json.loads((self.run_dir / "job.json").read_text()).get("hostfile")  # the running launch's
        if hostfile is None:
            raise ConfigError(
                "exclude_host(): this job was started without a hostfile, so it runs on this host only; "
                "start it with hostfile= to run on several hosts"
            )
        path, slots = write_without(self.run_dir, Path(hostfile), host)
        self._note("exclude_host", host=host, hostfile=str(path), slots=slots)
        return self.resize(gpus=slots)  # the shape `shape_for(slots)` gives, noted as "resize_plan"

    # ---------------------------------------------------------------------------------------------
    def _running_launch(self, what: str) -> LaunchView:
        job, state = self.job, self.state
        if job is None or job.code is not None or state in TERMINAL or self._legacy is not None:
            raise LaunchError(f"{what}() needs a running job; this one is {state}")
        return job

    def close(self) -> None:
        """Stop receiving and close the sockets (a running job keeps running under its agent)."""
        self._closing.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._threads = []
        if self._channel is not None:
            self._channel.close()
            self._channel = None
