"""Planning at scale: the fast search gives today's answers, hosts and their network, `varuna plan
--gpus 1024` through the CLI, and what limits a plan."""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest

from varuna.bench.planner.scale import PaperGPT, paper_table
from varuna.cli import main
from varuna.errors import ConfigError, PlanError
from varuna.planner.cluster import Cluster, Links, Placement
from varuna.planner.costs import CostTable, NetworkCost, SegmentCost
from varuna.planner.fast import inflight_in_order, lowered, run_in_order
from varuna.planner.limits import explain
from varuna.planner.search import plan
from varuna.planner.simulator import StageCost, _Simulation, simulate_lowered
from varuna.schedule import build_schedule

GiB = 2**30


def varied_table(*, shared: bool = False) -> CostTable:
    """10 segments of uneven cost, 3 micro-batch sizes, tied weights; `shared`: a CPU host whose
    ranks share 2 cores (compute slowdown, delivery delays, message CPU), as a profile measures."""
    sizes = (1, 2, 4)
    segments = []
    for j in range(10):
        w = 1.0 + 0.37 * ((j * 7) % 5) + (2.0 if j == 9 else 0.0)
        segments.append(
            SegmentCost(
                forward_s={n: w * (0.4 + n) * 1e-3 for n in sizes},
                backward_s={n: 2.1 * w * (0.4 + n) * 1e-3 for n in sizes},
                recompute_s={n: 1.05 * w * (0.4 + n) * 1e-3 for n in sizes},
                activation_bytes={n: 0 if j == 9 else n * 3 * 2**20 for n in sizes},
                activation_memory_bytes={n: n * (20 + 3 * j) * 2**20 for n in sizes},
                param_bytes=(50 + 10 * j) * 2**20,
                grad_bytes=(50 + 10 * j) * 2**20,
                optimizer_bytes=2 * (50 + 10 * j) * 2**20,
                update_s=(50 + 10 * j) * 1e-6,
            )
        )
    points = [(0, 2e-5), (2**20, 4e-4), (2**30, 0.3)]
    net = NetworkCost(
        p2p_latency_s=3e-5,
        p2p_bandwidth_Bps=4e9,
        allreduce={2: points, 4: [(b, 1.4 * t) for b, t in points]},
        message_s={
            "SEND_F": 1e-4,
            "RECV_F": 5e-5,
            "SEND_B": 1e-4,
            "RECV_B": 5e-5,
            "DELAY_F": 2e-5,
            "DELAY_B": 3e-5,
        },
        delivery_s={2: {"F": 1e-4, "B": 2e-4}, 4: {"F": 4e-4, "B": 6e-4}} if shared else {},
        message_cpu=[(2**16, 3e-4), (2**20, 1e-3)] if shared else [],
        reports_arrival=not shared,
    )
    return CostTable(
        model_signature="varied",
        segments=segments,
        network=net,
        micro_batch_sizes=list(sizes),
        tied_bytes=8 * 2**20,
        compute_slowdown={2: 1.1, 4: 2.0} if shared else {},
        action_overhead_s=2e-4 if shared else 0.0,
    )


# What the planner before the fast search (main at 6296663) answered on `varied_table`: the
# number ranked and rejected, and a digest of every ranked candidate (P, D, mbs, schedule,
# recompute, predicted step, memory) in order and every rejection (P, mbs, schedule, recompute, kind).
# Updated once, when pulled-ahead forwards got a bound (`pull_ahead_room`, with eager-1f1b): Varuna's
# schedule without recompute then holds at most one micro-batch more than 1F1B, so its candidates
# fit more often ("one": 41 ranked, 37 rejected before; "one16": 23, 55) and a tie lists the
# schedule that recomputes by itself first; every other candidate and rejection was checked equal.
# And when a split backward's shares became the engine's measured 0.65 and 0.5 (from 0.6 and 0.47)
# and zb-h1 / zb-v merge the W's that fill nothing back into their B (`fuse_weights`): the same
# numbers ranked and rejected, the split schedules' predicted steps changed; then again when zb-h1
# pulled forwards ahead and a pulled forward counted a split backward's micro-batch until its W.
BEFORE = {
    "one": (False, 8, 64, 3 * GiB, 47, 31, "d65ee019539b672d"),
    "one16": (False, 16, 64, 2 * GiB, 27, 51, "037fc54afe3ca6b1"),
    "shared": (True, 4, 8, 4 * GiB, 44, 4, "2d4c854d317d1faf"),
}


