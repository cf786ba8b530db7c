"""Preemption notices without a job: the stop rule (`varuna.engine.notice`), `StopRequest` and its
signals, the stop files (`varuna.launch.notices`), `varuna notice`, and a one-process engine meeting a
deadline."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import make_gpt_engine

from varuna.cli import main
from varuna.elastic.protocol import MORPH_EXIT
from varuna.engine.config import EngineConfig
from varuna.engine.notice import CHECKPOINT_MARGIN, SLACK_S, STEP_MARGIN, NoticeWatch, decide
from varuna.errors import ConfigError
from varuna.launch.notices import StopFiles, parse_duration, post_stop
from varuna.launch.signals import StopRequest

# --- the rule ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remaining", "step_s", "checkpoint_s", "writing", "stop"),
    [
        (30.0, 1.0, 4.0, False, False),  # 1.5 + 6 + 2 = 9.5 s fit in 30
        (9.6, 1.0, 4.0, False, False),
        (9.4, 1.0, 4.0, False, True),  # the first step after which they no longer fit
        (9.6, 1.0, 4.0, True, True),  # a background write in flight is waited for first: 15.5 s
        (100.0, 1.0, None, False, True),  # no checkpoint measured: stop at once
        (-1.0, 0.1, 0.1, False, True),  # the deadline has passed
    ],
)
def test_the_stop_rule(
    remaining: float, step_s: float, checkpoint_s: float | None, writing: bool, stop: bool
) -> None:
    got, needed = decide(remaining, step_s, checkpoint_s, writing=writing)
    assert got is stop
    if checkpoint_s is None:
        assert needed is None
    else:
        writes = 2 if writing else 1
        assert needed == pytest.approx(
            STEP_MARGIN * step_s + CHECKPOINT_MARGIN * checkpoint_s * writes + SLACK_S
        )


def test_the_watch_weighs_its_longest_recent_step_and_checkpoint() -> None:
    request = StopRequest()
    watch = NoticeWatch(request, run_dir=None, job=None, rank=0)
    assert not watch.decide().stop  # nothing asked
    watch.begin_step()
    time.sleep(0.05)
    watch.decide()
    watch.end_step()
    assert watch.step_s is not None and watch.step_s >= 0.05
    request.set("notice", deadline=time.time() + 60)
    watch.begin_step()
    first = watch.decide()
    assert first.stop and first.needed_s is None  # no checkpoint measured yet
    for seconds in (0.5, 3.0, 1.0):
        watch.checkpoint_measured(seconds)
    watch.begin_step()
    later = watch.decide()
    assert watch.checkpoint_s == 3.0 and not later.stop
    assert later.remaining_s is not None and 59 < later.remaining_s <= 60
    request.set("notice", deadline=time.time() + 5)  # the earliest deadline counts
    assert watch.decide().stop
    request.set("now")
    assert watch.decide().stop


# --- StopRequest -------------------------------------------------------------------------------------


def test_a_request_without_a_deadline_stops_now_and_notices_keep_the_earliest() -> None:
    request = StopRequest()
    assert not request and request.deadline is None
    request.set("spot", deadline=200.0, hosts=["b", "a"])
    request.set("spot again", deadline=100.0)
    assert request and not request.immediate and request.reason == "spot"
    assert request.deadline == 100.0 and request.notices[0].hosts == ("a", "b")
    request.set("resize")
    assert request.immediate and request.reason == "spot"


@pytest.fixture()
def handlers() -> Iterator[None]:
    """Put SIGUSR1's and SIGTERM's handlers back after the test."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_sigterm_is_a_notice_only_with_a_notice_window(handlers: None) -> None:
    plain = StopRequest()
    assert plain.install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert plain.immediate and plain.reason == "SIGTERM" and not plain.notices

    window = StopRequest()
    assert window.install(notice_s=30.0)
    before = time.time()
    os.kill(os.getpid(), signal.SIGTERM)
    assert not window.immediate and window.reason == "SIGTERM"
    (notice,) = window.notices
    assert notice.source == "signal" and before + 30 <= notice.deadline <= time.time() + 30
    os.kill(os.getpid(), signal.SIGUSR1)  # a morph: at the end of this step, window or not
    assert window.immediate


