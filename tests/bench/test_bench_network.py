"""`python -m varuna.bench network --json --quick` across namespace hosts, and the report's pure parts.

Benchmarks never gate: the quick run asserts that every system and shape ran at every rate, where the
ranks ran, that the shaping bites (data parallelism slows on the shaped link) and that the planner
picked a shape of the 4 devices at every rate, never a ratio between systems nor the planner's
targets.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _helpers import run_bench

from varuna.bench.netns import unavailable
from varuna.bench.network import NetworkBench, crossover, expected_hosts, full, placement_of, quick
from varuna.bench.network.planner import judge_point, summarize
from varuna.bench.network.rates import LinkSchedule, wait_rate
from varuna.bench.network.report import label, planner_lines
from varuna.bench.network.worker import network_probe_bytes
from varuna.errors import ConfigError

pytestmark = pytest.mark.foreground

SYSTEMS = {
    ("varuna", "1x4", None),
    ("varuna", "2x2", "replicas-across-hosts"),
    ("varuna", "2x2", "stages-across-hosts"),
    ("varuna", "4x1", None),
    ("ddp", "1x4", None),
    ("torch.pipelining", "4x1", None),
    ("torch.pipelining", "2x2", "stages-across-hosts"),
}


def test_hydra_places_ranks_through_the_hostfile_in_order() -> None:
    assert expected_hosts({"h2": 2, "h3": 2}, 4) == ["h2", "h2", "h3", "h3"]
    assert expected_hosts({"h2": 1, "h3": 1}, 4) == ["h2", "h3", "h2", "h3"]
    assert expected_hosts({"h1": 2, "h2": 1, "h3": 1}, 4) == ["h1", "h1", "h2", "h3"]


def test_the_placement_says_which_dimension_crosses_hosts() -> None:
    assert placement_of(["h2", "h2", "h3", "h3"], 2, 2) == "replicas-across-hosts"
    assert placement_of(["h2", "h3", "h2", "h3"], 2, 2) == "stages-across-hosts"
    assert placement_of(["h2", "h2", "h2", "h3"], 2, 2) == "mixed"
    assert placement_of(["h2", "h2", "h2", "h2"], 2, 2) == "mixed"  # nothing crosses
    assert placement_of(["h2", "h2", "h3", "h3"], 1, 4) is None
    with pytest.raises(ValueError, match="3 hosts for a 2x2 job"):
        placement_of(["h2", "h2", "h3"], 2, 2)


def _point(rate: float | None, dp: float, ddp: float, piped: dict[str, float]) -> dict:
    results = [
        {"system": "varuna", "shape": "1x4", "placement": None, "samples_per_s": dp},
        {"system": "ddp", "shape": "1x4", "placement": None, "samples_per_s": ddp},
    ]
    for shape, value in piped.items():
        results.append({"system": "varuna", "shape": shape, "placement": None, "samples_per_s": value})
    return {"rate_mbit": rate, "results": results}


def test_the_crossover_is_the_highest_rate_where_pipelining_beats_both() -> None:
    points = [
        _point(None, 20.0, 21.0, {"2x2": 18.0, "4x1": 17.0}),
        _point(1000.0, 15.0, 16.0, {"2x2": 15.5, "4x1": 17.0}),  # beats varuna 1x4 and DDP
        _point(200.0, 9.0, 17.5, {"2x2": 12.0, "4x1": 16.0}),  # DDP still ahead here
        _point(50.0, 3.0, 3.0, {"2x2": 5.0, "4x1": 14.0}),
    ]
    found = crossover(points)
    assert found["crossover_mbit"] == 1000.0
    rows = found["crossover"]["by_rate"]
    assert [r["pipelined_wins"] for r in rows] == [False, True, False, True]
    assert rows[1]["best_pipelined"] == "varuna 4x1" and rows[2]["best_data_parallel"] == "ddp 1x4"
    assert rows[3]["pipelined_over_data_parallel"] == pytest.approx(14.0 / 3.0, abs=1e-3)
    assert found["crossover"]["pipelined_wins_unshaped"] is False
    assert crossover(points[:1] + points[2:3])["crossover_mbit"] is None
    # pipelining winning unshaped is said, not taken for a rate
    won = crossover([_point(None, 1.0, 1.0, {"4x1": 2.0})])
    assert won["crossover_mbit"] is None and won["crossover"]["pipelined_wins_unshaped"] is True


def test_a_rates_reading_of_shared_cores_is_held_to_time_sharing_on_one_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The network-profiling job's ranks sit on two namespace hosts of one machine: its reading of
    4 ranks on 2 cores is raised to 4/2 x the reading of 2, as `measure_slowdown` does on one host."""
    import os

    from varuna.bench.network.driver import _rate_sharing

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    sharing = _rate_sharing({"1": 1.0, "2": 1.05, "3": 1.4, "4": 2.3})
    assert sharing == {1: 1.0, 2: 1.05, 3: pytest.approx(1.575), 4: 2.3}  # 4: above the floor, kept
    assert _rate_sharing({"1": 1.0, "2": 1.1, "3": 1.7, "4": 1.9})[4] == pytest.approx(2.2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # cores enough: as read
    assert _rate_sharing({"1": 1.0, "2": 1.1, "3": 1.4, "4": 1.9}) == {1: 1.0, 2: 1.1, 3: 1.4, 4: 1.9}


def test_a_runs_sharing_is_the_median_of_its_rates_readings() -> None:
    """One rate read in a slow moment does not price that rate: each count's median over the rates."""
    from varuna.bench.network.driver import _run_sharing

    readings = [
        {"1": 1.0, "2": 1.09, "4": 2.1},
        {"1": 1.0, "2": 1.23, "4": 2.57},  # a slow moment
        {"1": 1.0, "2": 1.07, "4": 2.06},
        {"1": 1.0, "2": 1.14, "3": 1.67, "4": 2.18},  # a count only one rate read: that reading
    ]
    assert _run_sharing(readings) == {
        "1": 1.0,
        "2": pytest.approx(1.115),
        "3": 1.67,
        "4": pytest.approx(2.14),
    }
    assert _run_sharing([]) is None


def test_the_fast_rates_take_more_timed_steps_in_more_turns() -> None:
    bench = NetworkBench(steps=3, fast_steps=6, fast_from_mbit=200.0, fast_turns=2)
    assert [bench.steps_at(r) for r in (None, 2000.0, 200.0, 50.0, 20.0)] == [6, 6, 6, 3, 3]
    assert [bench.turns_at(r) for r in (None, 2000.0, 200.0, 50.0, 20.0)] == [2, 2, 2, 1, 1]
    assert NetworkBench(steps=3).steps_at(None) == 3  # no fast_steps: the same at every rate
    assert NetworkBench(steps=3).turns_at(None) == 1  # one turn unless asked
    assert quick().steps_at(None) > quick().steps_at(20.0)
    assert full().turns_at(None) == 5 and quick().turns_at(None) == 2 and full().turns_at(50.0) == 1
    assert full().steps_at(None) % full().turns_at(None) == 0  # the same timed steps in every turn


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"global_batch_size": 18},
            r"global_batch_size \(18\) must be a multiple of 4 x micro_batch_size \(2\)",
        ),
        ({"rates": (None, 0.0)}, r"rates \(None, 0.0\) must be Mbit/s > 0"),
        ({"jobs": ("blocks", "nope")}, r"jobs names 'nope'; the jobs are \('blocks', 'alternate'\)"),
        ({"warmup": -1}, r"warmup and turn_warmup must be >= 0 \(got -1, 0\)"),
        ({"turn_warmup": -1}, r"warmup and turn_warmup must be >= 0 \(got 1, -1\)"),
        ({"steps": 0}, r"NetworkBench.steps must be a positive integer"),
        ({"schedule": "varuna"}, r"schedule 'varuna' is not one of \('gpipe', '1f1b', "),
        (
            {"partition": "even"},
            r"partition 'even': use one of 'planner', 'balanced', 'fastest', 'uniform'",
        ),
        ({"profile_repeats": 0}, r"NetworkBench.profile_repeats must be a positive integer"),
        ({"fast_steps": -1}, r"fast_steps must be >= 0 \(got -1; 0: `steps` at every rate\)"),
        ({"fast_from_mbit": 0.0}, r"fast_from_mbit must be Mbit/s > 0 \(got 0.0\)"),
        (
            {"fast_turns": 0},
            r"fast_turns must be >= 1 and at most the timed steps .*got fast_turns 0, fast_steps 3",
        ),
        ({"fast_turns": 4}, r"each turn times at least one \(got fast_turns 4, fast_steps 3, steps 2\)"),
        ({"profile_attempts": 0}, r"NetworkBench.profile_attempts must be a positive integer"),
        ({"sharing_rounds": -1}, r"sharing_rounds must be >= 0 \(got -1; 0: the compute profile's"),
        ({"quiet_wait_s": -1.0}, r"quiet_wait_s \(-1.0\) and max_foreign \(0.15\) must be >= 0"),
        ({"max_foreign": -0.1}, r"quiet_wait_s \(2.0\) and max_foreign \(-0.1\) must be >= 0"),
    ],
)
def test_bad_network_bench_settings_name_the_fix(change: dict, message: str) -> None:
    from dataclasses import asdict

    with pytest.raises(ConfigError, match=message):
        NetworkBench(**(asdict(quick()) | change))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pipeline": 2}, r"torch.pipelining job has 1 ranks but the spec says pipeline=2 x data=1 = 2"),
        (
            {"global_batch_size": 5},
            r"global batch 5 is not a multiple of data x micro_batch_size = 1 x 2",
        ),
    ],
)
def test_a_torch_pipelining_runner_that_does_not_fit_the_job_names_the_fix(
    change: dict, message: str
) -> None:
    from varuna.bench.pipeline.torch_baseline import TorchRunner
    from varuna.comm.rendezvous import init_distributed

    init_distributed()  # a one-process group
    spec = {
        "model": quick().model,
        "pipeline": 1,
        "global_batch_size": 16,
        "micro_batch_size": 2,
        "boundaries_by_schedule": {"1f1b": []},
    }
    with pytest.raises(ConfigError, match=message):
        TorchRunner(spec | change, "1f1b")