ONE_CHUNK = ("gpipe", "1f1b", "varuna", "zb-h1")


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_same_answers_as_the_planner_before_it_was_made_fast(case: str) -> None:
    shared, gpus, batch, memory, ranked, rejected, digest = BEFORE[case]
    result = plan(
        varied_table(shared=shared),
        gpus=gpus,
        memory_bytes=memory,
        global_batch_size=batch,
        schedules=ONE_CHUNK,
    )  # the schedules of then
    seen = {
        "ranked": [
            [
                c.pipeline,
                c.data,
                c.micro_batch_size,
                c.schedule,
                c.recompute,
                c.predicted_step_s,
                c.max_memory_bytes,
            ]
            for c in result.ranked
        ],
        "rejected": sorted(
            [
                [r.pipeline, r.micro_batch_size or 0, r.schedule or "", bool(r.recompute), r.kind]
                for r in result.rejected
            ]
        ),
    }
    assert (len(result.ranked), len(result.rejected)) == (ranked, rejected)
    assert hashlib.sha256(json.dumps(seen).encode()).hexdigest()[:16] == digest


@pytest.mark.parametrize("memory", [64 * GiB, 3 * GiB, int(2.2 * GiB)])
def test_fast_search_equals_the_event_by_event_one(memory: int) -> None:
    """Pruning by list-order memory, cached lists and the by-stage simulation change nothing:
    the same ranking with the same times, the same rejections (a pruned one says "at least")."""
    table = varied_table()
    cluster = Cluster(gpus_per_host=4, inter_bandwidth_Bps=2e9)
    for kw in ({}, {"cluster": cluster}):
        fast = plan(table, gpus=8, memory_bytes=memory, global_batch_size=32, **kw)  # type: ignore[arg-type]
        slow = plan(table, gpus=8, memory_bytes=memory, global_batch_size=32, fast=False, **kw)  # type: ignore[arg-type]
        assert [c.to_json() for c in fast.ranked] == [c.to_json() for c in slow.ranked]
        key = [(r.pipeline, r.micro_batch_size, r.schedule, r.recompute, r.kind) for r in fast.rejected]
        assert key == [
            (r.pipeline, r.micro_batch_size, r.schedule, r.recompute, r.kind) for r in slow.rejected
        ]
        for f, s in zip(fast.rejected, slow.rejected):
            assert (f.memory_bytes or 0) <= (s.memory_bytes or 0)
            assert f.reason == s.reason or (f.memory_at_least and "needs at least" in f.reason)


def test_by_stage_simulation_equals_the_event_simulation() -> None:
    rng = random.Random(7)
    messages = {
        "SEND_F": 1e-4,
        "RECV_F": 2e-5,
        "SEND_B": 3e-5,
        "RECV_B": 1e-5,
        "DELAY_F": 4e-5,
        "DELAY_B": 0.0,
    }
    for name in ONE_CHUNK:  # run_in_order is one stage per rank; two chunks: the event simulation
        for p, m in ((1, 3), (2, 1), (3, 5), (4, 8), (5, 3)):
            for recompute in (False, True):
                lists = lowered(name, p, m, recompute=recompute)
                assert lists == build_schedule(name, p, m, recompute=recompute)  # the same lists, unvalidated
                costs = [
                    StageCost(
                        forward_s=rng.uniform(1, 3),
                        backward_s=rng.uniform(2, 6),
                        recompute_s=rng.uniform(1, 3),
                    )
                    for _ in range(p)
                ]
                comm = [rng.uniform(0, 2) for _ in range(p - 1)]
                reduce = [rng.uniform(0, 1) for _ in range(p)]
                sim = _Simulation(lists, costs, comm, reduce, False, None, messages)
                sim.run()
                assert run_in_order(lists, costs, comm, reduce, messages) == sim.spans
                timeline = simulate_lowered(lists, costs, comm=comm, allreduce_s=reduce, message_s=messages)
                exact = timeline.peak_inflight
                pulled = simulate_lowered(lists, costs, comm=comm, allreduce_s=reduce, opportunistic=True)
                in_order = inflight_in_order(lists)
                assert in_order == exact and all(a <= b for a, b in zip(in_order, pulled.peak_inflight))


