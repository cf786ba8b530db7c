"""Heartbeats (varuna/telemetry/heartbeat.py): the controller's liveness table on a clock the test
sets, the beating thread, and the settings' errors. A real job with a SIGSTOPped rank is in
tests/multirank/test_controller_jobs.py; the worker's beats are in test_telemetry.py.
"""

from __future__ import annotations

import time

import pytest

from varuna.controller import JobController
from varuna.errors import ConfigError
from varuna.telemetry.heartbeat import Beater, Liveness, SilentRank


def beat(rank: int, action: str, job: str = "j1", host: str = "h") -> dict:
    return {"type": "heartbeat", "rank": rank, "job": job, "host": host, "action": action}


def test_a_rank_quiet_for_longer_than_silent_after_is_reported_with_host_and_last_action() -> None:
    live = Liveness(silent_after_s=2.0)
    live.see({"type": "hello", "rank": 0, "job": "j1", "host": "a"}, now=100.0)
    live.see(beat(1, "step 7: sent F mb 3", host="b"), now=100.0)
    live.see(beat(0, "after step 7", host="a"), now=101.5)
    assert live.silent("j1", now=102.0) == []  # 2.0 s is not more than 2.0 s
    assert live.silent("j1", now=103.0) == [SilentRank(1, "b", "step 7: sent F mb 3", 3.0)]
    live.see({"type": "step_metrics", "rank": 1, "job": "j1"}, now=103.0)  # any event is a sign of life
    assert [s.rank for s in live.silent("j1", now=104.0)] == [0]
    assert live.silent("j2", now=104.0) == []  # another launch's ranks


def test_ranks_that_exited_are_not_expected_and_a_new_launch_starts_afresh() -> None:
    live = Liveness(silent_after_s=1.0)
    live.see(beat(0, "exited"), now=0.0)
    live.see(beat(1, "step 2"), now=0.0)
    live.see({"type": "exit", "rank": 1, "job": "j1"}, now=0.0)
    assert live.silent(now=10.0) == []
    live.see(beat(0, "idle", job="j2"), now=10.0)  # relaunched
    live.see({"type": "spans", "rank": 0, "job": "j1"}, now=20.0)  # a late word of the old launch
    assert live.silent("j2", now=20.0) == [SilentRank(0, "h", "idle", 10.0)]


def test_the_beater_beats_until_stopped() -> None:
    beats: list[float] = []
    beater = Beater(lambda: beats.append(time.monotonic()), 0.02)
    time.sleep(0.3)
    beater.stop()
    count = len(beats)
    time.sleep(0.1)
    assert count >= 3 and len(beats) == count
    assert not beater._thread.is_alive()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "10", True, None])
def test_silent_after_must_be_positive_seconds(bad: object, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"silent_after_s must be a number of seconds > 0 .*got "):
        Liveness(silent_after_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"silent_after_s must be a number of seconds > 0"):
        JobController(tmp_path, silent_after_s=bad)  # type: ignore[arg-type]


def test_a_controller_without_a_running_launch_reports_no_one(tmp_path) -> None:
    ctl = JobController(tmp_path, silent_after_s=0.5)
    ctl.liveness.see(beat(0, "idle"), now=0.0)
    assert ctl.liveness.silent() != [] and ctl.silent_ranks() == []


def test_actions_are_the_last_reported_per_rank() -> None:
    live = Liveness()
    live.see({"type": "hello", "rank": 1, "job": "j1"}, now=0.0)
    live.see(beat(0, "step 3"), now=0.0)
    live.see(beat(0, "after step 3"), now=0.5)
    assert live.actions() == {0: "after step 3", 1: None}
