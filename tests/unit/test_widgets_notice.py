"""The workbench's notice line: a preemption notice, its countdown, and how the job met it, from the
events a real job sends (`notice`, `stop_decided`, `checkpoint_done`, `exit`), without a browser."""

from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from varuna_widgets import Workbench, _drawing  # noqa: E402
from varuna_widgets._drawing import notice_html  # noqa: E402

from varuna.controller import JobController  # noqa: E402
from varuna.telemetry import NoticeView  # noqa: E402

_SEQ = iter(range(1, 10_000))


def event(
    kind: str, *, job: str = "j-1", rank: int = 0, step: int = 0, at: float = 1000.0, **fields: Any
) -> dict:
    return {
        "type": kind,
        "rank": rank,
        "stage": 0,
        "replica": rank,
        "step": step,
        "job": job,
        "launch": 1,
        "seq": next(_SEQ),
        "time": at,
        **fields,
    }


def test_the_store_keeps_the_newest_launchs_earliest_notice_and_its_outcome(tmp_path: Path) -> None:
    ctl = JobController(tmp_path)
    store = ctl.store
    store.add(event("hello", job="j-0"))
    store.add(event("notice", job="j-0", deadline=500.0, reason="old"))
    store.add(event("hello", job="j-1"))
    assert ctl.notice() is None  # the earlier launch's notice is history
    store.add(event("notice", rank=1, step=7, deadline=2000.0, reason="SIGTERM", hosts=None, source="signal"))
    store.add(event("notice", step=8, deadline=1900.0, reason="spot", hosts=["n3"], source="file"))
    view = ctl.notice()
    assert view == NoticeView("j-1", "spot", 1900.0, ["n3"], 0, 8)
    store.add(event("stop_decided", rank=1, step=12, at=1897.0, seconds_left=3.0, reason="spot"))
    store.add(event("stop_decided", step=12, at=1897.0, seconds_left=2.5, reason="spot"))
    store.add(event("checkpoint_done", step=12, at=1896.0, saved_step=10, blocking=False))
    store.add(event("checkpoint_done", step=12, at=1897.4, saved_step=12, blocking=True))
    store.add(event("checkpoint_done", rank=1, step=12, at=1897.5, saved_step=12, blocking=True))
    view = ctl.notice()
    assert view is not None and (view.stop_step, view.stop_seconds_left) == (12, 2.5)
    assert view.checkpoint_time == 1897.5 and not view.exited
    store.add(event("exit", step=12, code=75))
    assert ctl.notice().exited  # type: ignore[union-attr]


def test_the_notice_line_counts_down_and_says_how_the_deadline_was_met() -> None:
    view = NoticeView("j", "spot <reclaim>", 1000.0, ["n1", "n2"], 0, 3)
    live = notice_html(view, now=958.2)
    assert "preemption notice" in live and "spot &lt;reclaim&gt;" in live and "n1, n2 go away at" in live
    assert "in 42 s" in live and "training on while a step and a checkpoint fit" in live
    assert "deadline passed" in notice_html(view, now=1001.0)
    view.stop_step, view.stop_seconds_left = 30, 2.4
    assert "stopped after step 30 with 2.4 s left · checkpointing" in notice_html(view, now=998.0)
    view.checkpoint_time = 998.25
    done = notice_html(view, now=None)  # a replay: no countdown
    assert "checkpointed 1.8 s before the deadline" in done and " in " not in done.split("</b>")[1]
    assert notice_html(None, now=0.0) == ""
    all_hosts = notice_html(NoticeView("j", "SIGTERM", 1000.0, None, 1, 0), now=990.0)
    assert "all hosts go away" in all_hosts


def test_the_workbench_shows_the_notice_and_moves_its_countdown_without_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl = JobController(tmp_path)
    now = [time.time()]
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    clock.time = lambda: now[0]
    monkeypatch.setattr(_drawing, "time", clock)
    wb = Workbench(controller=ctl)
    wb._stop_refresher()
    try:
        assert wb.notice_line.value == "" and "varuna-notice" in wb.notice_line._dom_classes
        ctl.store.add(event("hello", at=now[0]))
        ctl.store.add(event("notice", step=4, at=now[0], deadline=now[0] + 60.4, reason="spot", hosts=["n3"]))
        assert wb.refresh()
        assert "in 60 s" in wb.notice_line.value and "n3 go away" in wb.notice_line.value
        now[0] += 10
        assert not wb.refresh()  # no event: nothing else redrawn, but the countdown moves
        assert "in 50 s" in wb.notice_line.value
        ctl.store.add(event("stop_decided", step=9, at=now[0], seconds_left=50.4, reason="spot"))
        ctl.store.add(event("checkpoint_done", step=9, at=now[0] + 0.4, saved_step=9, blocking=True))
        ctl.store.add(event("exit", step=9, at=now[0] + 0.4, code=75))
        assert wb.refresh()
        assert "stopped after step 9 with 50.4 s left" in wb.notice_line.value
        assert "checkpointed 50.0 s before the deadline" in wb.notice_line.value
    finally:
        wb.close()
