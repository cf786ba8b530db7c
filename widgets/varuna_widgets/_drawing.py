"""How the `Workbench` redraws: a throttled refresher thread and one `_draw_*` per panel.

`Workbench` (`varuna_widgets.workbench`) builds the widgets and steers the job; `Drawing`, its
base class, keeps them up to date from the controller's views. `refresh` compares each panel's key
with the one it last drew (`_seen`) and redraws only what changed, each figure replaced whole in
one message (`PlotView.update`).
"""

from __future__ import annotations

import html
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from varuna.controller import JobController
from varuna.errors import VarunaError
from varuna.telemetry import NoticeView, Timeline, compare_step, step_spans
from varuna_widgets import figures

if TYPE_CHECKING:
    import ipywidgets as w

    from varuna_widgets.plot import PlotView
    from varuna_widgets.stragglers import StragglerPanel

TERMINAL_STATES = ("stopped", "failed", "finished")
"""Job states after which nothing more happens until a restart (`Workbench.wait` returns on them)."""
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


class Drawing:
    """The drawing half of `Workbench`: `refresh`, its refresher thread and the panels it draws."""

    # Set by Workbench.__init__ and Workbench._build; declared here for the type checker only.
    controller: JobController | None
    run_dir: Path | None
    script: list[str] | None
    steps: int | None
    last_steps: int
    refresh_hz: float
    max_points: int
    replay_mode: bool
    refreshes: int
    refresh_seconds: list[float]
    _prediction: list[dict[str, Any]] | None
    _seen: dict[str, Any]
    _draw_lock: threading.RLock
    _quiet: bool
    _closing: threading.Event
    _thread: threading.Thread | None
    state_line: w.HTML
    progress: w.IntProgress
    progress_label: w.HTML
    buttons: dict[str, w.Button]
    slider: w.IntSlider
    timeline_fig: PlotView
    bubbles_fig: PlotView
    memory_fig: PlotView
    curves_fig: PlotView
    ranks_table: w.HTML
    problems: w.HTML
    notice_line: w.HTML
    stragglers: StragglerPanel

    if TYPE_CHECKING:  # Workbench's own; only the type checker sees these, so Workbench's run

        @property
        def state(self) -> str: ...

        def _say(self, text: str, *, error: bool = False) -> None: ...

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

    def _stop_refresher(self) -> None:
        """Stop the background redraws (`refresh()` still redraws when called)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

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
                self._draw_notice(ctl)  # the countdown moves without events
                return False
            self._seen["key"] = key
            self._draw_controls(state)
            if ctl is not None:
                metrics = ctl.step_metrics()
                self._draw_progress(metrics)
                self._draw_bubbles(ctl, self._draw_timeline(ctl, metrics))
                self._draw_memory(ctl)
                self._draw_curves(ctl, metrics)
                self._draw_ranks(ctl)
                self._draw_problems(ctl)
                self._draw_notice(ctl)
                self.stragglers.draw(ctl)
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
            "Start": state == "idle"
            or (state in TERMINAL_STATES and self.script is not None and not has_ckpt),
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

    def _draw_timeline(self, ctl: JobController, metrics: list[Any]) -> Timeline:
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
            return timeline
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
        return timeline

    def _draw_bubbles(self, ctl: JobController, timeline: Timeline) -> None:
        """The newest step of `timeline` whose spans came from every stage of replica 0, measured
        against the simulator (`varuna.telemetry.compare_step`); redrawn when that step changes."""
        hellos = self._rank0_hellos(ctl)
        hello = hellos[-1] if hellos else {}
        p, m, schedule = hello.get("pipeline"), hello.get("num_microbatches"), hello.get("schedule")
        if not (isinstance(p, int) and isinstance(m, int)):
            return
        for step in reversed(timeline.steps):
            spans = step_spans(timeline, step)
            if len(spans) == p:
                break
        else:
            return  # no whole step yet: keep what is drawn
        key = (step, p, m, schedule, [len(v) for v in spans.values()])
        if self._seen.get("bubbles") == key:
            return
        self._seen["bubbles"] = key
        # gloo (CPU) reports a receive only once it is waited for (`simulate`'s sees_arrivals)
        sees = not str(hello.get("device") or "cpu").startswith("cpu")
        try:
            bubbles = compare_step(spans, str(schedule or "1f1b"), p, m, step=step, sees_arrivals=sees)
        except VarunaError as exc:  # a step this figure cannot explain: say why, keep drawing the rest
            title = {"text": f"bubbles: {exc}", "font": {"size": 11}}
            self.bubbles_fig.update(data=[], layout={"title": title, "shapes": [], "annotations": []})
            return
        figure = figures.bubble_figure(bubbles)
        self.bubbles_fig.update(data=figure["data"], layout=figure["layout"])

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
            text += f" · theory {figures.theoretical_bubble(p, m, str(schedule or '1f1b')):.1%} ({schedule}, P={p}, M={m})"
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

    def _draw_notice(self, ctl: JobController | None) -> None:
        """The newest launch's preemption notice and its countdown (whole seconds, so at most one
        message a second); replayed, the deadline's time instead of a countdown."""
        notice = ctl.notice() if ctl is not None else None
        value = notice_html(notice, now=None if self.replay_mode else time.time())
        if self.notice_line.value != value:
            self.notice_line.value = value

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


def notice_html(notice: NoticeView | None, *, now: float | None) -> str:
    """The notice line: who goes away when, the countdown to the deadline at `now` (None: a replay,
    no countdown), and how the job met it (stopped after step N, checkpointed s before it).

        notice_html(view, now=time.time())
    """
    if notice is None:
        return ""
    hosts = ", ".join(notice.hosts) if notice.hosts else "all hosts"
    at = time.strftime("%H:%M:%S", time.localtime(notice.deadline))
    parts = [f"<b>preemption notice</b> ({html.escape(notice.reason)}): {html.escape(hosts)} go away at {at}"]
    if now is not None:
        left = notice.deadline - now
        parts.append(f"<b class='countdown'>in {left:.0f} s</b>" if left > 0 else "<b>deadline passed</b>")
    if notice.stop_step is None:
        parts.append("training on while a step and a checkpoint fit")
    else:
        spare = f" with {notice.stop_seconds_left:.1f} s left" if notice.stop_seconds_left is not None else ""
        parts.append(f"stopped after step {notice.stop_step}{spare}")
        if notice.checkpoint_time is not None:
            before = notice.deadline - notice.checkpoint_time
            parts.append(
                f"checkpointed {before:.1f} s before the deadline"
                if before >= 0
                else f"checkpointed {-before:.1f} s after the deadline"
            )
        elif not notice.exited:
            parts.append("checkpointing")
    color = "#2E7D32" if notice.checkpoint_time is not None else "#B58900"
    return f"<div style='border-left:4px solid {color};padding:4px 8px'>" + " · ".join(parts) + "</div>"


def _dash(value: Any) -> str:
    return "—" if value is None else html.escape(str(value))
