"""`python -m varuna.bench spot --json --quick` across namespace hosts, and its trace reader.

Benchmarks never gate: the quick run asserts that every policy replayed the trace, that the elastic job
shrank and grew, that no step was lost or trained twice in its final trajectory and that its losses
are plain training's; never a goodput ratio.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import run_bench

from varuna.bench.netns import unavailable
from varuna.bench.spot import DEFAULT_TRACE, QUICK_TRACE, read_trace
from varuna.errors import ConfigError

pytestmark = pytest.mark.foreground


def test_the_default_trace_has_notices_unannounced_removals_and_returns() -> None:
    trace = read_trace(DEFAULT_TRACE)
    assert trace.nodes == ["n1", "n2", "n3", "n4"] and trace.end_s == 600.0
    kinds = [e.kind for e in trace.events]
    assert {"add", "remove", "notice"} <= set(kinds)
    spans = trace.availability()
    assert spans[0][0] == 0.0 and spans[-1][1] == 600.0
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # contiguous
    assert {len(p) for _, _, p in spans} == {2, 3, 4}
    quick = read_trace(QUICK_TRACE)  # the suite's: each kind of change once, on two nodes
    assert quick.nodes == ["n1", "n2"] and sorted(e.kind for e in quick.events) == [
        "add",
        "add",
        "add",
        "notice",
        "remove",
    ]


def test_a_notice_is_replayed_as_itself_and_a_removal_after_its_lead(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("ms,event,node\n0,add,a\n0,add,b\n1000,notice,b,500\n3000,add,b\n4000,end\n")
    trace = read_trace(path)
    assert [(e.at_s, e.kind, e.node) for e in trace.removals(notices=True)] == [
        (0.0, "add", "a"),
        (0.0, "add", "b"),
        (1.0, "notice", "b"),
        (1.5, "remove", "b"),
        (3.0, "add", "b"),
    ]
    assert [e.kind for e in trace.removals(notices=False)] == ["add", "add", "remove", "add"]
    assert trace.availability() == [
        (0.0, 1.5, frozenset({"a", "b"})),
        (1.5, 3.0, frozenset({"a"})),
        (3.0, 4.0, frozenset({"a", "b"})),
    ]
    half = trace.scaled(2.0, nodes=1)
    assert half.end_s == 2.0 and half.nodes == ["a"] and half.availability() == [(0.0, 2.0, frozenset({"a"}))]


def test_bamboo_traces_read_as_they_are_and_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "bamboo.csv"
    path.write_text("0,add,10.0.0.1\n0,add,10.0.0.2\n60000,remove,10.0.0.2\n")
    trace = read_trace(path)
    assert trace.nodes == ["10.0.0.1", "10.0.0.2"] and trace.end_s == 60.0
    path.write_text("0,add,a\n10,grow,a\n")
    with pytest.raises(ConfigError, match=r"line 2: expected `ms,add\|remove,node`.*got '10,grow,a'"):
        read_trace(path)
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"has no event"):
        read_trace(path)
    with pytest.raises(ConfigError, match=r"cannot read it"):
        read_trace(tmp_path / "missing.csv")


@pytest.mark.multirank
@pytest.mark.multihost
@pytest.mark.timeout(320)
def test_spot_bench_quick_replays_the_trace_under_every_policy() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    report, _ = run_bench("spot", timeout=300)
    assert set(report["baselines"]) == {"restart_only", "static"}
    assert report["goodput"] > 0 and report["ideal"] > 0
    assert report["morphs"]["grow"] >= 1 and report["morphs"]["shrink"] >= 1
    assert report["steps_lost"] == 0 and report["steps_trained_twice"] == 0
    assert report["losses_vs_plain_max_rel"] < 1e-4
    for name, baseline in report["baselines"].items():
        assert baseline["goodput"] > 0 and baseline["launches"] >= 2, name
        assert baseline["steps_lost"] == 0 and baseline["steps_trained_twice"] == 0, name
        assert baseline["morphs"]["grow"] == 0, name  # baselines never grow a running job
    assert set(report["throughput_by_ranks"]) == {
        str(len(p)) for _, _, p in report["trace"]["availability"] if p
    }
    # the quick run replays the policies side by side, each on worker hosts of its own
    assert report["settings"]["side_by_side"] is True
    hosts = [report["elastic"]["hosts"]] + [b["hosts"] for b in report["baselines"].values()]
    assert all(len(h) == 2 for h in hosts) and len({x for h in hosts for x in h}) == 6, hosts


def test_replays_side_by_side_need_a_host_per_node_for_each_policy() -> None:
    from varuna.bench.spot import SpotBench, quick

    quick().check()  # 1 + 2 nodes x 3 policies: 7 hosts
    SpotBench(nodes=8).check()  # one after the other: the hosts are reused
    with pytest.raises(ConfigError, match=r"nodes x 3 replays at once must be 1..8 .*got nodes 4"):
        SpotBench(nodes=4, side_by_side=True).check()
    SpotBench(nodes=4, side_by_side=True, policies=("elastic", "static")).check()


def test_a_run_folder_that_holds_an_earlier_run_is_refused(tmp_path: Path) -> None:
    # the benches read their jobs' event logs back: an earlier run's would be read as this one's
    from varuna.bench import fresh_out

    assert fresh_out(tmp_path / "new" / "run").is_dir()
    assert fresh_out(tmp_path / "new" / "run") == tmp_path / "new" / "run"  # still empty: fine
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "spot.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--out .*old already holds files .*name a new or empty folder"):
        fresh_out(tmp_path / "old")
