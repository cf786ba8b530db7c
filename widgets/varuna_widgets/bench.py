"""How fast the workbench redraws a big pipeline: `measure_refresh_hz(stages=4, microbatches=64)`.

The events are synthetic (a 1F1B step of `stages` ranks, `microbatches` micro-batches each, with
sends, receives, the all-reduce and the optimizer) but go through the real path: the controller's
`EventStore`, the workbench's views, `figures`, the `PlotView`s' replaced figures, and a comm
that JSON-encodes every message as a kernel would (no frontend needed). Two figures come out:

- `widget_refresh_hz`: redraws per second achieved by the workbench's own throttled refresher
  while a new step arrives every `step_interval_s` (the rate a user sees);
- `refresh_capacity_hz`: redraws per second when redrawing back to back (the headroom).

Used by `python -m varuna.bench telemetry`.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["synthetic_step_events", "measure_refresh_hz"]


def synthetic_step_events(
    step: int, stages: int, microbatches: int, *, job: str = "bench", launch: int = 1, t0: float | None = None
) -> list[dict[str, Any]]:
    """A 1F1B step's `spans` and `step_metrics` events for ranks 0..stages-1 (one replica)."""
    f, b, c = 0.002, 0.004, 0.0002
    t0 = time.time() if t0 is None else t0
    events: list[dict[str, Any]] = []
    for s in range(stages):
        t = t0 + s * (f + c)
        spans: list[dict[str, Any]] = []
        warmup = min(stages - s - 1, microbatches)
        order = [("F", m) for m in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < microbatches:
            if fwd < microbatches:
                order.append(("F", fwd))
                fwd += 1
            order.append(("B", bwd))
            bwd += 1
        for kind, mb in order:
            if kind == "F" and s > 0:
                spans.append({"kind": "recv", "mb": mb, "dir": "F", "peer": s - 1, "start": t, "end": t + c})
                t += c
            dur = f if kind == "F" else b
            spans.append({"kind": kind, "mb": mb, "start": t, "end": t + dur})
            t += dur
            if kind == "F" and s < stages - 1:
                spans.append(
                    {
                        "kind": "send",
                        "mb": mb,
                        "dir": "F",
                        "peer": s + 1,
                        "start": t,
                        "end": t + c / 4,
                        "bytes": 65536,
                    }
                )
            if kind == "B" and s > 0:
                spans.append(
                    {
                        "kind": "send",
                        "mb": mb,
                        "dir": "B",
                        "peer": s - 1,
                        "start": t,
                        "end": t + c / 4,
                        "bytes": 65536,
                    }
                )
        spans.append({"kind": "allreduce", "mb": None, "start": t, "end": t + 0.001, "bytes": 1 << 20})
        spans.append({"kind": "optim", "mb": None, "start": t + 0.001, "end": t + 0.002})
        common = {"rank": s, "stage": s, "replica": 0, "step": step, "job": job, "launch": launch}
        events.append({"type": "spans", "time": t, "seq": 2 * step, "spans": spans, **common})
        total = t + 0.002 - t0
        events.append(
            {
                "type": "step_metrics",
                "time": t + 0.002,
                "seq": 2 * step + 1,
                "loss": 5.0 / (1 + 0.01 * step),
                "time_s": total,
                "compute_s": microbatches * (f + b),
                "samples_per_s": 4 * microbatches / total,
                "bubble": max(0.0, 1 - microbatches * (f + b) / total),
                "memory": {
                    "params_bytes": 40 << 20,
                    "grads_bytes": 40 << 20,
                    "optimizer_bytes": 80 << 20,
                    "activations_bytes": (stages - s) * (8 << 20),
                    "peak_rss_bytes": 600 << 20,
                    "rss_bytes": 500 << 20,
                },
                **common,
            }
        )
    return events


class _EncodingComm:
    """A stand-in for the kernel's comm: JSON-encodes what a widget sends, counts the bytes."""

    sent_bytes = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.comm_id = kwargs.get("comm_id") or "bench"
        self.kernel = True

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        _EncodingComm.sent_bytes += len(json.dumps(data, default=_jsonable))
        for buf in buffers or []:
            _EncodingComm.sent_bytes += memoryview(buf).nbytes

    def open(self, *args: Any, **kwargs: Any) -> None:
        return None

    def close(self, *args: Any, **kwargs: Any) -> None:
        return None

    def on_msg(self, callback: Any) -> None:
        return None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def measure_refresh_hz(
    stages: int = 4,
    microbatches: int = 64,
    seconds: float = 3.0,
    *,
    step_interval_s: float = 0.1,
    refresh_hz: float = 4.0,
) -> dict[str, Any]:
    """Redraw rate of a `Workbench` fed `stages` x `microbatches` steps; see the module docstring."""
    import comm

    from varuna.controller import JobController
    from varuna_widgets.workbench import Workbench

    saved = comm.create_comm
    comm.create_comm = _EncodingComm  # type: ignore[assignment]
    _EncodingComm.sent_bytes = 0
    try:
        with tempfile.TemporaryDirectory(prefix="varuna-refresh-") as tmp:
            ctl = JobController(Path(tmp))
            wb = Workbench(controller=ctl, refresh_hz=refresh_hz)
            step = 0

            def feed(n: int) -> None:
                nonlocal step
                for _ in range(n):
                    for event in synthetic_step_events(step, stages, microbatches):
                        ctl.store.add(event)
                    step += 1

            # back to back: one new step, one forced redraw
            feed(wb.last_steps)
            wb.refresh(force=True)
            times = []
            deadline = time.monotonic() + seconds / 2
            while time.monotonic() < deadline:
                feed(1)
                t = time.perf_counter()
                wb.refresh()
                times.append(time.perf_counter() - t)
            spans = sum(len(r.spans) for r in ctl.timeline(wb.last_steps).rows)
            # throttled: the workbench's own refresher while steps keep arriving
            before = wb.refreshes
            stop = threading.Event()

            def producer() -> None:
                while not stop.wait(step_interval_s):
                    feed(1)

            thread = threading.Thread(target=producer, daemon=True)
            t_start = time.monotonic()
            thread.start()
            time.sleep(seconds / 2)
            stop.set()
            thread.join()
            elapsed = time.monotonic() - t_start
            achieved = (wb.refreshes - before) / elapsed
            wb.close()
    finally:
        comm.create_comm = saved
    mean = sum(times) / len(times)
    return {
        "widget_refresh_hz": round(achieved, 2),
        "refresh_capacity_hz": round(1.0 / mean, 2),
        "refresh_ms_mean": round(mean * 1e3, 2),
        "refresh_ms_max": round(max(times) * 1e3, 2),
        "throttle_hz": refresh_hz,
        "stages": stages,
        "microbatches": microbatches,
        "spans_drawn": spans,
        "kb_sent_per_refresh": round(_EncodingComm.sent_bytes / 1024 / max(len(times) + wb.refreshes, 1), 1),
    }