def test_a_too_shallow_model_cannot_make_four_stages() -> None:
    model = {
        "vocab_size": 64,
        "seq_len": 8,
        "d_model": 16,
        "n_layer": 1,
        "n_head": 2,
        "cut_inside_blocks": True,
    }
    with pytest.raises(ConfigError, match="the 4x1 shape needs at least 4 pieces to cut; the model has 2"):
        NetworkBench(model=model)


def _candidate(P: int, D: int, placement: str, step_s: float) -> SimpleNamespace:
    return SimpleNamespace(
        pipeline=P,
        data=D,
        placement=placement,
        predicted_step_s=step_s,
        samples_per_s=16 / step_s,
        micro_batch_size=2,
        schedule="1f1b",
        recompute=False,
        boundaries=(0, 1, 2)[: P - 1],
    )


def _ranking(*steps: float) -> SimpleNamespace:
    """A planner's ranking of 4x1 block, 2x2 cyclic, 4x1 cyclic, 2x2 block and 1x4 with these
    predicted steps, in the order of the steps."""
    shapes = [(4, 1, "block"), (2, 2, "cyclic"), (4, 1, "cyclic"), (2, 2, "block"), (1, 4, "block")]
    return SimpleNamespace(
        ranked=sorted((_candidate(*sh, t) for sh, t in zip(shapes, steps)), key=lambda c: c.predicted_step_s)
    )


