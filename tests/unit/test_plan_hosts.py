"""Planning with measured per-host speeds (varuna/planner/hosts.py) on synthetic cost tables."""

from __future__ import annotations

import pytest
from test_plan import GiB, uniform_table

from varuna.errors import ConfigError
from varuna.planner.hosts import host_speeds, plan_for_hosts, scale_compute
from varuna.planner.search import plan


def test_speeds_are_measured_against_each_stages_peers() -> None:
    events = [
        {"type": "hello", "rank": r, "host": h, "job": "j"} for r, h in enumerate(["a", "b", "c", "d"])
    ] + [
        {"type": "step_metrics", "rank": r, "stage": r % 2, "step": s, "compute_s": t, "job": "j"}
        for s in range(3)
        for r, t in enumerate([0.1, 0.2, 0.1, 0.5])
    ]
    # P=2, D=2: d (stage 1) takes 0.5 s where its peer b takes 0.2 s
    assert host_speeds(events) == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.4}


def test_scaling_multiplies_compute_only() -> None:
    table = uniform_table()
    slow = scale_compute(table, 2.0)
    assert slow.segments[0].forward_s[1] == 2 * table.segments[0].forward_s[1]
    assert slow.segments[0].param_bytes == table.segments[0].param_bytes
    with pytest.raises(ConfigError, match="must be > 0"):
        scale_compute(table, 0.0)


def test_a_slow_host_is_left_out_when_the_rest_is_faster_without_it() -> None:
    table = uniform_table()
    args = {"memory_bytes": 8 * GiB, "global_batch_size": 32}
    slots = {"h1": 2, "h2": 2, "h3": 2, "h4": 2}
    chosen = plan_for_hosts(table, slots, {"h4": 0.25}, **args)
    assert (chosen.hosts, chosen.excluded, chosen.slowest_speed) == (["h1", "h2", "h3"], ["h4"], 1.0)
    everyone = plan(scale_compute(table, 4.0), gpus=8, **args).best.predicted_step_s
    assert chosen.predicted_step_s < everyone
    # a host barely slower is worth its devices
    assert plan_for_hosts(table, slots, {"h4": 0.95}, **args).excluded == []
    with pytest.raises(ConfigError, match="host speeds must be > 0"):
        plan_for_hosts(table, slots, {"h4": 0.0}, **args)
