"""The notebook controller (varuna/controller.py, varuna/_store.py) without Jupyter.

One real 2-rank job (tests/scripts/controller_train.py) is shared by the tests below, which run in
file order through its life: running -> checkpoint -> trace -> resize 2x1 to 1x2 -> stop -> attach
to the stopped run -> resume -> attach while it runs -> SIGKILL a worker -> failed. The tests without
a job are in tests/unit/test_controller.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
from _helpers import SCRIPTS

from varuna.controller import JobController
from varuna.errors import LaunchError
from varuna.launch.pids import job_processes

pytestmark = [pytest.mark.multirank, pytest.mark.foreground]
SCRIPT = str(SCRIPTS / "controller_train.py")


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


# --- one real job ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ctl(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("controller") / "run"
    controller = JobController.start(
        [SCRIPT, "100000", "0.05"], pipeline=2, data=1, run_dir=run_dir, grace_s=5.0
    )
    yield controller
    if controller.state not in ("stopped", "failed", "finished"):
        controller.stop(checkpoint=False, timeout=30)
    controller.close()


@pytest.mark.timeout(120)
def test_job_runs_with_hello_from_both_ranks(ctl: JobController) -> None:
    assert ctl.wait(60, states=("running", "failed")) == "running", "\n".join(ctl.console.lines)
    assert ctl.hellos() == {0, 1}
    assert wait_for(lambda: all(r.steps >= 3 for r in ctl.ranks()))
    rows = ctl.ranks()
    assert [(r.rank, r.stage, r.replica, r.state) for r in rows] == [
        (0, 0, 0, "running"),
        (1, 1, 0, "running"),
    ]
    assert all(r.pid and r.host and r.last_heartbeat and time.time() - r.last_heartbeat < 10 for r in rows)
    assert "step" in ctl.log_tail(0)


@pytest.mark.timeout(60)
def test_the_key_is_on_no_command_line_and_only_in_controller_json(ctl: JobController) -> None:
    assert ctl.job is not None
    key = ctl.key
    procs = job_processes(ctl.job.job_id)
    names = [Path(argv[0]).name for argv in procs.values()]
    ranks = [pid for pid, argv in procs.items() if argv[1:3] == ["-m", "varuna.launch.worker"]]
    assert "mpiexec" in names and "hydra_pmi_proxy" in names and len(ranks) == 2, names
    assert not [argv for argv in procs.values() if any(key in arg for arg in argv)]
    assert all(key.encode() in Path(f"/proc/{pid}/environ").read_bytes() for pid in ranks)  # it came by env
    files = [p for p in ctl.run_dir.rglob("*") if p.is_file()]
    assert ctl.run_dir / "job.json" in files
    assert [p.name for p in files if key.encode() in p.read_bytes()] == ["controller.json"]
    assert (ctl.run_dir / "controller.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(90)
def test_a_stopped_rank_is_reported_silent_with_host_and_last_action_then_back(ctl: JobController) -> None:
    pid = {r.rank: r.pid for r in ctl.ranks()}[1]
    notes = len(ctl.store.events("rank_silent")), len(ctl.store.events("rank_back"))
    ctl.liveness.silent_after_s = 2.0
    try:
        in_step = re.compile(r"(after )?step \d+(: (all-reduce|sent [FB] mb \d+))?")
        assert wait_for(
            lambda: in_step.fullmatch(ctl.liveness.actions().get(1) or ""), 10
        )  # beats say training
        assert ctl.silent_ranks() == []
        os.kill(pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: [s.rank for s in ctl.silent_ranks()] == [1], 15), ctl.silent_ranks()
            (silent,) = ctl.silent_ranks()
            assert silent.host == socket.gethostname() and silent.silent_s > 2.0
            assert in_step.fullmatch(silent.last_action or "")
            assert wait_for(lambda: len(ctl.store.events("rank_silent")) > notes[0], 5)
            note = ctl.store.events("rank_silent")[-1]
            assert (note["silent_rank"], note["host"]) == (1, silent.host) and note["last_action"]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert wait_for(lambda: ctl.silent_ranks() == [], 15), ctl.silent_ranks()
        assert wait_for(lambda: len(ctl.store.events("rank_back")) > notes[1], 5)
        assert ctl.store.events("rank_back")[-1]["silent_rank"] == 1
        assert ctl.state == "running"
    finally:
        ctl.liveness.silent_after_s = 10.0


@pytest.mark.timeout(60)
def test_spans_for_both_stages_metrics_and_memory(ctl: JobController) -> None:
    timeline = ctl.timeline(last_steps=2)
    assert len(timeline.steps) == 2
    assert [(r.stage, r.replica) for r in timeline.rows] == [(0, 0), (1, 0)]
    for row in timeline.rows:
        kinds = Counter(s.kind for s in row.spans)
        assert kinds["F"] == kinds["B"] == 2 * 8 and kinds["send"] == kinds["recv"] == 2 * 8
    sends = [s for s in timeline.rows[0].spans if s.kind == "send"]
    assert all(s.peer == 1 and s.direction == "F" and s.bytes and s.bytes > 0 for s in sends)
    metrics = ctl.step_metrics()
    assert len(metrics) >= 3 and all(0.0 <= m.bubble < 1.0 and m.samples_per_s > 0 for m in metrics)
    assert set(metrics[-1].bubble_by_stage) == {0, 1}
    memory = ctl.memory()
    assert [m.stage for m in memory] == [0, 1]
    assert all(m.params > 0 and m.grads == m.params and m.activations > 0 and m.peak_rss for m in memory)


@pytest.mark.timeout(60)
def test_bubble_breakdown_of_a_real_step_beside_its_prediction(ctl: JobController) -> None:
    from varuna.telemetry import compare_step, step_spans

    timeline = ctl.timeline(last_steps=1)
    spans = step_spans(timeline)
    assert sorted(spans) == [0, 1] and {sp["kind"] for sp in spans[1]} >= {"F", "B", "W", "recv"}
    hello = [e for e in ctl.store.events("hello") if e["rank"] == 0][-1]
    assert (hello["pipeline"], hello["num_microbatches"]) == (2, 8)
    bubbles = compare_step(spans, hello["schedule"], 2, 8, step=timeline.steps[-1], sees_arrivals=False)
    for s in (0, 1):
        measured, predicted = bubbles.measured[s], bubbles.predicted[s]
        idle = measured["fill_drain_s"] + measured["comm_wait_s"] + measured["imbalance_s"]
        assert idle == pytest.approx(measured["step_s"] - measured["busy_s"])
        assert 0 < measured["busy_s"] < measured["step_s"] and 0 < predicted["busy_s"] < predicted["step_s"]
        assert predicted["busy_s"] == pytest.approx(measured["busy_s"], rel=0.5)  # medians of the same spans
    # the pipeline's fill and drain are there in both; stage 1 (the last) idles before its first forward
    assert bubbles.measured[1]["fill_drain_s"] > 0 and bubbles.predicted[1]["fill_drain_s"] > 0
    assert bubbles.theory == pytest.approx(1 / 9)
    figures = pytest.importorskip("varuna_widgets.figures")
    fig = figures.bubble_figure(bubbles)
    assert [len(t["y"]) for t in fig["data"]] == [4, 4, 4] and fig["layout"]["shapes"][0][
        "y0"
    ] == pytest.approx(100 / 9)


@pytest.mark.timeout(60)
def test_checkpoint_command(ctl: JobController) -> None:
    done = ctl.checkpoint(timeout=30)
    assert sorted(e["rank"] for e in done) == [0, 1]
    assert len({e["saved_step"] for e in done}) == 1  # both ranks on the same step
    path = Path(done[0]["path"])
    assert path.is_dir() and (path / "manifest.json").exists()
    assert ctl.state == "running"


@pytest.mark.timeout(60)
def test_chrome_trace_has_both_stages_and_flow_arrows(ctl: JobController, tmp_path: Path) -> None:
    trace = json.loads(ctl.export_chrome_trace(tmp_path / "trace.json", last_steps=3).read_text())[
        "traceEvents"
    ]
    slices = [e for e in trace if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {0, 1} and len({e["pid"] for e in slices}) == 2
    assert all(e["dur"] >= 0 for e in slices) and any(e["dur"] > 0 for e in slices)
    starts = {e["id"]: e for e in trace if e["ph"] == "s"}
    ends = {e["id"]: e for e in trace if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    for i, s in starts.items():
        assert s["tid"] != ends[i]["tid"] and ends[i]["ts"] >= s["ts"]
    names = {e["name"] for e in trace if e["ph"] == "M"}
    assert {"process_name", "thread_name"} <= names


@pytest.mark.timeout(90)
def test_resize_relaunches_in_the_new_shape(ctl: JobController) -> None:
    first = ctl.job
    ctl.resize(pipeline=1, data=2)
    assert ctl.state == "morphing"
    assert wait_for(lambda: ctl.job is not first and ctl.state == "running", 60), "\n".join(ctl.console.lines)
    assert (ctl.job.pipeline, ctl.job.data) == (1, 2)
    hellos = ctl.store.events("hello", job=ctl.job.job_id)
    assert sorted((e["rank"], e["stage"], e["replica"]) for e in hellos) == [(0, 0, 0), (1, 0, 1)]
    assert all(e["resumed_from"] for e in hellos)


@pytest.mark.timeout(60)
def test_stop_with_checkpoint(ctl: JobController) -> None:
    assert wait_for(lambda: len(ctl.step_metrics()) > 0 and ctl.ranks()[0].steps >= 2)
    assert ctl.stop(checkpoint=True, timeout=30) == "stopped"
    assert ctl.exit_code == 75
    exits = ctl.store.events("exit", job=ctl.job.job_id)
    assert {e["rank"] for e in exits} == {0, 1} and all(e["code"] == 75 for e in exits)
    with pytest.raises(LaunchError, match=r"checkpoint\(\) needs a running job; this one is stopped"):
        ctl.checkpoint()


@pytest.mark.timeout(30)
def test_attach_to_the_stopped_run_replays_the_same_events(ctl: JobController) -> None:
    replay = JobController.attach(ctl.run_dir)
    assert replay.state == "stopped"
    key = lambda e: (e.get("job"), e.get("rank"), e.get("seq"), e["type"])  # noqa: E731
    assert sorted(map(key, replay.store.events()), key=str) == sorted(map(key, ctl.store.events()), key=str)
    assert [m.step for m in replay.step_metrics()] == [m.step for m in ctl.step_metrics()]
    assert replay.timeline(3).steps == ctl.timeline(3).steps
    assert replay.memory() == ctl.memory()


@pytest.mark.timeout(120)
def test_resume_then_a_sigkilled_worker_fails_the_job(ctl: JobController) -> None:
    steps_before = max(m.step for m in ctl.step_metrics())
    ctl.resume()
    assert ctl.wait(60, states=("running", "failed")) == "running", "\n".join(ctl.console.lines)
    assert (ctl.job.pipeline, ctl.job.data) == (1, 2)
    assert wait_for(lambda: max(m.step for m in ctl.step_metrics()) > steps_before + 1)
    # a kernel restart: a second controller takes over the run dir and hears the live job
    ctl.close()
    again = JobController.attach(ctl.run_dir)
    try:
        assert again.state == "running"
        count = again.store.count
        assert wait_for(lambda: again.store.count > count + 2, 20)
        victim = next(r for r in again.ranks() if r.rank == 1)
        os.kill(victim.pid, signal.SIGKILL)
        assert ctl.wait(60) == "failed"
        dead = ctl.dead_ranks()
        first = [d for d in dead if d.first]
        assert [(d.rank, d.how) for d in first] == [(1, "killed")], (dead, ctl.summary())
        assert "rank 1" in ctl.summary()[0] and "SIGKILL" in ctl.summary()[0]
        assert ctl.exit_code not in (0, 75)
        assert again.wait(30) == "failed"
    finally:
        again.close()