def _measured(shape: str, placement: str | None, planner_placement: str, step_s: float) -> dict:
    return {
        "system": "varuna",
        "shape": shape,
        "placement": placement,
        "planner_placement": planner_placement,
        "step_s": step_s,
        "samples_per_s": 16 / step_s,
    }


RESULTS = [
    _measured("1x4", None, "block", 0.5),
    _measured("2x2", "replicas-across-hosts", "block", 0.4),
    _measured("4x1", None, "block", 0.25),
    {"system": "ddp", "shape": "1x4", "placement": None, "step_s": 0.1, "samples_per_s": 160.0},
    _measured("2x2", "stages-across-hosts", "cyclic", 0.2),
]
NETWORK = SimpleNamespace(
    gpus_per_host=2,
    inter_host_bandwidth_Bps=2.5e6,
    inter_host_latency_s=1e-4,
    p2p_bandwidth_Bps=1e9,
    p2p_latency_s=5e-5,
    inter_host_duplex={1: 1.2, 2: 1.25},
)


def test_the_pick_is_held_against_the_best_measured_varuna_shape_of_its_placement() -> None:
    ranking = _ranking(0.22, 0.23, 0.3, 0.44, 0.45)  # 4x1 first, then the stages-across-hosts 2x2
    judged = judge_point(ranking, RESULTS, NETWORK)  # type: ignore[arg-type]
    pick = judged["planner"]
    assert pick["shape"] == [4, 1] and pick["placement"] == "block"
    assert pick["measured_as"] == "varuna 4x1"
    # the pick ran at 64 samples/s, the best Varuna shape (2x2 stages apart, not DDP) at 80
    assert judged["planner_vs_best"] == pytest.approx(0.8)
    assert judged["predicted_vs_measured"] == pytest.approx(0.88)
    assert pick["network"]["inter_host_mbit"] == 20.0 and pick["network"]["gpus_per_host"] == 2
    assert pick["network"]["inter_host_duplex"] == {"1": 1.2, "2": 1.25}
    measured = {(x["shape"], x["placement"]): x["measured_as"] for x in pick["predictions"]}
    assert measured == {
        ("4x1", "block"): "varuna 4x1",
        ("2x2", "cyclic"): "varuna 2x2 (stages apart)",
        ("4x1", "cyclic"): None,  # the bench runs no 4x1 with every boundary across the hosts
        ("2x2", "block"): "varuna 2x2 (replicas apart)",
        ("1x4", "block"): "varuna 1x4",
    }
    # a pick the bench did not run is said, not compared
    unmeasured = judge_point(SimpleNamespace(ranked=ranking.ranked[2:]), RESULTS, NETWORK)  # type: ignore[arg-type]
    assert unmeasured["planner_vs_best"] is None and unmeasured["predicted_vs_measured"] is None
    points = [
        {"rate_mbit": None, **judge_point(SimpleNamespace(ranked=ranking.ranked[1:]), RESULTS, NETWORK)},  # type: ignore[arg-type]
        {"rate_mbit": 20.0, **judged},
    ]
    summary = summarize(points)
    assert summary["worst_pick_gap"] == pytest.approx(0.2)
    assert summary["worst_prediction_error"] == pytest.approx(0.15)  # 0.23 / 0.2
    assert summary["worst_prediction_error_any_shape"] == pytest.approx(0.15)
    assert summary["pick_target_met"] is False and summary["prediction_target_met"] is False
    assert summary["unmeasured_picks"] == []
    assert summary["split_half_gap_median"] is None and summary["split_half_gap_worst"] is None  # no steps
    # the measurement's own resolution: over the Varuna results only (DDP's 0.9 is not counted)
    gaps = {"1x4": 0.02, "2x2": 0.08, "4x1": 0.04, "ddp": 0.9}
    gapped = [
        {
            **p,
            "results": [
                r | {"split_half_gap": gaps["ddp" if r["system"] == "ddp" else r["shape"]]} for r in RESULTS
            ],
        }
        for p in points
    ]
    resolved = summarize(gapped)
    assert resolved["split_half_gap_worst"] == pytest.approx(0.08)
    assert resolved["split_half_gap_median"] == pytest.approx(0.06)  # median of 0.02, 0.08, 0.04, 0.08 twice
    with_unmeasured = summarize([*points, {"rate_mbit": 50.0, **unmeasured}])
    assert with_unmeasured["unmeasured_picks"] == [50.0] and with_unmeasured["pick_target_met"] is False
    report = {
        "points": [{**p, "results": RESULTS} for p in points],
        "planner": summary | {"options": {"micro_batch_size": 2, "schedule": "1f1b", "gpus": 4, "hosts": 2}},
    }
    lines = planner_lines(report)
    assert lines[1].startswith("unshaped: picks 2x2 cyclic = varuna 2x2 (stages apart): predicted step")
    assert "pick / best 1.00" in lines[1] and "pick / best 0.80" in lines[2]
    assert lines[-1].startswith("worst pick gap 20.0% (target <= 5.0%: not met)")
    gapped_report = {"points": gapped, "planner": report["planner"] | resolved}
    assert planner_lines(gapped_report)[-1] == (
        "the measurement's own resolution (medians of alternate timed steps of one Varuna result): "
        "median gap 6.0%, worst 8.0%"
    )