# --- stop files --------------------------------------------------------------------------------------


def test_stop_files_are_read_once_and_only_for_this_launch(tmp_path: Path) -> None:
    stale = post_stop(tmp_path, reason="for an earlier launch")
    since = json.loads(stale.read_text())["time"] + 1e-3
    files = StopFiles(tmp_path, "job-2", since=since)
    assert files.new() == []
    time.sleep(0.002)
    post_stop(tmp_path, reason="other", job="job-1", deadline=time.time() + 60)
    mine = post_stop(tmp_path, reason="spot", job="job-2", deadline=123.0, hosts=["n2", "n1"])
    anyone = post_stop(tmp_path, reason="grow")
    got = files.new()
    assert [(r["reason"], r["deadline"], r["hosts"]) for r in got] == [
        ("spot", 123.0, ["n1", "n2"]),
        ("grow", None, None),
    ]
    assert [r["path"] for r in got] == [str(mine), str(anyone)]
    assert files.new() == []


def test_a_deadline_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"a notice's deadline is seconds since the epoch \(a number\), got '90s'"
    ):
        post_stop(tmp_path, reason="x", deadline="90s")  # type: ignore[arg-type]


def test_rank_0_reads_the_files_into_its_request_at_most_every_poll_s(tmp_path: Path) -> None:
    request = StopRequest()
    watch = NoticeWatch(request, run_dir=tmp_path, job="j", rank=0, poll_s=60.0)
    assert NoticeWatch(StopRequest(), run_dir=tmp_path, job="j", rank=1).files is None  # rank 0 only
    watch.poll()
    post_stop(tmp_path, reason="spot", job="j", deadline=time.time() + 30, hosts=["h"])
    watch.poll()  # within poll_s of the last look: not read yet
    assert not request
    watch._next_poll = 0.0
    watch.poll()
    (notice,) = request.notices
    assert notice.source == "file" and notice.hosts == ("h",) and not request.immediate
    assert [n.reason for n in watch.new_notices()] == ["spot"] and watch.new_notices() == []


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90.0), ("90s", 90.0), ("2min", 120.0), ("1.5h", 5400.0), (45, 45.0)]
)
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-5s", "2 days", "", "inf"])
def test_a_bad_duration_names_the_forms(text: str) -> None:
    with pytest.raises(
        ConfigError,
        match=r"--deadline .* is not a duration: give seconds \(90\), or a number with a unit: 90s, 2min, 1h",
    ):
        parse_duration(text)


# --- varuna notice ----------------------------------------------------------------------------------


def test_varuna_notice_writes_the_request_for_the_running_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "j-7", "start": time.time()}))
    before = time.time()
    assert main(["notice", str(tmp_path), "--deadline", "2min", "--host", "n3", "--reason", "spot"]) == 0
    (path,) = (tmp_path / "requests").glob("stop-*.json")
    request = json.loads(path.read_text())
    assert request["job"] == "j-7" and request["hosts"] == ["n3"] and request["reason"] == "spot"
    assert before + 120 <= request["deadline"] <= time.time() + 120
    out = capsys.readouterr().out
    assert "notice for launch j-7" in out and "n3 go away in 120 s" in out


def test_varuna_notice_after_the_launch_ended_says_no_rank_acts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "j-7", "start": 1.0, "end": 2.0}))
    assert main(["notice", str(tmp_path), "--deadline", "30"]) == 0
    (path,) = (tmp_path / "requests").glob("stop-*.json")
    assert json.loads(path.read_text())["job"] is None
    assert "no rank acts on the notice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--deadline", "soon"],
            r"--deadline 'soon' is not a duration: give seconds \(90\), or a number with a unit",
        ),
        (
            ["--deadline", "90s"],
            r"is not a varuna run directory \(it has no job.json\): give the --run-dir of a job",
        ),
    ],
)
def test_varuna_notice_errors_name_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["notice", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("varuna: error: ")
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "requests").exists()


