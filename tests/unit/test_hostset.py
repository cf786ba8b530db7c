"""The agent's live host set (`varuna.elastic.hostset`): sources, when a change of hosts calls for a
morph (a shrink at once, a grow once settled), the hostfile `varuna hosts` edits, and the typed errors.
The jobs that follow a host set are in tests/multihost/test_multihost_spot.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _helpers import REPO

from varuna.controller import JobController
from varuna.elastic.agent import host_source
from varuna.elastic.hostset import (
    HostfileSource,
    HostSet,
    edit_hostfile,
    parse_host,
    slurm_hosts,
    watched_hostfile,
)
from varuna.errors import ConfigError


class Listed:
    """A source whose set the test sets (a cloud API would)."""

    def __init__(self, hosts: dict[str, int] | None) -> None:
        self.hosts = hosts

    def read(self) -> dict[str, int] | None:
        return None if self.hosts is None else dict(self.hosts)

    def describe(self) -> str:
        return "test"


def test_a_host_gone_is_a_shrink_at_once_and_more_hosts_a_grow_once_settled() -> None:
    source = Listed({"a": 2, "b": 2})
    hosts = HostSet(source, settle_s=10.0)
    offered = {"a": 2, "b": 2}
    assert hosts.change(offered, now=1e9) is None
    source.hosts = {"a": 2}
    assert hosts.poll(now=100.0) is True
    change = hosts.change(offered, now=100.0)  # not settled, and yet acted on: the host is going
    assert change is not None and change.kind == "shrink" and change.gone == ("b",)
    source.hosts = {"a": 2, "b": 2, "c": 1}
    hosts.poll(now=200.0)
    assert hosts.change(offered, now=205.0) is None  # c came 5 s ago
    change = hosts.change(offered, now=210.0)
    assert change is not None and change.kind == "grow" and change.added == ("c",)
    assert "c added" in change.describe() and "5 slots" in change.describe()
    # fewer slots on a host the launch uses is a shrink too
    source.hosts = {"a": 1, "b": 2}
    hosts.poll(now=300.0)
    assert hosts.change(offered, now=300.0).gone == ("a",)  # type: ignore[union-attr]


def test_each_change_restarts_the_settle_time_so_a_flapping_host_never_grows_the_job() -> None:
    source = Listed({"a": 2})
    hosts = HostSet(source, settle_s=10.0)
    for t, listed in ((0.0, {"a": 2, "b": 1}), (6.0, {"a": 2}), (12.0, {"a": 2, "b": 1})):
        source.hosts = listed
        hosts.poll(now=t)
    assert hosts.change({"a": 2}, now=21.0) is None  # 9 s since the last change
    assert hosts.change({"a": 2}, now=22.0) is not None


def test_a_dead_host_is_left_out_until_the_source_drops_it_and_then_comes_back_as_new() -> None:
    source = Listed({"a": 2, "b": 2})
    hosts = HostSet(source, settle_s=0.0)
    hosts.mark_dead({"b"})
    assert hosts.available() == {"a": 2}
    hosts.poll()
    assert hosts.available() == {"a": 2}  # still listed: still dead
    source.hosts = {"a": 2}
    hosts.poll()
    source.hosts = {"a": 2, "b.cluster.local": 2}  # back, by its long name
    hosts.poll()
    assert hosts.available() == {"a": 2, "b.cluster.local": 2}


def test_a_source_that_cannot_tell_keeps_the_last_set() -> None:
    source = Listed({"a": 1})
    hosts = HostSet(source, settle_s=0.0)
    source.hosts = None
    assert hosts.poll() is False and hosts.available() == {"a": 1}


def test_hostfile_source_reads_edits_keeps_the_last_set_on_a_bad_line_and_empty_means_none(
    tmp_path: Path,
) -> None:
    path = tmp_path / "hosts"
    path.write_text("a:2\n")
    source = HostfileSource(path)
    assert source.read() == {"a": 2}
    path.write_text("a:2\nb slots=3\n")
    assert source.read() == {"a": 2, "b": 3}
    path.write_text("a:2\nb:x\n")  # half-edited
    assert source.read() is None
    path.write_text("# every host taken\n")
    assert source.read() == {}
    path.unlink()
    assert source.read() is None


def test_slurm_hosts_reads_scontrol_show_job() -> None:
    line = "JobId=7 JobName=x NodeList=n[1-3] NumNodes=3 NumTasks=6 TasksPerNode=2(x3) State=RUNNING"
    assert slurm_hosts(line) == {"n1": 2, "n2": 2, "n3": 2}
    assert slurm_hosts("JobId=7 NodeList=a,b NumTasks=4") == {"a": 2, "b": 2}
    assert slurm_hosts("JobId=7 NodeList=(null) NumTasks=4") is None


def test_edit_hostfile_adds_changes_and_removes_keeping_comments(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# spot pool\na:2\nb slots=2  # zone b\n")
    assert edit_hostfile(path, add={"c": 1}) == {"a": 2, "b": 2, "c": 1}
    assert edit_hostfile(path, add={"a": 4}) == {"a": 4, "b": 2, "c": 1}
    assert edit_hostfile(path, remove=["b"]) == {"a": 4, "c": 1}
    assert path.read_text().startswith("# spot pool\na:4\n")
    assert edit_hostfile(path, remove=["a", "c"]) == {}
    with pytest.raises(ConfigError, match=r"names no host; cannot remove 'zz'"):
        edit_hostfile(path, remove=["zz"])


def test_edits_at_the_same_time_all_take_effect(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("a:1\n")
    threads = [
        threading.Thread(target=edit_hostfile, args=(path,), kwargs={"add": {f"h{i}": 1}}) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(HostfileSource(path).read() or {}) == {"a", *(f"h{i}" for i in range(8))}


def test_parse_host_forms_and_errors() -> None:
    assert parse_host("n1") == ("n1", 1)
    assert parse_host("n1:4") == ("n1", 4)
    assert parse_host("n1", default_slots=None) == ("n1", None)
    with pytest.raises(ConfigError, match=r"SLOTS a positive integer, got 'n1:0'"):
        parse_host("n1:0")
    with pytest.raises(ConfigError, match=r"without spaces"):
        parse_host("n 1")


def test_watched_hostfile_says_why_a_run_has_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"has no agent .* --watch-hosts"):
        watched_hostfile(run)
    (run / "agent").mkdir(parents=True)
    (run / "agent" / "spec.json").write_text(json.dumps({"hostfile": "/x", "watch_hosts": None}))
    with pytest.raises(ConfigError, match=r"does not watch its hosts"):
        watched_hostfile(run)
    (run / "agent" / "spec.json").write_text(json.dumps({"hostfile": None, "watch_hosts": "slurm"}))
    with pytest.raises(ConfigError, match=r"Slurm allocation: change the allocation"):
        watched_hostfile(run)
    (run / "agent" / "spec.json").write_text(json.dumps({"hostfile": "/x/h", "watch_hosts": "hostfile"}))
    assert watched_hostfile(run) == Path("/x/h")


def test_host_source_and_controller_options_are_checked(tmp_path: Path) -> None:
    assert host_source({"watch_hosts": None}) is None
    with pytest.raises(ConfigError, match=r"watch_hosts='hostfile' needs a hostfile"):
        host_source({"watch_hosts": "hostfile", "hostfile": None})
    with pytest.raises(ConfigError, match=r"watch_hosts must be one of hostfile, slurm .* got 'cloud'"):
        host_source({"watch_hosts": "cloud"})
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=r"settle_s must be a number of seconds >= 0 .* got -1"):
        JobController.start([str(script)], pipeline=1, data=1, run_dir=tmp_path / "r", settle_s=-1)
    with pytest.raises(ConfigError, match=r"watch_hosts='hostfile' needs a hostfile"):
        JobController.start([str(script)], pipeline=1, data=1, run_dir=tmp_path / "r", watch_hosts="hostfile")


def _varuna(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "varuna", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_varuna_hosts_edits_the_watched_hostfile_and_lists_the_live_set(tmp_path: Path) -> None:
    run, path = tmp_path / "run", tmp_path / "hosts"
    path.write_text("a:2\n")
    (run / "agent").mkdir(parents=True)
    (run / "agent" / "spec.json").write_text(json.dumps({"hostfile": str(path), "watch_hosts": "hostfile"}))
    done = _varuna("hosts", str(run), "add", "b:2", "c", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "now lists a:2 b:2 c:1" in done.stdout and HostfileSource(path).read() == {"a": 2, "b": 2, "c": 1}
    done = _varuna("hosts", str(run), "remove", "a", cwd=tmp_path)
    assert done.returncode == 0 and HostfileSource(path).read() == {"b": 2, "c": 1}
    state = {"hosts": {"listed": {"b": 2, "c": 1}, "available": {"b": 2}, "offered": {"b": 2}, "dead": ["c"]}}
    (run / "agent" / "state.json").write_text(json.dumps(state))
    listing = _varuna("hosts", str(run), "list", cwd=tmp_path).stdout
    assert "available: b:2" in listing and "dead: c" in listing
    bad = _varuna("hosts", str(run), "add", cwd=tmp_path)
    assert bad.returncode == 2 and "needs at least one HOST[:SLOTS]" in bad.stderr
    bad = _varuna("hosts", str(tmp_path / "nope"), "list", cwd=tmp_path)
    assert bad.returncode == 2 and "has no agent" in bad.stderr
    bad = _varuna("run", "--watch-hosts", "-p", "1", "x.py", cwd=tmp_path)
    assert bad.returncode == 2 and "--watch-hosts needs --elastic and --hostfile FILE" in bad.stderr