def test_each_measured_configuration_is_priced_with_the_compute_of_the_job_that_measured_it() -> None:
    results = [
        {**r, "job": "alternate" if r["placement"] == "stages-across-hosts" else "blocks"} for r in RESULTS
    ]
    # the network-profiling job's ranking picks the stages-across-hosts 2x2; the host was slower
    # while the alternate job measured, and its ranking has another order
    picking = _ranking(0.24, 0.23, 0.3, 0.44, 0.45)
    alternate = _ranking(0.26, 0.25, 0.33, 0.48, 0.49)
    by_job = {"blocks": picking, "alternate": alternate}
    judged = judge_point(picking, results, NETWORK, by_job)  # type: ignore[arg-type]
    pick = judged["planner"]
    # the pick and its claim are the network-profiling job's ranking's
    assert pick["shape"] == [2, 2] and pick["placement"] == "cyclic"
    assert pick["predicted_step_s"] == 0.23 and pick["predicted_samples_per_s"] == round(16 / 0.23, 3)
    # each measured configuration as the ranking of its job prices it, in the pick's ranking's order;
    # the 4x1 cyclic, which no job ran, as the pick's ranking prices it
    rows = [
        (x["shape"], x["placement"], x["predicted_step_s"], x["predicted_vs_measured"])
        for x in pick["predictions"]
    ]
    assert rows == [
        ("2x2", "cyclic", 0.25, 1.25),  # the alternate job's: 0.25 / 0.2
        ("4x1", "block", 0.24, 0.96),
        ("4x1", "cyclic", 0.3, None),
        ("2x2", "block", 0.44, 1.1),
        ("1x4", "block", 0.45, 0.9),
    ]
    assert judged["predicted_vs_measured"] == 1.25
    # without the jobs' rankings every prediction is the pick's ranking's
    assert judge_point(picking, results, NETWORK)["predicted_vs_measured"] == pytest.approx(1.15)  # type: ignore[arg-type]
    lacking = by_job | {"alternate": SimpleNamespace(ranked=alternate.ranked[1:])}  # no 2x2 cyclic
    with pytest.raises(ValueError, match="job 'alternate''s ranking has no 2x2 cyclic configuration"):
        judge_point(picking, results, NETWORK, lacking)  # type: ignore[arg-type]


