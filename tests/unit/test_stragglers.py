"""Straggler detection (varuna/telemetry/stragglers.py) on synthetic step times, the launcher's log
follower and console line (straggler_watch.py), and the settings' errors. A real job with a CPU hog on
one namespace host is tests/multihost/test_multihost_stragglers.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from varuna.errors import ConfigError
from varuna.telemetry.straggler_watch import EventFollower, StragglerWatch, describe, watch_config
from varuna.telemetry.stragglers import StragglerConfig, StragglerDetector, compute_grid


def hellos(hosts: list[str], pipeline: int, job: str = "j1") -> list[dict]:
    return [
        {
            "type": "hello",
            "rank": r,
            "host": h,
            "stage": r % pipeline,
            "replica": r // pipeline,
            "world": len(hosts),
            "job": job,
        }
        for r, h in enumerate(hosts)
    ]


def steps(times: list[list[float]], pipeline: int, first: int = 0, job: str = "j1") -> list[dict]:
    """times[step][rank] -> step_metrics events, rank by rank."""
    return [
        {
            "type": "step_metrics",
            "rank": r,
            "stage": r % pipeline,
            "replica": r // pipeline,
            "step": first + s,
            "compute_s": t,
            "job": job,
        }
        for s, row in enumerate(times)
        for r, t in enumerate(row)
    ]


def test_a_replica_slower_than_its_peers_is_flagged_after_k_steps_with_its_host() -> None:
    det = StragglerDetector(StragglerConfig(ratio=1.3, steps=3, skip_steps=1))
    det.feed_all(hellos(["h1", "h1", "h2", "h2"], pipeline=2))
    # P=2, D=2: rank 2 (stage 0 of replica 1, on h2) slows down from step 2; step 0 is warm-up
    normal, slow = [0.10, 0.12, 0.10, 0.12], [0.10, 0.12, 0.19, 0.12]
    out = det.feed_all(steps([[0.5, 0.5, 0.9, 0.5], normal, slow, slow], pipeline=2))
    assert out == []  # two slow steps are not yet three (and step 0's 0.9 is not judged)
    out = det.feed_all(steps([slow], pipeline=2, first=4))
    assert [(e["type"], e["rank"], e["host"], e["stage"], e["steps"]) for e in out] == [
        ("straggler", 2, "h2", 0, [2, 3, 4])
    ]
    assert out[0]["ratio"] == pytest.approx(1.9)
    assert det.flagged == out
    assert det.feed_all(steps([slow], pipeline=2, first=5)) == []  # flagged once
    # it recovers after three normal steps
    assert det.feed_all(steps([normal, normal], pipeline=2, first=6)) == []
    gone = det.feed_all(steps([normal], pipeline=2, first=8))
    assert [(e["type"], e["rank"], e["host"]) for e in gone] == [("straggler_gone", 2, "h2")]
    assert det.flagged == []


def test_noise_below_the_ratio_or_a_single_slow_step_flags_nothing() -> None:
    det = StragglerDetector(StragglerConfig(ratio=1.3, steps=2, skip_steps=0))
    det.feed_all(hellos(["a", "b"], pipeline=1))
    times = [[0.10, 0.12], [0.10, 0.25], [0.11, 0.10], [0.10, 0.125], [0.26, 0.10], [0.10, 0.11]]
    assert det.feed_all(steps(times, pipeline=1)) == []


def test_a_step_is_judged_only_once_every_rank_reported_it() -> None:
    det = StragglerDetector(StragglerConfig(steps=1, skip_steps=0))
    det.feed_all(hellos(["a", "b"], pipeline=1))
    first = steps([[0.1, 0.3]], pipeline=1)
    assert det.feed(first[0]) == []
    assert [e["rank"] for e in det.feed(first[1])] == [1]


def test_with_one_replica_each_stage_is_compared_with_its_own_history() -> None:
    det = StragglerDetector(StragglerConfig(steps=2, skip_steps=1))
    det.feed_all(hellos(["h1", "h2"], pipeline=2))
    # stages differ in cost (0.1 vs 0.3): no peers, so neither is slow until stage 1 slows itself
    times = [[0.5, 0.9], [0.1, 0.3], [0.1, 0.31], [0.1, 0.29], [0.1, 0.6], [0.1, 0.62]]
    out = det.feed_all(steps(times, pipeline=2))
    assert [(e["rank"], e["host"], e["steps"]) for e in out] == [(1, "h2", [4, 5])]
    assert out[0]["ratio"] == pytest.approx(2.033, abs=0.01)


def test_with_one_replica_a_slowdown_of_every_stage_or_of_a_lone_rank_flags_nobody() -> None:
    det = StragglerDetector(StragglerConfig(steps=2, skip_steps=1))
    det.feed_all(hellos(["h1", "h2"], pipeline=2))
    times = [[0.5, 0.9], [0.1, 0.3], [0.1, 0.3], [0.1, 0.3], [0.2, 0.6], [0.21, 0.6], [0.2, 0.62]]
    assert det.feed_all(steps(times, pipeline=2)) == []  # the machine got busier: both stages slowed
    alone = StragglerDetector(StragglerConfig(steps=2, skip_steps=0))
    alone.feed_all(hellos(["h1"], pipeline=1))
    assert alone.feed_all(steps([[0.1], [0.1], [0.1], [0.5], [0.5], [0.5]], pipeline=1)) == []


def test_another_launchs_events_are_ignored() -> None:
    det = StragglerDetector(StragglerConfig(steps=1, skip_steps=0), job="new")
    det.feed_all(hellos(["a", "b"], pipeline=1, job="new"))
    assert det.feed_all(steps([[0.1, 0.5]], pipeline=1, job="old")) == []
    assert [e["rank"] for e in det.feed_all(steps([[0.1, 0.5]], pipeline=1, job="new"))] == [1]


def test_settings_are_checked_and_read_from_the_environment() -> None:
    assert StragglerConfig.from_env({"VARUNA_STRAGGLER_RATIO": "1.5", "VARUNA_STRAGGLER_STEPS": "2"}) == (
        StragglerConfig(ratio=1.5, steps=2)
    )
    with pytest.raises(ConfigError, match=r"VARUNA_STRAGGLER_RATIO must be a number, got 'fast'"):
        StragglerConfig.from_env({"VARUNA_STRAGGLER_RATIO": "fast"})
    with pytest.raises(
        ConfigError, match=r"ratio must be a number > 1 .* got 0.9; set VARUNA_STRAGGLER_RATIO"
    ):
        StragglerConfig(ratio=0.9)
    with pytest.raises(
        ConfigError, match=r"steps must be an integer from 1 to 5, got 9; set VARUNA_STRAGGLER_STEPS"
    ):
        StragglerConfig.from_env({"VARUNA_STRAGGLER_STEPS": "9"})
    assert watch_config({"VARUNA_STRAGGLER": "0", "VARUNA_STRAGGLER_STEPS": "9"}) is None


def _append(path: Path, events: list[dict], torn: str = "") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events) + torn)


def test_the_watch_follows_rank_logs_records_and_prints_one_line(tmp_path: Path) -> None:
    logs = tmp_path / "events"
    logs.mkdir()
    _append(logs / "rank0.jsonl", steps([[9.0, 9.0]] * 4, pipeline=1, job="old")[::2])  # an older launch
    err = io.StringIO()
    watch = StragglerWatch(tmp_path, "j1", err, StragglerConfig(steps=2, skip_steps=0))
    assert watch.follower._offsets  # starts at the logs' ends
    events = hellos(["h1", "h2"], pipeline=1) + steps([[0.1, 0.25]] * 3, pipeline=1)
    events.append({"type": "spans", "rank": 0, "job": "j1", "spans": []})
    for r in (0, 1):
        _append(logs / f"rank{r}.jsonl", [e for e in events if e["rank"] == r], torn='{"type":"step_me')
    found = watch.tick()
    assert [(e["type"], e["rank"], e["host"], e["steps"]) for e in found] == [("straggler", 1, "h2", [0, 1])]
    assert err.getvalue().splitlines() == [describe(found[0])]
    assert "rank 1 (stage 0, replica 1) on host h2 computes 2.5x slower" in err.getvalue()
    recorded = [
        json.loads(line) for line in (tmp_path / "events" / "stragglers.jsonl").read_text().splitlines()
    ]
    assert recorded == found
    assert watch.tick() == []


def test_the_follower_keeps_a_torn_line_for_the_next_poll(tmp_path: Path) -> None:
    (tmp_path / "events").mkdir()
    follow = EventFollower(tmp_path)
    path = tmp_path / "events" / "rank0.jsonl"
    path.write_text('{"type":"hello","rank":0}\n{"type":"step_metrics","ra')
    assert follow.poll() == [{"type": "hello", "rank": 0}]
    with open(path, "a") as f:
        f.write('nk":0,"step":1}\n')
    assert follow.poll() == [{"type": "step_metrics", "rank": 0, "step": 1}]


def test_compute_grid_is_the_newest_launch_by_rank_and_step() -> None:
    events = hellos(["h1", "h2"], pipeline=1, job="a") + steps([[0.1, 0.2]], pipeline=1, job="a")
    events += hellos(["h1"], pipeline=1, job="b") + [
        e | {"time": 10.0} for e in steps([[0.3], [0.4]], pipeline=1, first=1, job="b")
    ]
    grid = compute_grid(events)
    assert (grid.steps, grid.ranks, grid.hosts, grid.values) == ([1, 2], [0], {0: "h1"}, [[0.3, 0.4]])
    assert compute_grid(events, job="a").values == [[0.1], [0.2]]


def test_exclusion_writes_the_runs_own_hostfile_and_names_bad_hosts(tmp_path: Path) -> None:
    from varuna.launch.exclude import hostfile_for, write_without

    hosts = tmp_path / "hosts"
    hosts.write_text("# cluster\nnode1:2\nnode2.cluster.local slots=2\nnode3\n")
    assert hostfile_for(tmp_path, hosts) == hosts
    path, slots = write_without(tmp_path, hosts, "node2")  # the short name matches the long one
    assert (path.read_text(), slots) == ("# cluster\nnode1:2\nnode3\n", 3)
    assert hostfile_for(tmp_path, hosts) == path  # later launches use the run's own
    with pytest.raises(
        ConfigError, match=r"exclude_host\('node9'\): the job's hostfile .* names node1, node3; give one"
    ):
        write_without(tmp_path, path, "node9")
    (tmp_path / "one").write_text("node1:4\n")
    with pytest.raises(ConfigError, match=r"no host would be left .* names only node1\); add hosts"):
        write_without(tmp_path, tmp_path / "one", "node1")


def test_the_controller_reads_the_watchs_events_and_draws_the_grid_from_its_store(tmp_path: Path) -> None:
    from varuna.controller import JobController
    from varuna.errors import LaunchError

    ctl = JobController(tmp_path)
    try:
        events = hellos(["h1", "h2"], pipeline=1) + steps([[0.1, 0.3], [0.1, 0.31]], pipeline=1)
        for seq, event in enumerate(events, 1):
            ctl.store.add(event | {"time": 1.0, "seq": seq})
        grid = ctl.compute_grid()
        assert (grid.ranks, grid.steps, grid.hosts) == ([0, 1], [0, 1], {0: "h1", 1: "h2"})
        assert grid.values == [[0.1, 0.1], [0.3, 0.31]]
        (tmp_path / "events").mkdir()
        flag = {"type": "straggler", "rank": 1, "host": "h2", "job": "j1", "id": "x", "time": 2.0}
        _append(tmp_path / "events" / "stragglers.jsonl", [flag])
        assert ctl.stragglers() == []  # no launch of this controller's: nothing is current
        assert [e["id"] for e in ctl.store.events("straggler")] == ["x"]  # but the event was read
        with pytest.raises(LaunchError, match=r"exclude_host\(\) needs a running job"):
            ctl.exclude_host("h2")
    finally:
        ctl.close()


def test_a_bad_threshold_fails_the_launch_before_it_starts(tmp_path: Path) -> None:
    from varuna.launch.job import Job

    with pytest.raises(ConfigError, match=r"VARUNA_STRAGGLER_STEPS must be a whole number, got '3.5'"):
        Job([__file__], pipeline=1, data=1, run_dir=tmp_path, extra_env={"VARUNA_STRAGGLER_STEPS": "3.5"})
    job = Job([__file__], pipeline=1, data=1, run_dir=tmp_path, extra_env={"VARUNA_STRAGGLER": "0"})
    assert job._straggler_config is None