# --- the option --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, "90s", float("nan"), True])
def test_a_bad_notice_window_is_refused(value: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"notice_s=.*: give the preemption notice window in seconds \(a number >= 0"
    ):
        EngineConfig(pipeline=1, data=1, global_batch_size=8, micro_batch_size=2, notice_s=value)


def test_a_bad_varuna_notice_s_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_NOTICE_S", "a while")
    with pytest.raises(ConfigError, match=r"VARUNA_NOTICE_S 'a while' is not a duration"):
        make_gpt_engine(tmp_path)


# --- one engine meets a deadline ---------------------------------------------------------------------


def logged(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "events" / "rank0.jsonl").read_text().splitlines()]


def test_an_engine_trains_on_while_a_step_and_a_checkpoint_fit_then_stops(
    tmp_path: Path, handlers: None
) -> None:
    engine, data = make_gpt_engine(tmp_path, checkpoint_every=2)
    for k in range(3):
        engine.step(engine.batch(data, k))
    engine.wait_checkpoint()  # step 2's, written in the background: now measured
    assert engine._notice.checkpoint_s is not None
    engine.request_stop("spot", deadline=time.time() + 3600, hosts=["n1"])
    for k in range(3, 6):
        engine.step(engine.batch(data, k))
        assert not engine.should_stop  # an hour is plenty
    engine.request_stop("spot, sooner", deadline=time.time() + 1.0)  # less than the slack: stop now
    engine.step(engine.batch(data, 6))
    assert engine.should_stop and engine.last_checkpoint is not None
    assert engine.last_checkpoint["step"] == 7 and "blocking" not in engine.last_checkpoint
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000007"
    with pytest.raises(SystemExit) as exited:
        engine.step(engine.batch(data, 7))
    assert exited.value.code == MORPH_EXIT
    events = logged(tmp_path)
    notices = [e for e in events if e["type"] == "notice"]
    assert [(n["reason"], n["hosts"], n["step"]) for n in notices] == [
        ("spot", ["n1"], 3),
        ("spot, sooner", None, 6),
    ]
    (decided,) = [e for e in events if e["type"] == "stop_decided"]
    assert decided["step"] == 7 and decided["decided_here"] and decided["seconds_left"] < 1.0
    assert decided["reason"] == "spot" and decided["needed_s"] > SLACK_S
    done = [(e["saved_step"], e["blocking"]) for e in events if e["type"] == "checkpoint_done"]
    assert done[-1] == (7, True) and (2, False) in done  # the background ones are reported too
    engine.close()


def test_an_engine_with_no_checkpoint_measured_stops_at_once(tmp_path: Path, handlers: None) -> None:
    engine, data = make_gpt_engine(tmp_path, on_stop="flag")
    engine.step(engine.batch(data, 0))
    engine.request_stop("spot", deadline=time.time() + 3600)
    engine.step(engine.batch(data, 1))
    assert engine.should_stop and engine._decision is not None and engine._decision.needed_s is None
    engine.close()


def test_rank_0_polls_the_stop_files_of_its_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handlers: None
) -> None:
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "j-1", "start": time.time() - 5}))
    monkeypatch.setenv("VARUNA_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("VARUNA_JOB_ID", "j-1")
    post_stop(tmp_path, reason="an earlier launch's", job="j-0")
    engine, data = make_gpt_engine(tmp_path, on_stop="flag")
    engine.step(engine.batch(data, 0))
    assert not engine.should_stop
    post_stop(tmp_path, reason="grow", job="j-1")  # the agent: no deadline, at the end of this step
    engine._notice._next_poll = 0.0
    engine.step(engine.batch(data, 1))
    assert engine.should_stop and engine.stop_request.reason == "grow" and engine.stop_request.immediate
    engine.close()