def test_the_network_profile_sends_about_half_a_second_of_the_rate() -> None:
    assert network_probe_bytes(None) == 4 * 2**20
    assert network_probe_bytes(20.0) == 1_250_000  # half a second at 20 Mbit/s
    assert network_probe_bytes(10.0) == 2**20  # 625 kB would be half a second: at least 1 MiB
    assert network_probe_bytes(2000.0) == 4 * 2**20


def _serve(
    tmp_path: Path, rates: list[float | None], turns: list[int] | None = None
) -> tuple[list[float | None], list[tuple[str, int, float | None, float | None]]]:
    """Two jobs' rank 0 in threads, each asking for every turn in order, served by a LinkSchedule:
    the rates the link was set to, and (job, turn, rate told, the link's rate then) per turn."""
    shaped: list[float | None] = []
    seen: list[tuple[str, int, float | None, float | None]] = []
    folders = {name: tmp_path / name for name in ("a", "b")}
    count = sum(turns) if turns is not None else len(rates)

    def job(name: str) -> None:  # measure in each turn, then ask for the next
        for number in range(count + 1):
            rate = wait_rate(folders[name], number, ask=True, timeout_s=10)
            seen.append((name, number, rate, shaped[-1] if shaped else None))
            time.sleep(0.01)

    for folder in folders.values():
        folder.mkdir()
    threads = {name: threading.Thread(target=job, args=(name,)) for name in folders}
    link = LinkSchedule(rates, shaped.append, turns=turns)
    for name, thread in threads.items():
        thread.start()
        link.ready(folders[name], 0, lambda f: True)
    link.serve(list(folders.values()), lambda f: threads[f.name].is_alive())
    for thread in threads.values():
        thread.join(10)
    return shaped, seen


