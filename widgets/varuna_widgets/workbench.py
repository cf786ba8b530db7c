"""`Workbench`: a Varuna job in a notebook — live timeline, memory, curves, ranks, and buttons.

    from varuna_widgets import Workbench
    wb = Workbench(["-m", "varuna.demo", "--steps", "200"], pipeline=2, data=2, steps=200)
    wb                      # shows it; the Start button (or wb.start()) launches the job
    wb.checkpoint(); wb.resize(pipeline=4, data=1); wb.stop(); wb.resume()
    Workbench.replay("runs/20261202-101500")     # a finished run: scrub through its steps

Everything the job does comes through `varuna.controller.JobController` (the kernel is never an
MPI process). A daemon thread redraws at most `refresh_hz` times a second and only what changed
(`refresh` and the panels' drawing live in `varuna_widgets._drawing`, the base class `Drawing`);
each redraw replaces a changed figure whole, in one message (`varuna_widgets.plot.PlotView`: synced
by replacement, drawn by plotly.js with `Plotly.react`). Buttons run their controller call on a worker thread, so a checkpoint or a
resize never blocks the kernel; the state line always says where the job is.

DOM contract (the browser test relies on it): buttons labelled "Start", "Checkpoint", "Resize",
"Resume", "Stop", "Export trace"; IntText "P", "D", "GPUs"; the state line has class
`varuna-state` and reads "state: ..."; a preemption notice shows in `varuna-notice` (empty without
one) with its countdown; the figures have classes `varuna-timeline`,
`varuna-bubbles`, `varuna-memory`, `varuna-curves`; the ranks table `varuna-ranks`; the straggler panel's (button
"Exclude host", figure `varuna-stragglers`) are in `varuna_widgets.stragglers`.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as w

from varuna.controller import JobController
from varuna.errors import ConfigError, LaunchError
from varuna.telemetry import Timeline
from varuna_widgets import figures
from varuna_widgets._drawing import TERMINAL_STATES, Drawing
from varuna_widgets.plot import PlotView
from varuna_widgets.stragglers import StragglerPanel

__all__ = ["Workbench"]


class Workbench(Drawing):
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
        """Reattach to a run directory (after a kernel restart) with full control: a running job is
        steered live, a stopped or failed one can be resumed; a finished run is replayed."""
        ctl = JobController.attach(run_dir)
        return cls(controller=ctl, replay=ctl.state == "finished", **options)

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
        self.notice_line = w.HTML("")
        self.notice_line.add_class("varuna-notice")
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
        self.bubbles_fig = PlotView(
            data=[],
            layout={
                "height": 300,
                "title": {"text": "bubbles: waiting for a whole step's spans", "font": {"size": 13}},
                "margin": {"l": 60, "r": 20, "t": 40, "b": 60},
                "legend": {"orientation": "h", "y": -0.3},
            },
        )
        self.bubbles_fig.add_class("varuna-bubbles")
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
        self.stragglers = StragglerPanel(
            self._run_action, lambda: self._controller("exclude host"), replay=self.replay_mode
        )
        self.slider = w.IntSlider(description="step", continuous_update=False, layout=w.Layout(width="60%"))
        self.slider.observe(lambda _c: None if self._quiet else self.refresh(force=True), names="value")
        controls = [*self.buttons.values(), self.p_input, self.d_input, self.gpus_input]
        if self.replay_mode:
            controls = [self.buttons["Export trace"], self.slider]
        self.view = w.VBox(
            [
                w.HBox([self.state_line, self.progress, self.progress_label]),
                w.HBox(controls, layout=w.Layout(flex_flow="row wrap")),
                self.notice_line,
                self.message,
                self.problems,
                self.timeline_fig,
                self.bubbles_fig,
                w.HBox(
                    [self.memory_fig, self.curves_fig],
                    layout=w.Layout(display="grid", grid_template_columns="1fr 1fr"),
                ),
                self.ranks_table,
                self.stragglers.view,
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

    def wait(self, timeout: float | None = None, states: Sequence[str] = TERMINAL_STATES) -> str:
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
        """Draw a predicted step (a `varuna.planner.simulator.Timeline`, or its `to_events()`) as outlines over
        the newest measured step of replica 0; `None` removes it."""
        if prediction is not None and hasattr(prediction, "to_events"):
            prediction = prediction.to_events(include_comm=False)
        self._prediction = list(prediction) if prediction is not None else None
        self.refresh(force=True)

    def close(self) -> None:
        """Stop redrawing and close the controller's sockets (a running job keeps running)."""
        self._stop_refresher()
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
        if self.controller is not None and self.controller.state not in TERMINAL_STATES:
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


def _empty_timeline() -> Timeline:
    return Timeline([], [], 0.0, 0.0)