def test_hosts_make_crossing_transfers_and_reduces_slower() -> None:
    net = NetworkCost(p2p_latency_s=5e-6, p2p_bandwidth_Bps=150e9)
    one = Links(net, None, 4, 8)
    same = Links(net, Cluster(gpus_per_host=32), 4, 8)  # every rank on one host: the profile's network
    hosts = Links(net, Cluster(gpus_per_host=8), 4, 8)
    assert [same.p2p(b, 2**24) for b in range(3)] == [one.p2p(b, 2**24) for b in range(3)]
    assert same.stage_allreduce(0, 2**30) == one.stage_allreduce(0, 2**30)
    assert not any(hosts.crosses(b) for b in range(3))  # P=4 fits in a host of 8
    assert hosts.stage_allreduce(0, 2**30) > 20 * one.stage_allreduce(0, 2**30)  # 4 hosts at 100 Gbit/s
    deep = Links(net, Cluster(gpus_per_host=8), 16, 2)
    assert [deep.crosses(b) for b in range(15)] == [b == 7 for b in range(15)]
    assert deep.p2p(7, 2**24) == pytest.approx(20e-6 + 2**24 / 12.5e9)
    with pytest.raises(PlanError, match="at least 1"):
        Cluster(gpus_per_host=0)
    with pytest.raises(PlanError, match="--inter-host-gbit"):
        Cluster(gpus_per_host=8, inter_bandwidth_Bps=0)


def test_two_chunks_per_rank_are_priced_by_host() -> None:
    """The multi-chunk pricing goes through `Links`: on one host (or without a cluster) it is the
    profile's network as before; with a rank per host every non-local virtual boundary, interleaved's
    wrap from the last rank back to the first too, crosses hosts and the step gets longer."""
    from varuna.planner.chunked import chunked_candidate

    table = varied_table()
    for schedule in ("interleaved-1f1b", "zb-v"):
        args = (table, 2, 2, 2, schedule, False, 32)
        plain = chunked_candidate(*args)  # type: ignore[arg-type]
        one_host = chunked_candidate(*args, cluster=Cluster(gpus_per_host=8))  # type: ignore[arg-type]
        spread = chunked_candidate(*args, cluster=Cluster(gpus_per_host=1, inter_bandwidth_Bps=1e8))  # type: ignore[arg-type]
        assert one_host.predicted_step_s == plain.predicted_step_s
        assert spread.predicted_step_s > 1.2 * plain.predicted_step_s
    net = NetworkCost(p2p_latency_s=5e-6, p2p_bandwidth_Bps=150e9)
    links = Links(net, Cluster(gpus_per_host=2), 2, 2)
    assert not links.crosses(1, to=0)  # positions 0 and 1 share a host
    wide = Links(net, Cluster(gpus_per_host=1), 2, 1)
    assert wide.crosses(1, to=0) and wide.p2p(1, 2**20, to=0) > links.p2p(1, 2**20, to=0)


def test_limits_name_memory_when_a_shallower_pipeline_does_not_fit() -> None:
    result = plan(
        paper_table(PaperGPT(n_layer=8, d_model=2048, seq=1024)),
        gpus=8,
        memory_bytes="8GiB",
        global_batch_size=64,
    )
    e = explain(result)
    assert e["pipeline"] == result.best.pipeline > 1 and e["limited_by"][0] == "memory"
    assert e["fewer_stages"]["fits"] is False and "out of memory" in e["fewer_stages"]["why"]
    assert sum(e["shares"].values()) == pytest.approx(1.0)


