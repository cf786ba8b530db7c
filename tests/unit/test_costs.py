"""The cost table: validation, JSON round trips, interpolation of all-reduce times, signatures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from torch import nn

from varuna.errors import ConfigError
from varuna.planner.costs import CostTable, NetworkCost, SegmentCost, model_signature


def segment(**overrides: object) -> SegmentCost:
    fields: dict[str, object] = {
        "forward_s": {1: 0.1, 2: 0.2},
        "backward_s": {1: 0.2, 2: 0.4},
        "activation_bytes": {1: 100, 2: 200},
        "activation_memory_bytes": {1: 1000, 2: 2000},
        "param_bytes": 10,
        "grad_bytes": 10,
        "optimizer_bytes": 20,
    }
    fields.update(overrides)
    return SegmentCost(**fields)  # type: ignore[arg-type]


def table(**overrides: object) -> CostTable:
    fields: dict[str, object] = {
        "model_signature": "abc",
        "segments": [segment(), segment(recompute_s={1: 0.15, 2: 0.3}, nograd_forward_s={1: 0.09, 2: 0.18})],
        "network": NetworkCost(
            p2p_latency_s=1e-4, p2p_bandwidth_Bps=1e9, allreduce={2: [(1000, 0.01), (0, 0.001)]}
        ),
        "micro_batch_sizes": [2, 1],
        "tied_bytes": 8,
    }
    fields.update(overrides)
    return CostTable(**fields)  # type: ignore[arg-type]


def test_json_round_trip_through_a_file(tmp_path: Path) -> None:
    t = table()
    path = t.save(tmp_path / "run" / "profile.json")
    text = json.loads(path.read_text())
    assert text["version"] == 1 and text["segments"][0]["forward_s"] == {"1": 0.1, "2": 0.2}
    back = CostTable.load(path)
    assert back == t
    assert back.micro_batch_sizes == [1, 2]  # sorted on construction
    assert back.segments[1].recompute_at(2) == 0.3 and back.segments[0].recompute_at(2) == 0.2
    assert back.segments[1].nograd_forward_at(2) == 0.18 and back.segments[0].nograd_forward_at(2) == 0.2
    with pytest.raises(
        ConfigError, match=r"nograd_forward_s has micro-batch sizes \[1\] but forward_s has \[1, 2\]"
    ):
        segment(nograd_forward_s={1: 0.09})


def test_load_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no profile at .*run `varuna profile` first"):
        CostTable.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        CostTable.load(bad)
    data = table().to_json()
    del data["segments"]
    with pytest.raises(ConfigError, match="missing the field 'segments'"):
        CostTable.from_json(data)
    data = table().to_json() | {"version": 99}
    with pytest.raises(ConfigError, match="format version 99"):
        CostTable.from_json(data)


def test_validation_messages() -> None:
    with pytest.raises(
        ConfigError, match=r"backward_s has micro-batch sizes \[1\] but forward_s has \[1, 2\]"
    ):
        segment(backward_s={1: 0.2})
    with pytest.raises(ConfigError, match=r"forward_s\[1\] = -1.0"):
        segment(forward_s={1: -1.0, 2: 0.2})
    with pytest.raises(ConfigError, match="param_bytes = -1"):
        segment(param_bytes=-1)
    with pytest.raises(ConfigError, match=r"segment 0 has no costs for micro-batch sizes \[4\]"):
        table(micro_batch_sizes=[1, 4])
    with pytest.raises(ConfigError, match="segments is empty"):
        table(segments=[])
    with pytest.raises(ConfigError, match="repeats a size"):
        table(micro_batch_sizes=[1, 1])
    with pytest.raises(ConfigError, match="p2p_bandwidth_Bps = 0"):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=0)
    with pytest.raises(ConfigError, match="group size 1 must be an integer >= 2"):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, allreduce={1: [(1, 1.0)]})


def test_allreduce_interpolates_and_extrapolates() -> None:
    net = NetworkCost(
        p2p_latency_s=1e-3, p2p_bandwidth_Bps=1e6, allreduce={2: [(0, 1.0), (100, 2.0), (200, 4.0)]}
    )
    assert net.allreduce_time(50, 2) == 1.5
    assert net.allreduce_time(150, 2) == 3.0
    assert net.allreduce_time(300, 2) == 6.0  # the last slope
    assert net.allreduce_time(10**6, 1) == 0.0  # no replicas, nothing to reduce
    # an unmeasured group scales the nearest by the ring traffic factor 2(g-1)/g: (3/2) / 1
    assert net.allreduce_time(100, 4) == pytest.approx(3.0)
    # nothing measured: the ring model over point-to-point
    bare = NetworkCost(p2p_latency_s=1e-3, p2p_bandwidth_Bps=1e6)
    assert bare.allreduce_time(10**6, 2) == pytest.approx(2e-3 + 1.0)
    assert bare.p2p_time(10**6) == pytest.approx(1.001)


def test_model_signature_tracks_names_and_shapes() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    assert model_signature(a) == model_signature(b) == model_signature([("weight", (4, 4)), ("bias", (4,))])
    assert model_signature(a) != model_signature(nn.Linear(4, 5))
    assert len(model_signature(a)) == 16


def test_per_world_allreduce_slowdown_and_update_round_trip(tmp_path: Path) -> None:
    net = NetworkCost(
        p2p_latency_s=1e-4,
        p2p_bandwidth_Bps=1e9,
        allreduce={2: [(0, 1.0), (100, 2.0)]},
        allreduce_by_world={2: {2: [(0, 0.5), (100, 1.0)]}, 4: {2: [(0, 1.0), (100, 2.0)]}},
    )
    assert net.allreduce_time(100, 2, world=2) == 1.0  # a 1 x 2 job reduces alone
    assert net.allreduce_time(100, 2, world=4) == 2.0  # two groups of a 2 x 2 job at once
    assert net.allreduce_time(100, 2) == net.allreduce_time(100, 2, world=8) == 2.0  # the profiled layout
    t = table(
        network=net,
        segments=[segment(update_s=0.25), segment()],
        compute_slowdown={1: 1.0, 2: 1.1, 4: 2.2},
    )
    back = CostTable.load(t.save(tmp_path / "profile.json"))
    assert back == t and back.segments[0].update_s == 0.25 and back.segments[1].update_s == 0.0
    # beyond the 4 ranks measured, a host that was oversubscribed there shares its cores fairly
    assert [t.slowdown(n) for n in (1, 2, 3, 4, 8)] == pytest.approx([1.0, 1.1, 1.65, 2.2, 4.4])
    assert dataclasses.replace(t, compute_slowdown={1: 1.0, 2: 1.0}).slowdown(8) == 1.0  # a core each
    assert table().slowdown(4) == 1.0  # unmeasured: each rank has a device of its own
    # a profile written before these fields existed still loads, with the defaults
    old = t.to_json()
    del old["compute_slowdown"], old["network"]["allreduce_by_world"], old["segments"][0]["update_s"]
    legacy = CostTable.from_json(old)
    assert legacy.compute_slowdown == {} and legacy.network.allreduce_by_world == {}
    assert legacy.segments[0].update_s == 0.0


def test_new_fields_validate() -> None:
    with pytest.raises(ConfigError, match=r"update_s = -1.0; it must be a finite number >= 0"):
        segment(update_s=-1.0)
    with pytest.raises(ConfigError, match=r"compute_slowdown\[2\] = 0.0; give rank counts >= 1"):
        table(compute_slowdown={2: 0.0})
    with pytest.raises(
        ConfigError, match=r"allreduce_by_world\[4\]: group size 3 must be an integer >= 2 dividing"
    ):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, allreduce_by_world={4: {3: [(1, 1.0)]}})
    with pytest.raises(ConfigError, match=r"allreduce_by_world\[2\]\[2\] has no measured points"):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, allreduce_by_world={2: {2: []}})


def test_message_costs_and_the_arrival_report_round_trip(tmp_path: Path) -> None:
    net = NetworkCost(
        p2p_latency_s=1e-4,
        p2p_bandwidth_Bps=1e9,
        message_s={"SEND_F": 3e-4, "RECV_F": 4e-4, "SEND_B": 1e-4, "RECV_B": 5e-5, "DELAY_F": 7e-4},
        reports_arrival=False,
    )
    back = CostTable.load(table(network=net).save(tmp_path / "profile.json"))
    assert back.network == net and back.network.message_s["DELAY_F"] == 7e-4
    legacy = table(network=net).to_json()
    del legacy["network"]["message_s"], legacy["network"]["reports_arrival"]
    old = CostTable.from_json(legacy).network
    assert old.message_s == {} and old.reports_arrival  # an exact transport, no per-message costs
    with pytest.raises(
        ConfigError, match=r"message_s\['SEND_X'\] = 1.0; give seconds >= 0 for the kinds SEND_F"
    ):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, message_s={"SEND_X": 1.0})
    with pytest.raises(ConfigError, match=r"message_s\['RECV_F'\] = -1.0"):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, message_s={"RECV_F": -1.0})


def test_message_cpu_round_trips_and_interpolates_in_bytes(tmp_path: Path) -> None:
    net = NetworkCost(
        p2p_latency_s=1e-4, p2p_bandwidth_Bps=1e9, message_cpu=[(1 << 20, 1.1e-3), (1 << 16, 3e-4)]
    )
    assert net.message_cpu == [(1 << 16, 3e-4), (1 << 20, 1.1e-3)]  # sorted by size
    assert CostTable.load(table(network=net).save(tmp_path / "profile.json")).network == net
    middle = (1 << 16) + ((1 << 20) - (1 << 16)) // 2
    assert net.message_cpu_time(middle) == pytest.approx(7e-4)
    assert net.message_cpu_time(1 << 10) == 3e-4  # below the smallest: that one's
    assert net.message_cpu_time(0) == 0.0
    legacy = table(network=net).to_json()
    del legacy["network"]["message_cpu"]
    assert CostTable.from_json(legacy).network.message_cpu_time(1 << 16) == 0.0  # unmeasured: free
    with pytest.raises(ConfigError, match=r"message_cpu = .*give distinct byte sizes >= 0 with seconds >= 0"):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, message_cpu=[(1024, -1.0)])


def test_delivery_delays_round_trip_and_fall_back_to_the_fixed_delay(tmp_path: Path) -> None:
    delivery = {1: {"F": 1e-3, "B": 2e-4}, 3: {"F": 7e-3, "B": 3e-3}}
    net = NetworkCost(
        p2p_latency_s=1e-4, p2p_bandwidth_Bps=1e9, delivery_s=delivery, message_s={"DELAY_F": 9.0}
    )
    assert CostTable.load(table(network=net).save(tmp_path / "profile.json")).network == net
    assert net.delivery_delay("F", 1) == 1e-3 and net.delivery_delay("B", 3) == 3e-3
    assert net.delivery_delay("F", 2) == pytest.approx(4e-3)  # interpolated in the busy count
    assert net.delivery_delay("F", 8) == 7e-3  # beyond the largest count measured: that one's
    fixed = NetworkCost(p2p_latency_s=1e-4, p2p_bandwidth_Bps=1e9, message_s={"DELAY_F": 9.0})
    assert fixed.delivery_delay("F", 3) == 9.0 and fixed.delivery_delay("B", 3) == 0.0
    with pytest.raises(ConfigError, match=r"delivery_s\[0\] = .*give busy-rank counts >= 1"):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, delivery_s={0: {"F": 0.0, "B": 0.0}})
    with pytest.raises(ConfigError, match=r"delivery_s\[1\] = \{'F': 0.0\}"):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, delivery_s={1: {"F": 0.0}})
    with pytest.raises(ConfigError, match=r"optionally \"SEND_F\" and \"SEND_B\""):
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, delivery_s={1: {"F": 0.0, "B": 0.0, "X": 1.0}})
    sends = {1: {"F": 0.0, "B": 0.0, "SEND_F": 1e-3, "SEND_B": 2e-3}}
    back = NetworkCost.from_json(
        NetworkCost(p2p_latency_s=0.0, p2p_bandwidth_Bps=1.0, delivery_s=sends).to_json()
    )
    assert back.delivery_s == sends


def test_action_overhead_round_trips_validates_and_defaults_to_unmeasured(tmp_path: Path) -> None:
    t = table(action_overhead_s=5e-4)
    assert CostTable.load(t.save(tmp_path / "p.json")).action_overhead_s == 5e-4
    legacy = t.to_json()
    del legacy["action_overhead_s"]
    assert CostTable.from_json(legacy).action_overhead_s == 0.0  # a profile from before: no charge
    for bad in (-1e-3, float("nan")):
        with pytest.raises(ConfigError, match=r"action_overhead_s = .*give seconds >= 0"):
            table(action_overhead_s=bad)