def test_the_jobs_take_turns_at_each_rate_and_the_link_changes_only_between_rates(tmp_path: Path) -> None:
    rates = [None, 1000.0, 50.0]
    shaped, seen = _serve(tmp_path, rates)
    assert shaped == [1000.0, 50.0, None]  # the link starts unshaped; set once per rate
    order = [(name, index) for name, index, _, _ in seen]
    assert order[:6] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert sorted(order[6:]) == [("a", 3), ("b", 3)]  # told together that they are done
    for _, index, rate, link_rate in seen:  # each measured at the rate the link had
        assert rate == (rates[index] if index < len(rates) else None) == link_rate


def test_with_two_turns_at_a_rate_the_jobs_go_a_b_b_a(tmp_path: Path) -> None:
    shaped, seen = _serve(tmp_path, [None, 1000.0, 50.0], [2, 2, 1])
    assert shaped == [1000.0, 50.0, None]  # still set once per rate, not per turn
    order = [(name, number) for name, number, _, _ in seen]
    assert order[:10] == [
        ("a", 0), ("b", 0), ("b", 1), ("a", 1),  # unshaped: A B, then B A
        ("a", 2), ("b", 2), ("b", 3), ("a", 3),  # 1000 Mbit/s
        ("a", 4), ("b", 4),  # 50 Mbit/s: one turn
    ]  # fmt: skip
    assert sorted(order[10:]) == [("a", 5), ("b", 5)]
    rate_of = [None, None, 1000.0, 1000.0, 50.0, None]
    for _, number, rate, link_rate in seen:
        assert rate == rate_of[number] == link_rate
    with pytest.raises(ConfigError, match=r"turns \[1\]: give one count >= 1 per rate \(2 rates\)"):
        LinkSchedule([None, 20.0], shaped.append, turns=[1])


def test_a_job_that_ends_without_asking_stops_the_bench(tmp_path: Path) -> None:
    link = LinkSchedule([None], lambda rate: None)
    with pytest.raises(RuntimeError, match="the job of .* ended before asking for turn 0"):
        link.ready(tmp_path, 0, lambda folder: False)


def test_a_job_stops_waiting_when_the_bench_never_answers(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="no .*go-0 within 0.1 s: the bench did not start turn 0"):
        wait_rate(tmp_path, 0, ask=True, timeout_s=0.1)
    assert (tmp_path / "want-0").exists()