def test_cli_plans_1024_gpus_over_hosts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = paper_table().save(tmp_path / "profile.json")
    args = [
        "plan",
        "--gpus",
        "1024",
        "--memory",
        "80GiB",
        "--profile",
        str(path),
        "--global-batch",
        "1024",
        "--gpus-per-host",
        "8",
    ]
    start = time.perf_counter()
    assert main([*args, "--json", "--top", "3"]) == 0
    took = time.perf_counter() - start
    data = json.loads(capsys.readouterr().out)
    with capsys.disabled():
        print(f"\nvaruna plan --gpus 1024: {took:.2f} s")  # reported, not asserted
    best = data["ranked"][0]
    assert best["pipeline"] * best["data"] == 1024
    assert best["data"] * best["micro_batch_size"] * best["num_microbatches"] == 1024
    assert max(best["memory_per_stage_bytes"]) <= 80 * GiB and best["pipeline"] <= 48
    steps = [c["predicted_step_s"] for c in data["ranked"]]
    assert steps == sorted(steps)
    assert data["limits"]["pipeline"] == best["pipeline"] and data["limits"]["limited_by"]
    assert main([*args, "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "limited by" in out and "on 128 hosts of 8" in out
    assert main([*args, "--inter-host-gbit", "-1"]) == 2
    assert "--inter-host-gbit" in capsys.readouterr().err


def test_scale_bench_reports_shapes_limits_and_plan_times(capsys: pytest.CaptureFixture[str]) -> None:
    from varuna.bench.__main__ import main as bench

    assert bench(["planner", "--scale", "--quick", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert [r["gpus"] for r in report["rows"]] == [256, 1024]
    for r in report["rows"]:
        assert r["pipeline"] * r["data"] == r["gpus"] and r["plan_s"] > 0 and r["limited_by"]
        assert r["data"] * r["micro_batch_size"] * r["num_microbatches"] == report["global_batch_size"]
    assert "limited by" in captured.err and "1024" in captured.err


@pytest.mark.parametrize("schedules", [None, ("varuna",)])
def test_nothing_fits_names_the_same_smallest_requirement_fast_or_not(
    schedules: tuple[str, ...] | None,
) -> None:
    """With only Varuna's schedule every pipelined rejection is a lower bound: the message still
    names the exact smallest requirement, simulated."""
    messages = []
    for fast in (True, False):
        with pytest.raises(PlanError, match="nothing fits in 512.0 MiB per device") as info:
            plan(
                varied_table(),
                gpus=8,
                memory_bytes=GiB // 2,
                global_batch_size=32,
                schedules=schedules,  # type: ignore[arg-type]
                fast=fast,
            )
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    if schedules:
        assert "the smallest requirement is 1.0 GiB (P=8, D=1, micro-batch size 1, varuna" in messages[0]


def test_hosts_from_the_profile_or_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = paper_table(PaperGPT(n_layer=8, d_model=1024, seq=512))
    table.network.gpus_per_host, table.network.inter_host_bandwidth_Bps = 4, 1e9
    back = CostTable.load(table.save(tmp_path / "profile.json"))
    assert back.network == table.network
    assert Cluster.from_network(back.network) == Cluster(gpus_per_host=4, inter_bandwidth_Bps=1e9)
    assert Cluster.from_network(back.network, gpus_per_host=8, inter_latency_s=1e-6) == Cluster(
        gpus_per_host=8, inter_bandwidth_Bps=1e9, inter_latency_s=1e-6
    )
    args = ["plan", "--gpus", "16", "--memory", "80GiB", "--global-batch", "64", "--top", "1"]
    assert main([*args, "--profile", str(tmp_path / "profile.json")]) == 0
    out = capsys.readouterr().out
    assert "on 4 hosts of 4" in out
    assert main([*args, "--profile", str(tmp_path / "profile.json"), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["ranked"][0]
    assert out.splitlines()[-1] == (  # the best's shape and placement as `varuna run` takes them
        f"launch the best with: varuna run -p {best['pipeline']} -d {best['data']} --placement "
        f"{best['placement']} --hostfile FILE train.py  (FILE: 4 hosts, 4 slots each)"
    )
    plain = paper_table(PaperGPT(n_layer=8, d_model=1024, seq=512)).save(tmp_path / "plain.json")
    assert main([*args, "--profile", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "hosts of" not in out and "--placement" not in out  # one host: nothing to place
    assert main([*args, "--profile", str(plain), "--inter-host-gbit", "200"]) == 2
    assert "pass --gpus-per-host G" in capsys.readouterr().err
    assert main([*args, "--profile", str(plain), "--gpus-per-host", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="gpus_per_host = -1"):
        NetworkCost(p2p_latency_s=0, p2p_bandwidth_Bps=1, gpus_per_host=-1)


def test_cyclic_placement_deals_ranks_to_hosts_in_turn() -> None:
    """2x2 on two hosts of two: block keeps each pipeline in a host (its stages' all-reduces cross),
    cyclic puts each replica's stages on different hosts (activations cross, all-reduces do not)."""
    net = NetworkCost(p2p_latency_s=5e-6, p2p_bandwidth_Bps=10e9)
    block = Links(net, Cluster(gpus_per_host=2, inter_bandwidth_Bps=1e6), 2, 2)
    cyclic = Links(net, Cluster(gpus_per_host=2, inter_bandwidth_Bps=1e6, placement="cyclic"), 2, 2)
    assert not block.crosses(0) and cyclic.crosses(0)
    assert block.stage_allreduce(0, 2**24) > 10 * cyclic.stage_allreduce(0, 2**24)
    assert cyclic.p2p(0, 2**20) == pytest.approx(20e-6 + 2**20 / 1e6)
    # both replicas' stage 0 sit on the first host and send to the second at once: they share its link
    assert cyclic.sharing(0) == 2 and cyclic.p2p_busy(0, 2**20) == pytest.approx(2 * cyclic.p2p(0, 2**20))
    four = Links(net, Cluster(gpus_per_host=2, inter_bandwidth_Bps=1e6), 4, 1)  # 4x1 block: one crossing
    assert [four.crosses(b) for b in range(3)] == [False, True, False]
    assert four.sharing(1) == 1 and four.p2p_busy(1, 2**20) == four.p2p(1, 2**20)
    assert four.p2p_busy(0, 2**20) == four.p2p(0, 2**20)  # inside a host: the profile's, unshared
    with pytest.raises(PlanError, match=r"placement = 'round-robin': use one of \('block', 'cyclic'\)"):
        Cluster(gpus_per_host=2, placement="round-robin")  # type: ignore[arg-type]


def test_the_plan_across_hosts_follows_the_bandwidth_between_them() -> None:
    """Big gradients and small activations on two hosts of two GPUs: with a fast network between
    hosts pure data parallelism is best; with a slow one a pipeline whose all-reduces stay inside a
    host (cyclic 2x2: its stages' replicas share a host), with the placement in the plan."""
    seg = SegmentCost(
        forward_s={2: 0.01},
        backward_s={2: 0.02},
        activation_bytes={2: 2**16},
        activation_memory_bytes={2: 2**20},
        param_bytes=64 * 2**20,
        grad_bytes=64 * 2**20,
        optimizer_bytes=128 * 2**20,
    )
    points = [(0, 2e-5), (2**30, 2e-5 + 2**30 / 2e10)]
    net = NetworkCost(p2p_latency_s=1e-5, p2p_bandwidth_Bps=2e10, allreduce={2: points, 4: points})
    table = CostTable(model_signature="synthetic", segments=[seg] * 4, network=net, micro_batch_sizes=[2])

    def best(inter_Bps: float) -> tuple[int, int, str | None]:
        cluster = Cluster(gpus_per_host=2, inter_bandwidth_Bps=inter_Bps)
        result = plan(table, gpus=4, memory_bytes="64GiB", global_batch_size=32, cluster=cluster)
        assert {c.placement for c in result.ranked if c.pipeline > 1} == {"block", "cyclic"}
        assert {c.placement for c in result.ranked if c.pipeline == 1} == {"block"}  # the same either way
        top = result.ranked[0]
        return top.pipeline, top.data, top.placement

    assert best(100e9) == (1, 4, "block")
    assert best(1e6) == (2, 2, "cyclic")


def test_the_duplex_factors_travel_from_the_profile_to_each_crossing(tmp_path: Path) -> None:
    """The profile's duplex factors (k streams each way against k alone) reach the cluster unless
    it is given another bandwidth than the one measured, and each crossing takes the factor for the
    replicas sharing it; a boundary inside a host takes none."""
    measured = NetworkCost(
        p2p_latency_s=5e-6,
        p2p_bandwidth_Bps=10e9,
        gpus_per_host=2,
        inter_host_bandwidth_Bps=1e6,
        inter_host_latency_s=20e-6,
        inter_host_duplex={1: 1.1, 2: 1.3},
    )
    cluster = Cluster.from_network(measured)
    assert cluster is not None and cluster.duplex == {1: 1.1, 2: 1.3}
    assert cluster.duplex_factor(2) == 1.3 and cluster.duplex_factor(4) == 1.3  # beyond: the nearest
    # replicas sharing a crossing are slowed at least as much as fewer streams each way measured
    fewer_slower = replace(cluster, duplex={1: 1.4, 2: 1.2, 4: 1.1})
    assert [fewer_slower.duplex_factor(k) for k in (1, 2, 3, 4)] == [1.4, 1.4, 1.4, 1.4]
    assert replace(cluster, duplex={2: 1.2, 4: 1.5}).duplex_factor(3) == pytest.approx(1.35)
    assert Cluster(gpus_per_host=2).duplex_factor(2) == 1.0  # unmeasured: both ways as fast as one
    assert Cluster.from_network(measured, inter_bandwidth_Bps=2e6) == Cluster(
        gpus_per_host=2, inter_bandwidth_Bps=2e6, inter_latency_s=20e-6
    )
    cyclic = Links(measured, replace(cluster, placement="cyclic"), 2, 2)
    four = Links(measured, cluster, 4, 1)
    assert cyclic.duplex(0) == 1.3 and [four.duplex(b) for b in range(3)] == [1.0, 1.1, 1.0]
    assert Links(measured, cluster, 2, 2).duplex(0) == 1.0  # block: each pipeline inside a host
    back = NetworkCost.from_json(json.loads(json.dumps(measured.to_json())))
    assert back == measured
    older = {k: v for k, v in measured.to_json().items() if k != "inter_host_duplex"}  # a profile from before
    assert NetworkCost.from_json(older).inter_host_duplex == {}
    with pytest.raises(ConfigError, match=r"inter_host_duplex\[2\] = 0.0; give streams each way >= 1"):
        NetworkCost(p2p_latency_s=0, p2p_bandwidth_Bps=1, inter_host_duplex={2: 0.0})
    with pytest.raises(PlanError, match=r"duplex\[0\] = 1.2: give streams each way >= 1"):
        Cluster(gpus_per_host=2, duplex={0: 1.2})


def test_a_cross_host_allreduce_follows_the_curve_the_profile_measured_across_the_hosts() -> None:
    """A profile across two hosts of two measured its all-reduces of 4 ranks (one ring over both
    hosts) and of 2 (two groups {0, 2}, {1, 3} at once, each across the hosts) 1.3 times slower
    than the ring model says. The planner takes those curves for the same groups, scales the ring
    model of another group across hosts by the measured ratio of its size, and leaves all-reduces
    inside a host and clusters that are not the measured link as they were."""
    ring4 = 1.5 * 2**24 / 1e6  # 2 (n-1)/n x bytes over the host's link, 2 ranks of the group per host
    ring2 = 1.0 * 2**24 / (1e6 / 2)  # two groups share the host's link
    curves = {4: [(4096, 1e-3), (2**24, 1.3 * ring4)], 2: [(4096, 1e-3), (2**24, 1.3 * ring2)]}
    net = NetworkCost(
        p2p_latency_s=5e-6,
        p2p_bandwidth_Bps=10e9,
        allreduce=curves,
        allreduce_by_world={4: curves, 2: {2: [(4096, 1e-4), (2**24, 2e-3)]}},
        gpus_per_host=2,
        inter_host_bandwidth_Bps=1e6,
        inter_host_latency_s=20e-6,
    )
    cluster = Cluster.from_network(net)
    assert cluster is not None and cluster.measured_allreduce
    plain = replace(cluster, measured_allreduce=False)  # the ring model alone
    assert not Cluster.from_network(net, inter_bandwidth_Bps=2e6).measured_allreduce  # another network
    assert not Cluster.from_network(net, gpus_per_host=4).measured_allreduce  # other hosts
    one_host = replace(net, gpus_per_host=0, inter_host_bandwidth_Bps=0.0, inter_host_latency_s=0.0)
    assert Cluster.from_network(one_host, gpus_per_host=2) == Cluster(gpus_per_host=2)  # measured inside one

    def reduce(c: Cluster, p: int, d: int) -> float:
        return Links(net, c, p, d).stage_allreduce(0, 2**24)

    # the groups the profile measured: its curves, where the ring model is 1.3 times short
    assert reduce(cluster, 1, 4) == pytest.approx(1.3 * ring4) and reduce(plain, 1, 4) == pytest.approx(
        ring4, rel=1e-3
    )
    assert reduce(cluster, 2, 2) == pytest.approx(1.3 * ring2)
    # another group of 4 across hosts (8 ranks on 4 hosts): the ring model times the measured ratio
    assert reduce(cluster, 2, 4) == pytest.approx(reduce(plain, 2, 4) * 1.3, rel=1e-3)
    assert reduce(cluster, 1, 8) == reduce(plain, 1, 8)  # no curve of 8 ranks: the ring model
    cyclic = replace(cluster, placement="cyclic")  # 2x2 cyclic: each stage's replicas share a host
    assert reduce(cyclic, 2, 2) == reduce(replace(cyclic, measured_allreduce=False), 2, 2)


@pytest.mark.parametrize("fast", [True, False])
def test_a_crossing_busy_both_ways_is_stretched_as_far_as_the_other_way_is_busy(fast: bool) -> None:
    """2 x 2 cyclic on two hosts: activations cross one way and gradients the other. Where the link
    carries transfers most of the step, the step grows nearly by the duplex factor; where the
    transfers are a sliver of it, hardly at all; the block placement's pipelines do not cross."""
    net = NetworkCost(p2p_latency_s=1e-6, p2p_bandwidth_Bps=1e10, allreduce={2: [(0, 1e-6)], 4: [(0, 1e-6)]})

    def step(activation_bytes: int, duplex: dict[int, float], placement: Placement = "cyclic") -> float:
        seg = SegmentCost(
            forward_s={1: 0.001},
            backward_s={1: 0.002},
            activation_bytes={1: activation_bytes},
            activation_memory_bytes={1: 2**10},
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=8,
        )
        table = CostTable(model_signature="synthetic", segments=[seg] * 4, network=net, micro_batch_sizes=[1])
        cluster = Cluster(gpus_per_host=2, inter_bandwidth_Bps=1e6, placement=placement, duplex=duplex)
        result = plan(
            table,
            gpus=4,
            memory_bytes="1GiB",
            global_batch_size=16,
            pipelines=[2],
            schedules=["1f1b"],
            recompute_options=(False,),
            cluster=cluster,
            fast=fast,
        )
        (candidate,) = [c for c in result.ranked if c.placement == placement]
        return candidate.predicted_step_s

    factors = {1: 1.2, 2: 1.5}
    saturated = step(2**20, factors) / step(2**20, {})
    assert 1.4 < saturated <= 1.5
    assert 1.0 < step(2**8, factors) / step(2**8, {}) < 1.01
    assert step(2**20, factors, "block") == step(2**20, {}, "block")


def test_hosts_sharing_one_machines_cores_slow_every_replica() -> None:
    """Namespace hosts of one machine (`Cluster.shared_cores`): the busy stages of every replica
    share the cores, not only those of the replicas one host holds, so 1 x 4 on two hosts of two
    computes as slowly as on one host of four."""
    seg = SegmentCost(
        forward_s={1: 0.01},
        backward_s={1: 0.02},
        activation_bytes={1: 2**10},
        activation_memory_bytes={1: 2**10},
        param_bytes=4,
        grad_bytes=4,
        optimizer_bytes=8,
    )
    net = NetworkCost(p2p_latency_s=1e-6, p2p_bandwidth_Bps=1e10, allreduce={2: [(0, 1e-6)], 4: [(0, 1e-6)]})
    table = CostTable(
        model_signature="synthetic",
        segments=[seg] * 4,
        network=net,
        micro_batch_sizes=[1],
        compute_slowdown={1: 1.0, 2: 1.0, 3: 1.5, 4: 2.0},
    )
    assert Cluster(gpus_per_host=2).replicas_sharing_cores(1, 4) == 2
    assert Cluster(gpus_per_host=2, shared_cores=True).replicas_sharing_cores(1, 4) == 4

    def step(cluster: Cluster | None) -> float:
        result = plan(table, gpus=4, memory_bytes="1GiB", global_batch_size=8, pipelines=[1], cluster=cluster)
        return result.ranked[0].predicted_step_s

    apart = step(Cluster(gpus_per_host=2, inter_bandwidth_Bps=1e10, inter_latency_s=1e-6))
    shared = step(Cluster(gpus_per_host=2, inter_bandwidth_Bps=1e10, inter_latency_s=1e-6, shared_cores=True))
    assert shared == pytest.approx(step(None), rel=0.05) and shared > 1.5 * apart
