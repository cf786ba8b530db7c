"""`Workbench`: a Varuna job in a notebook — live timeline, memory, curves, ranks, and buttons.

    from varuna_widgets import Workbench
    wb = Workbench(["-m", "varuna.demo", "--steps", "200"], pipeline=2, data=2, steps=200)
    wb                      # shows it; the Start button (or wb.start()) launches the job
    wb.checkpoint(); wb.resize(pipeline=4, data=1); wb.stop(); wb.resume()
    Workbench.replay("runs/20261202-101500")     # a finished run: scrub through its steps

Everything the job does comes through `varuna.controller.JobController` (the kernel is never an
MPI process). A daemon thread redraws at most `refresh_hz` times a second and only what changed;
each redraw replaces a changed figure whole, in one message (`varuna_widgets.plot.PlotView`: synced
by replacement, drawn by plotly.js with `Plotly.react`). Buttons run their controller call on a worker thread, so a checkpoint or a
resize never blocks the kernel; the state line always says where the job is.

DOM contract (the browser test relies on it): buttons labelled "Start", "Checkpoint", "Resize",
"Resume", "Stop", "Export trace"; IntText "P", "D", "GPUs"; the state line has class
`varuna-state` and reads "state: ..."; the figures have classes `varuna-timeline`,
`varuna-memory`, `varuna-curves`; the ranks table `varuna-ranks`.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as w

from varuna._store import Timeline
from varuna.controller import JobController
from varuna.errors import ConfigError, LaunchError
from varuna_widgets import figures
from varuna_widgets.plot import PlotView

__all__ = ["Workbench"]

_TERMINAL = ("stopped", "failed", "finished")
_STATE_COLOR = {
    "idle": "#666",
    "starting": "#B58900",
    "running": "#2E7D32",
    "checkpointing": "#1565C0",
    "morphing": "#6A1B9A",
    "stopped": "#555",
    "failed": "#C62828",
    "finished": "#2E7D32",
    "replay": "#555",
}


class Workbench:
    """One job's workbench: build it with a script (then Start) or a controller, or `replay`/`attach`."""

    def __init__(
        self,
        script: Sequence[str] | None = None,
        *,
        pipeline: int = 2,
        data: int = 2,
        run_dir: str | Path | None = None,
        steps: int | None = None,
        controller: JobController | None = None,
        last_steps: int = 2,
        refresh_hz: float = 4.0,
        max_points: int = 400,
        start: bool = False,
        replay: bool = False,
        **start_options: Any,
    ) -> None:
        if script is None and controller is None:
            raise ConfigError(
                "Workbench needs the training script's argv (e.g. ['train.py'] or ['-m', 'varuna.demo']) or a "
                "controller=; to look at a finished run use Workbench.replay(run_dir)"
            )
        if refresh_hz <= 0 or refresh_hz > 30:
            raise ConfigError(f"refresh_hz must be in (0, 30], got {refresh_hz}")
        if last_steps < 1:
            raise ConfigError(f"last_steps must be at least 1, got {last_steps}")
        if pipeline < 1 or data < 1:
            raise ConfigError(f"pipeline and data must be at least 1, got {pipeline} x {data}")
        self.script = list(script) if script is not None else None
        self.run_dir = Path(run_dir) if run_dir is not None else (controller.run_dir if controller else None)
        self.steps = steps
        self.controller = controller
        self.last_steps = last_steps
        self.refresh_hz = refresh_hz
        self.max_points = max_points
        self.replay_mode = replay
        self.start_options = start_options
        self.refreshes = 0
        self.refresh_seconds: list[float] = []
        self._prediction: list[dict[str, Any]] | None = None
        self._seen: dict[str, Any] = {}
        self._draw_lock = threading.RLock()
        self._quiet = False
        self._action: threading.Thread | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._build(pipeline, data)
        if controller is not None and not replay:
            self._start_refresher()
        self.refresh()
        if start:
            self.start()

    # construction ------------------------------------------------------------------------------
    @classmethod
    def replay(cls, run_dir: str | Path, **options: Any) -> Workbench:
        """Open a finished (or crashed) run directory: its events replayed, a slider over its steps."""
        ctl = JobController.attach(run_dir, reconnect=False)
        return cls(controller=ctl, replay=True, **options)

    @classmethod
    def attach(cls, run_dir: str | Path, **options: Any) -> Workbench:
        """Reattach to a run directory (after a kernel restart): live when its job runs, else replay."""
        ctl = JobController.attach(run_dir)
        return cls(controller=ctl, replay=ctl.state in _TERMINAL, **options)

    def _button(self, label: str, icon: str, handler: Callable[[], Any], style: str = "") -> w.Button:
        button = w.Button(description=label, icon=icon, button_style=style, layout=w.Layout(width="auto"))
        button.on_click(lambda _b: self._run_action(label, handler))
        return button

    def _build(self, pipeline: int, data: int) -> None:
        self.state_line = w.HTML(self._state_html("idle", ""))
        self.state_line.add_class("varuna-state")
        self.progress = w.IntProgress(
            value=0, min=0, max=max(self.steps or 1, 1), layout=w.Layout(width="240px")
        )
        self.progress_label = w.HTML("")
        self.buttons = {
            "Start": self._button("Start", "play", self._do_start, "success"),
            "Checkpoint": self._button("Checkpoint", "save", self._do_checkpoint),
            "Resize": self._button("Resize", "arrows-alt", self._do_resize, "info"),
            "Resume": self._button("Resume", "redo", self._do_resume),
            "Stop": self._button("Stop", "stop", self._do_stop, "danger"),
            "Export trace": self._button("Export trace", "download", self._do_export),
        }
        small = w.Layout(width="110px")
        self.p_input = w.IntText(
            value=pipeline, description="P", layout=small, style={"description_width": "20px"}
        )
        self.d_input = w.IntText(
            value=data, description="D", layout=small, style={"description_width": "20px"}
        )
        self.gpus_input = w.IntText(value=0, description="GPUs", layout=w.Layout(width="130px"))
        self.gpus_input.style.description_width = "40px"
        self.gpus_input.tooltip = "0: resize to P x D; N > 0: let the planner pick a P x D for N devices"
        self.message = w.HTML("")
        self.message.add_class("varuna-message")
        self.timeline_fig = PlotView(
            data=figures.timeline_traces(_empty_timeline()),
            layout={
                "height": 300,
                "margin": {"l": 150, "r": 20, "t": 40, "b": 40},
                "legend": {"orientation": "h", "y": -0.25},
                **figures.timeline_layout(_empty_timeline(), title="timeline: waiting for spans"),
            },
        )
        self.timeline_fig.add_class("varuna-timeline")
        self.memory_fig = PlotView(
            data=figures.memory_traces([]),
            layout={
                "height": 280,
                "barmode": "stack",
                "title": {"text": "memory per stage (MiB)", "font": {"size": 13}},
                "margin": {"l": 50, "r": 10, "t": 40, "b": 40},
            },
        )
        self.memory_fig.add_class("varuna-memory")
        self.curves_fig = PlotView(
            data=figures.curve_traces([]),
            layout={
                "height": 280,
                "title": {"text": "loss and throughput", "font": {"size": 13}},
                "xaxis": {"title": {"text": "step"}},
                "yaxis": {"title": {"text": "loss"}},
                "yaxis2": {"title": {"text": "samples/s"}, "overlaying": "y", "side": "right"},
                "margin": {"l": 50, "r": 50, "t": 40, "b": 40},
                "legend": {"orientation": "h", "y": -0.3},
            },
        )
        self.curves_fig.add_class("varuna-curves")
        self.ranks_table = w.HTML("")
        self.ranks_table.add_class("varuna-ranks")
        self.problems = w.HTML("")
        self.slider = w.IntSlider(description="step", continuous_update=False, layout=w.Layout(width="60%"))
        self.slider.observe(lambda _c: None if self._quiet else self.refresh(force=True), names="value")
        controls = [*self.buttons.values(), self.p_input, self.d_input, self.gpus_input]
        if self.replay_mode:
            controls = [self.buttons["Export trace"], self.slider]
        self.view = w.VBox(
            [
                w.HBox([self.state_line, self.progress, self.progress_label]),
                w.HBox(controls, layout=w.Layout(flex_flow="row wrap")),
                self.message,
                self.problems,
                self.timeline_fig,
                w.HBox(
                    [self.memory_fig, self.curves_fig],
                    layout=w.Layout(display="grid", grid_template_columns="1fr 1fr"),
                ),
                self.ranks_table,
            ]
        )

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.view._repr_mimebundle_(**kwargs)

    # the job -----------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """The job's state; "idle" before it starts, "replay" for a run opened with `replay`."""
        if self.replay_mode:
            return "replay"
        return self.controller.state if self.controller is not None else "idle"

    def start(self) -> str:
        """Launch the job (what the Start button does); returns the state."""
        self._do_start()
        self.refresh(force=True)
        return self.state

    def checkpoint(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Checkpoint at the end of the current step; the ranks' `checkpoint_done` events."""
        return self._call(lambda: self._controller("checkpoint").checkpoint(timeout=timeout))

    def resize(self, pipeline: int | None = None, data: int | None = None, *, gpus: int | None = None) -> str:
        """Stop with a checkpoint and relaunch as `pipeline` x `data` (or a shape for `gpus` devices)."""
        return self._call(lambda: self._controller("resize").resize(pipeline, data, gpus=gpus))

    def resume(self, checkpoint: str | Path = "latest") -> str:
        """Relaunch a stopped or failed job from `checkpoint` in the P x D of the inputs."""
        return self._call(
            lambda: self._controller("resume").resume(
                checkpoint, pipeline=self.p_input.value, data=self.d_input.value
            )
        )

    def stop(self, checkpoint: bool = True, timeout: float = 120.0) -> str:
        """Stop the job (with a checkpoint by default)."""
        return self._call(lambda: self._controller("stop").stop(checkpoint=checkpoint, timeout=timeout))

    def wait(self, timeout: float | None = None, states: Sequence[str] = _TERMINAL) -> str:
        """Block until the job is in one of `states`; the state."""
        state = self._controller("wait").wait(timeout, states=tuple(states))
        self.refresh(force=True)
        return state

    def wait_for_step(self, step: int, timeout: float = 120.0) -> int:
        """Block until a step >= `step` was reported (or the job ended); the last step seen."""
        ctl = self._controller("wait_for_step")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.last_step()
            if last is not None and last >= step:
                break
            if ctl.state in ("failed", "finished") or (ctl.state == "stopped" and ctl.exit_code is not None):
                break
            time.sleep(0.05)
        self.refresh(force=True)
        last = self.last_step()
        if last is None or last < step:
            raise TimeoutError(
                f"step {step} not reached within {timeout:g} s (last {last}, state {self.state})"
            )
        return last

    def last_step(self) -> int | None:
        """The newest step with metrics, or None."""
        metrics = self.controller.step_metrics() if self.controller is not None else []
        return metrics[-1].step if metrics else None

    def show_prediction(self, prediction: Any) -> None:
        """Draw a predicted step (a `varuna.simulate.Timeline`, or its `to_events()`) as outlines over
        the newest measured step of replica 0; `None` removes it."""
        if prediction is not None and hasattr(prediction, "to_events"):
            prediction = prediction.to_events(include_comm=False)
        self._prediction = list(prediction) if prediction is not None else None
        self.refresh(force=True)

    def close(self) -> None:
        """Stop redrawing and close the controller's sockets (a running job keeps running)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.controller is not None:
            self.controller.close()

    def _controller(self, what: str) -> JobController:
        if self.controller is None:
            raise LaunchError(f"{what}: the job has not been started (press Start or call start())")
        if self.replay_mode:
            raise LaunchError(
                f"{what}: this workbench replays a finished run; use Workbench.attach to steer one"
            )
        return self.controller

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        finally:
            self.refresh(force=True)

    # buttons -----------------------------------------------------------------------------------
    def _run_action(self, label: str, handler: Callable[[], Any]) -> None:
        """Run a button's action on a worker thread, one at a time; errors go to the message line."""
        if self._action is not None and self._action.is_alive():
            self._say(f"{label}: still busy with the previous action", error=True)
            return

        def run() -> None:
            self._say(f"{label}…")
            try:
                result = handler()
            except Exception as exc:  # noqa: BLE001 - a button reports, it never raises into the kernel
                self._say(f"{label} failed: {type(exc).__name__}: {exc}", error=True)
            else:
                self._say(result if isinstance(result, str) else f"{label}: done")
            self.refresh(force=True)

        self._action = threading.Thread(target=run, daemon=True, name=f"varuna-workbench-{label}")
        self._action.start()

    def _do_start(self) -> str:
        if self.controller is not None and self.controller.state not in _TERMINAL:
            raise LaunchError(f"the job is already {self.controller.state}")
        if self.script is None:
            raise LaunchError("this workbench was opened on a controller; it has no script to start")
        self.controller = JobController.start(
            self.script,
            pipeline=int(self.p_input.value),
            data=int(self.d_input.value),
            run_dir=self.run_dir,
            **self.start_options,
        )
        self.run_dir = self.controller.run_dir
        self._start_refresher()
        return f"started {self.p_input.value}×{self.d_input.value} in {self.run_dir}"

    def _do_checkpoint(self) -> str:
        events = self._controller("checkpoint").checkpoint()
        first = events[0]
        mb = sum(int(e.get("bytes") or 0) for e in events) / 1e6
        return f"checkpoint of step {first.get('saved_step')} written to {first.get('path')} ({mb:.1f} MB)"

    def _do_resize(self) -> str:
        gpus = int(self.gpus_input.value)
        ctl = self._controller("resize")
        if gpus > 0:
            ctl.resize(gpus=gpus)
            return f"resizing to {gpus} devices: checkpoint, then relaunch"
        p, d = int(self.p_input.value), int(self.d_input.value)
        ctl.resize(p, d)
        return f"resizing to {p}×{d}: checkpoint, then relaunch"

    def _do_resume(self) -> str:
        state = self._controller("resume").resume(
            "latest", pipeline=int(self.p_input.value), data=int(self.d_input.value)
        )
        return f"resumed from the latest checkpoint as {self.p_input.value}×{self.d_input.value} ({state})"

    def _do_stop(self) -> str:
        return f"stopped with a checkpoint ({self._controller('stop').stop(checkpoint=True)})"

    def _do_export(self) -> str:
        if self.controller is None:
            raise LaunchError("nothing to export yet: start the job first")
        path = self.controller.export_chrome_trace(self.controller.run_dir / "trace.json")
        return f"trace written to {path} (open it in https://ui.perfetto.dev or chrome://tracing)"

    def _say(self, text: str, *, error: bool = False) -> None:
        color = "#C62828" if error else "#333"
        self.message.value = f'<span style="color:{color}">{html.escape(text)}</span>'

    # drawing -----------------------------------------------------------------------------------
    def _start_refresher(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return

        def loop() -> None:
            period = 1.0 / self.refresh_hz
            next_at = time.monotonic() + period
            while not self._closing.wait(max(next_at - time.monotonic(), 0.0)):
                next_at = max(next_at + period, time.monotonic())  # never faster than refresh_hz
                try:
                    self.refresh()
                except Exception as exc:  # noqa: BLE001 - keep drawing; say what went wrong
                    self._say(f"redraw failed: {type(exc).__name__}: {exc}", error=True)

        self._thread = threading.Thread(target=loop, daemon=True, name="varuna-workbench-refresh")
        self._thread.start()

    def refresh(self, force: bool = False) -> bool:
        """Redraw what changed since the last call (everything with `force`); True if anything did."""
        with self._draw_lock:
            t0 = time.perf_counter()
            ctl = self.controller
            state = self.state
            count = ctl.store.count if ctl is not None else 0
            key = (state, count, self.slider.value if self.replay_mode else None)
            if not force and self._seen.get("key") == key:
                self._update_heartbeats(ctl)
                return False
            self._seen["key"] = key
            self._draw_controls(state)
            if ctl is not None:
                metrics = ctl.step_metrics()
                self._draw_progress(metrics)
                self._draw_timeline(ctl, metrics)
                self._draw_memory(ctl)
                self._draw_curves(ctl, metrics)
                self._draw_ranks(ctl)
                self._draw_problems(ctl)
            self.refreshes += 1
            self.refresh_seconds.append(time.perf_counter() - t0)
            del self.refresh_seconds[:-200]
            return True

    def _state_html(self, state: str, detail: str) -> str:
        color = _STATE_COLOR.get(state, "#333")
        extra = f' <span style="color:#666">{html.escape(detail)}</span>' if detail else ""
        return f'<b style="color:{color}">state: {html.escape(state)}</b>{extra}'

    def _draw_controls(self, state: str) -> None:
        ctl = self.controller
        shape = ""
        if ctl is not None and ctl.job is not None:
            shape = f"{ctl.job.pipeline}×{ctl.job.data}, run dir {ctl.run_dir}"
        elif ctl is not None:
            shape = f"run dir {ctl.run_dir}"
        self.state_line.value = self._state_html(state, shape)
        has_ckpt = self.run_dir is not None and (Path(self.run_dir) / "checkpoints" / "latest").exists()
        enabled = {
            "Start": state == "idle" or (state in _TERMINAL and self.script is not None and not has_ckpt),
            "Checkpoint": state == "running",
            "Resize": state == "running",
            "Resume": state in ("stopped", "failed") and has_ckpt,
            "Stop": state in ("starting", "running", "morphing"),
            "Export trace": ctl is not None,
        }
        for label, button in self.buttons.items():
            disabled = not enabled[label]
            if button.disabled != disabled:
                button.disabled = disabled

    def _draw_progress(self, metrics: list[Any]) -> None:
        done = metrics[-1].step + 1 if metrics else 0
        if self.steps:
            self.progress.value = min(done, self.steps)
            label = f"step {done} / {self.steps}"
        else:
            self.progress.max, self.progress.value = max(done, 1), done
            label = f"step {done}"
        if metrics:
            last = metrics[-1]
            label += f" · loss {last.loss:.3f} · {last.samples_per_s:.1f} samples/s"
        self.progress_label.value = html.escape(label)

    def _rank0_hellos(self, ctl: JobController) -> list[dict[str, Any]]:
        """Rank 0's `hello` of every launch, oldest first."""
        return [e for e in ctl.store.events("hello") if e.get("rank") == 0]

    def _draw_timeline(self, ctl: JobController, metrics: list[Any]) -> None:
        until = None
        steps = ctl.store.span_steps()
        if self.replay_mode and steps:
            self._quiet = True
            try:
                self.slider.max, self.slider.min = max(steps[-1], self.slider.min), steps[0]
                self.slider.max = steps[-1]
                if not self._seen.get("slider_placed"):
                    self.slider.value, self._seen["slider_placed"] = steps[-1], True  # open on the last step
            finally:
                self._quiet = False
            until = self.slider.value if steps[0] <= self.slider.value <= steps[-1] else steps[-1]
        timeline = ctl.store.timeline(self.last_steps, until=until)
        key = (timeline.steps, [(r.rank, len(r.spans)) for r in timeline.rows], id(self._prediction))
        if self._seen.get("timeline") == key:
            return
        self._seen["timeline"] = key
        traces = figures.timeline_traces(timeline)
        firsts: dict[int, float] = {}
        for row in timeline.rows:
            for s in row.spans:
                firsts[s.step] = min(firsts.get(s.step, s.start), s.start)
        step_starts = [(firsts[s] - timeline.start) * 1e3 for s in sorted(firsts)][1:]
        predicted: list[dict[str, Any]] = []
        if self._prediction is not None and firsts:
            predicted = figures.predicted_traces(
                self._prediction, offset_ms=(firsts[max(firsts)] - timeline.start) * 1e3
            )
        title = self._timeline_title(ctl, timeline.steps, metrics)
        layout = figures.timeline_layout(timeline, title=title, step_starts_ms=step_starts)
        if self._prediction is not None and not predicted:
            predicted = figures.predicted_traces([])  # keep the legend entries while no step is drawn
        self.timeline_fig.update(data=traces + predicted, layout=layout)

    def _timeline_title(self, ctl: JobController, steps: list[int], metrics: list[Any]) -> str:
        if not steps:
            return "timeline: waiting for spans"
        hellos = self._rank0_hellos(ctl)
        hello = hellos[-1] if hellos else {}
        shown = [m for m in metrics if m.step in set(steps)]
        measured = sum(m.bubble for m in shown) / len(shown) if shown else None
        p, m, schedule = hello.get("pipeline"), hello.get("num_microbatches"), hello.get("schedule")
        text = f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
        if measured is not None:
            text += f" · measured bubble {measured:.1%}"
        if isinstance(p, int) and isinstance(m, int):
            text += (
                f" · theory (P−1)/(M+P−1) = {figures.theoretical_bubble(p, m):.1%} ({schedule}, P={p}, M={m})"
            )
        return text

    def _draw_memory(self, ctl: JobController) -> None:
        memory = ctl.memory()
        key = [(m.stage, m.step) for m in memory]
        if self._seen.get("memory") == key:
            return
        self._seen["memory"] = key
        self.memory_fig.update(data=figures.memory_traces(memory))

    def _draw_curves(self, ctl: JobController, metrics: list[Any]) -> None:
        key = (len(metrics), metrics[-1].step if metrics else None)
        if self._seen.get("curves") == key:
            return
        self._seen["curves"] = key
        traces = figures.curve_traces(metrics, max_points=self.max_points)
        shapes, notes = figures.relaunch_marks(self._rank0_hellos(ctl))
        self.curves_fig.update(data=traces, layout={"shapes": shapes, "annotations": notes})

    def _draw_ranks(self, ctl: JobController) -> None:
        rows = ctl.ranks()
        now = time.time()
        cells = []
        for r in rows:
            beat = f"{now - r.last_heartbeat:.1f} s ago" if r.last_heartbeat else "—"
            bad = r.state == "failed" or (r.exit_code not in (None, 0, 75))
            style = ' style="background:#FDECEA"' if bad else ""
            code = "" if r.exit_code is None else str(r.exit_code)
            cells.append(
                f"<tr{style}><td>{r.rank}</td><td>{_dash(r.stage)}</td><td>{_dash(r.replica)}</td>"
                f"<td>{html.escape(r.state)}</td><td>{r.steps}</td><td class='beat'>{beat}</td>"
                f"<td>{html.escape(r.host or '—')}</td><td>{_dash(r.pid)}</td><td>{code}</td>"
                f"<td>{html.escape(r.error or '')}</td></tr>"
            )
        head = "".join(
            f"<th>{h}</th>"
            for h in (
                "rank",
                "stage",
                "replica",
                "state",
                "steps",
                "heartbeat",
                "host",
                "pid",
                "exit",
                "error",
            )
        )
        self.ranks_table.value = (
            "<table style='border-collapse:collapse;font-size:12px' cellpadding='3'>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(cells)}</tbody></table>"
        )
        self._seen["beats"] = now

    def _update_heartbeats(self, ctl: JobController | None) -> None:
        """Heartbeat ages move even when no event arrives: redraw the table once a second."""
        if ctl is not None and time.time() - self._seen.get("beats", 0.0) >= 1.0:
            self._draw_ranks(ctl)

    def _draw_problems(self, ctl: JobController) -> None:
        dead = ctl.dead_ranks()
        if not dead:
            if self.problems.value:
                self.problems.value = ""
            return
        key = (id(ctl.job), len(dead))
        if self._seen.get("problems") == key:
            return
        self._seen["problems"] = key
        first = [d for d in dead if d.first] or dead[:1]
        parts = [f"<div>{html.escape(line)}</div>" for line in ctl.summary()[:3]]
        for d in first:
            what = f"rank {d.rank} (stage {_dash(d.stage)}, replica {_dash(d.replica)}) {d.how}"
            if d.exit_code is not None:
                what += f", exit {d.exit_code}"
            if d.error_type:
                what += f": {d.error_type}: {d.message}"
            log = html.escape(d.traceback or ctl.log_tail(d.rank, 30))
            parts.append(
                f"<div><b>first to fail: {html.escape(what)}</b>"
                f"<details><summary>its log</summary><pre style='font-size:11px'>{log}</pre></details></div>"
            )
        others = [d.rank for d in dead if d not in first]
        if others:
            parts.append(f"<div>also ended: ranks {', '.join(map(str, others))} (stopped with the job)</div>")
        self.problems.value = (
            "<div class='varuna-dead' style='border-left:4px solid #C62828;padding:4px 8px'>"
            + "".join(parts)
            + "<div>Press Resume to relaunch from the last checkpoint.</div></div>"
        )


def _dash(value: Any) -> str:
    return "—" if value is None else html.escape(str(value))


def _empty_timeline() -> Timeline:
    return Timeline([], [], 0.0, 0.0)