def test_without_namespace_support_the_bench_says_why_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import varuna.bench.netns as netns
    from varuna.bench.__main__ import main

    monkeypatch.setattr(
        netns, "unavailable", lambda: "namespace hosts need root (ip netns, veth pairs, unshare --uts)"
    )
    assert main(["network", "--quick", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "varuna bench: network: cannot run here: namespace hosts need root (ip netns, veth pairs, unshare --uts)"
    ]


@pytest.mark.multirank
@pytest.mark.multihost
@pytest.mark.timeout(200)
def test_network_bench_quick_measures_every_system_at_every_rate() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    report, _ = run_bench("network", timeout=190)
    try:
        bench = quick()
        assert [p["rate_mbit"] for p in report["points"]] == list(bench.rates)
        assert report["global_batch"] == bench.global_batch_size
        assert report["micro_batch"] == bench.micro_batch_size
        for point in report["points"]:
            seen = {(r["system"], r["shape"], r["placement"]) for r in point["results"]}
            assert seen == SYSTEMS
            # the planner's pick from the network profiled at this rate: 4 devices, the bench's options
            pick = point["planner"]
            P, D = pick["shape"]
            assert P * D == 4 and pick["placement"] in ("block", "cyclic")
            assert pick["predicted_step_s"] > 0 and math.isfinite(pick["predicted_step_s"])
            assert pick["micro_batch_size"] == bench.micro_batch_size and pick["schedule"] == bench.schedule
            assert pick["network"]["gpus_per_host"] == 2 and pick["network"]["inter_host_mbit"] > 0
            assert sorted(pick["network"]["inter_host_duplex"]) == ["1", "2"]  # measured, streams each way
            assert len(pick["predictions"]) == 5  # 1x4, 2x2 and 4x1 in both placements (1x4 in one)
            if point["planner_vs_best"] is not None:
                assert 0 < point["planner_vs_best"] <= 1 and point["predicted_vs_measured"] > 0
            for r in point["results"]:
                assert r["samples_per_s"] > 0 and math.isfinite(r["samples_per_s"])
                assert r["samples_per_s"] == pytest.approx(report["global_batch"] / r["step_s"], rel=1e-3)
                # more timed steps at the fast rates (unshaped here) than at 20 Mbit/s
                assert len(r["timed_step_s"]) == bench.steps_at(point["rate_mbit"]), (point["rate_mbit"], r)
                # in as many turns as the rate gives each job, only the first after a warm-up
                turns = bench.turns_at(point["rate_mbit"])
                assert len(r["turn_step_s"]) == turns and sum(map(len, r["turn_step_s"])) == len(
                    r["timed_step_s"]
                )
                assert len(r["warmup_step_s"]) == bench.warmup + bench.turn_warmup * (turns - 1)
                # its own resolution: the medians of its alternate timed steps
                a, b = statistics.median(r["timed_step_s"][0::2]), statistics.median(r["timed_step_s"][1::2])
                assert r["split_half_gap"] == pytest.approx(abs(a - b) / min(a, b), abs=1e-4)
        # the ranks ran where each placement needs them: each rank's own host name
        placements = report["placements_verified"]
        assert placements["replicas-across-hosts"]["rank_hosts"] == ["h2", "h2", "h3", "h3"]
        assert placements["stages-across-hosts"]["rank_hosts"] == ["h2", "h3", "h2", "h3"]
        assert all(p["verified"] for p in placements.values())
        for point in report["points"]:
            for r in point["results"]:
                job = (
                    "stages-across-hosts"
                    if r["placement"] == "stages-across-hosts"
                    else "replicas-across-hosts"
                )
                assert r["rank_hosts"] == placements[job]["rank_hosts"]
        # the shaping bites: pure data parallelism all-reduces every gradient across the shaped link
        unshaped, shaped = report["points"][0], report["points"][-1]

        def rate(point: dict, system: str) -> float:
            return next(
                r["samples_per_s"] for r in point["results"] if (r["system"], r["shape"]) == (system, "1x4")
            )

        assert rate(shaped, "varuna") < rate(unshaped, "varuna")
        assert rate(shaped, "ddp") < rate(unshaped, "ddp")
        # the shaped link as the planner's profile measured it (one direction's rate, within 15%)
        assert report["points"][-1]["planner"]["network"]["inter_host_mbit"] == pytest.approx(
            bench.rates[-1], rel=0.15
        )
        summary = report["planner"]
        assert summary["points"] == len(bench.rates) and summary["targets"] == {
            "pick_within": 0.05,
            "prediction_within": 0.1,
        }
        assert summary["profile"]["segments"] >= 4 and summary["profile"]["compute_slowdown"]["1"] == 1.0
        # every rate priced with the cores' sharing read beside the steps, the run's median (n = 1
        # is the reference); each point keeps its own reading
        for point in report["points"]:
            sharing = point["planner"]["compute_slowdown"]
            assert point["planner"]["compute_slowdown_from"] == "rates' median"
            assert set(sharing) == {"1", "2", "3", "4"} and sharing["1"] == 1.0
            assert set(point["planner"]["compute_slowdown_at_rate"]) == {"1", "2", "3", "4"}
            assert sharing == report["points"][0]["planner"]["compute_slowdown"]
        # the profile waited for a quiet host: at least one half-second window was measured
        assert summary["profile"]["quiet_wait_s"] >= 0.5 and summary["profile"]["foreign_cores_before"] >= 0
        # ... and measured how busy others kept the host while it ran (run again above max_foreign)
        profile = summary["profile"]
        assert profile["foreign_cores_during"] >= 0 and 1 <= profile["attempts"] <= bench.profile_attempts
        assert (
            profile["attempts"] == bench.profile_attempts
            or profile["foreign_cores_during"] <= bench.max_foreign
        )
        # each point priced with the compute timed beside its steps (the host drifts over a run); a
        # timing ratio, so only its presence is asserted, never its size
        factors = [p["planner"]["compute_factor"] for p in report["points"]]
        for name in bench.jobs:  # timed before a rate's first timed round and after each; their median
            job = json.loads((Path(report["out"]) / f"job-{name}" / "result.json").read_text())
            for rate, at in zip(bench.rates, job["points"], strict=True):
                assert len(at["compute_gauges_s"]) == bench.steps_at(rate) + 1, at["compute_gauges_s"]
                assert at["compute_s"] == pytest.approx(statistics.median(at["compute_gauges_s"]), abs=1e-5)
        assert all(isinstance(f, float) and math.isfinite(f) and f > 0 for f in factors), factors
        # every job timed the compute beside its own steps at every rate, and each measured
        # configuration is priced with the factor of the job that measured it
        ran = {r["job"] for p in report["points"] for r in p["results"]}
        assert ran == set(bench.jobs)
        for point in report["points"]:
            by_job = point["planner"]["compute_factors"]
            assert set(by_job) == ran and by_job["blocks"] == point["planner"]["compute_factor"]
            assert all(isinstance(f, float) and math.isfinite(f) and f > 0 for f in by_job.values()), by_job
            predictions = point["planner"]["predictions"]
            stages = next(r for r in point["results"] if label(r) == "varuna 2x2 (stages apart)")
            cyclic = next(x for x in predictions if (x["shape"], x["placement"]) == ("2x2", "cyclic"))
            assert stages["job"] == "alternate" and cyclic["measured_step_s"] == stages["step_s"]
            for x in predictions:
                if x["measured_step_s"] is not None:  # within the rounding of the report's figures
                    ratio = x["predicted_step_s"] / x["measured_step_s"]
                    assert x["predicted_vs_measured"] == pytest.approx(ratio, abs=2e-3), x
            if point["predicted_vs_measured"] is not None:  # the pick, priced as its prediction is
                assert point["predicted_vs_measured"] == predictions[0]["predicted_vs_measured"]
        assert sorted(summary["planned_cuts"]) == ["2", "4"]
        # every system trains the same model on the same batches: the same losses, step by step
        # within a job (torch.pipelining's 2x2 beside Varuna's: its gradients all-reduced right)
        assert report["first_loss_spread"] < 1e-4
        assert report["loss_spread"] < 1e-4
        assert report["crossover_mbit"] in (None, *bench.rates)
        assert Path(report["plot"]).is_file() and Path(report["plot"]).stat().st_size > 0
    finally:
        out = Path(report["out"])
        if out.name.startswith("bench-network-"):
            shutil.rmtree(out, ignore_errors=True)


@pytest.mark.multirank
@pytest.mark.multihost
@pytest.mark.timeout(180)
def test_network_bench_stopped_by_sigterm_takes_its_hosts_and_jobs_down(tmp_path: Path) -> None:
    """A SIGTERM while the jobs run (a scheduler's limit, `kill`) exits 143 and leaves nothing behind:
    no namespace host of the bench, no process of its jobs."""
    import os
    import signal
    import subprocess
    import sys

    from _helpers import REPO

    from varuna.bench.netns import _namespaces

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    out, log = tmp_path / "run", tmp_path / "bench.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "varuna.bench", "network", "--quick", "--out", str(out)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
    prefix = f"vmh{proc.pid}-"
    try:
        deadline = time.monotonic() + 120
        while not (out / "job-blocks" / "job.log").exists():  # the jobs run, in threads
            assert proc.poll() is None and time.monotonic() < deadline, "the bench never started its jobs"
            time.sleep(0.2)
        assert any(ns.startswith(prefix) for ns in _namespaces())
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text(errors="replace")
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "varuna bench: network: stopped by SIGTERM" in err
    assert not [ns for ns in _namespaces() if ns.startswith(prefix)]
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(out) in cmdline:
            left.append(cmdline.replace("\0", " "))
    assert not left, left
