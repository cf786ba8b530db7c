import pytest

from varuna.errors import ConfigError, ScheduleError
from varuna.planner.simulator import StageCost, simulate
from varuna.telemetry.bubbles import bubble_breakdown, compare_step, timeline_breakdown


def test_bubble_breakdown_hand_made_spans():
    spans = {
        0: [
            {"kind": "F", "start": 0.0, "end": 1.0},
            {"kind": "send", "start": 1.0, "end": 1.5},
            {"kind": "B", "start": 3.0, "end": 5.0},
        ],
        1: [{"kind": "F", "start": 1.0, "end": 2.0}, {"kind": "B", "start": 2.0, "end": 3.0}],
    }
    out = bubble_breakdown(spans, 0.0, 6.0)
    assert out[0] == pytest.approx(
        {"fill_drain_s": 1.0, "comm_wait_s": 2.0, "imbalance_s": 0.0, "busy_s": 3.0, "step_s": 6.0}
    )
    # rank 1: busy 2, fill 1 + drain 3, no idle left inside its window -> imbalance capped at 0
    assert out[1] == pytest.approx(
        {"fill_drain_s": 4.0, "comm_wait_s": 0.0, "imbalance_s": 0.0, "busy_s": 2.0, "step_s": 6.0}
    )
    for r in out.values():
        assert r["busy_s"] + r["fill_drain_s"] + r["comm_wait_s"] + r["imbalance_s"] == pytest.approx(6.0)


def test_bubble_breakdown_imbalance_capped():
    spans = {
        0: [{"kind": "F", "start": 0.0, "end": 4.0}],
        1: [{"kind": "F", "start": 0.0, "end": 1.0}, {"kind": "W", "start": 3.0, "end": 4.0}],
    }
    out = bubble_breakdown(spans, 0.0, 4.0)
    assert out[1]["imbalance_s"] == pytest.approx(2.0)
    assert out[1]["comm_wait_s"] == pytest.approx(0.0)


def test_bubble_breakdown_rejects_empty_step():
    with pytest.raises(ConfigError, match="step_end > step_start"):
        bubble_breakdown({}, 1.0, 1.0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_simulated_1f1b_fill_drain_matches_theory(p, m):
    f, b = 1.0, 2.0
    t = simulate("1f1b", p, m, [StageCost(forward_s=f, backward_s=b, recompute_s=0.0)] * p)
    out = timeline_breakdown(t)
    busy = m * (f + b)
    for s in range(p):
        assert out[s]["busy_s"] == pytest.approx(busy)
        # uniform stages: a 1F1B step is (M + P - 1)(F + B), so each stage idles (P - 1)(F + B) in all;
        # stage s waits s*F before its first F and s*B after its last B (stage 0 ends the step), the rest
        # of the theoretical bubble is the wait for gradients inside its window (comm wait)
        assert out[s]["fill_drain_s"] == pytest.approx(s * (f + b))
        idle = out[s]["fill_drain_s"] + out[s]["comm_wait_s"]
        assert idle == pytest.approx((p - 1) * (f + b))
        assert out[s]["imbalance_s"] == pytest.approx(0.0)


def test_to_events_carries_vstage_for_chunked_schedules():
    t = simulate("interleaved-1f1b", 2, 4, [StageCost(forward_s=1.0, backward_s=2.0)] * 4)
    ev = [e for e in t.to_events() if e["kind"] == "F"]
    assert {e["vstage"] for e in ev} == {0, 1, 2, 3}
    plain = simulate("1f1b", 2, 2, [StageCost(forward_s=1.0, backward_s=2.0)] * 2)
    assert all("vstage" not in e for e in plain.to_events())


# --- compare_step: one measured step beside the simulator's prediction ---------------------------


def spans_of(timeline, shift: float = 100.0) -> dict[int, list[dict]]:
    """A simulated step's compute spans as the recorder sends them: dicts in wall-clock seconds, with
    the virtual stage only where a rank holds several chunks."""
    chunked = any(sp.stage != s for s, spans in enumerate(timeline.spans) for sp in spans)
    return {
        s: [
            {
                "kind": sp.kind,
                "start": shift + sp.start,
                "end": shift + sp.end,
                "mb": sp.microbatch,
                **({"vstage": sp.stage} if chunked else {}),
            }
            for sp in spans
            if sp.kind in ("F", "B", "W", "R")
        ]
        for s, spans in enumerate(timeline.spans)
    }


def idle_parts(part: dict[str, float]) -> float:
    return part["fill_drain_s"] + part["comm_wait_s"] + part["imbalance_s"]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_predicted_uniform_1f1b_equals_theory(p, m):
    t = simulate("1f1b", p, m, [StageCost(forward_s=1.0, backward_s=2.0)] * p, split_backward=False)
    out = compare_step(spans_of(t), "1f1b", p, m)
    predicted = sum(idle_parts(v) / v["step_s"] for v in out.predicted.values()) / p
    assert predicted == pytest.approx(out.theory, abs=1e-9)
    assert out.theory == pytest.approx((p - 1) / (m + p - 1))


def test_measured_parts_add_up_to_the_idle_share_and_transfers_show_as_comm_wait():
    # a "measured" step with 0.5 s transfers on the boundary; the prediction assumes free transfers
    t = simulate(
        "1f1b", 2, 4, [StageCost(forward_s=1.0, backward_s=2.0)] * 2, comm=[0.5], split_backward=False
    )
    out = compare_step(spans_of(t), "1f1b", 2, 4, step=7)
    for s, part in out.measured.items():
        assert part["step_s"] == pytest.approx(t.step_s)
        assert idle_parts(part) / part["step_s"] == pytest.approx(1 - part["busy_s"] / part["step_s"])
        assert part["comm_wait_s"] >= out.predicted[s]["comm_wait_s"]
    assert out.measured[0]["comm_wait_s"] > out.predicted[0]["comm_wait_s"] + 0.5
    assert out.step == 7 and [c.forward_s for c in out.costs] == [1.0, 1.0]


@pytest.mark.parametrize(
    "schedule,p,m",
    [
        ("1f1b", 3, 5),
        ("varuna", 2, 4),
        ("gpipe", 2, 3),
        ("zb-h1", 3, 4),
        ("interleaved-1f1b", 2, 4),
        ("zb-v", 2, 4),
    ],
)
def test_prediction_from_a_simulated_step_reproduces_it(schedule, p, m):
    # the engine's default split backward (W) and Varuna's recompute (R) are read back from the spans
    chunks = 2 if schedule in ("interleaved-1f1b", "zb-v") else 1
    costs = [StageCost(forward_s=1.0 + 0.25 * v, backward_s=2.0, recompute_s=0.75) for v in range(p * chunks)]
    t = simulate(schedule, p, m, costs, split_backward=True)
    out = compare_step(spans_of(t), schedule, p, m)
    for s in range(p):
        assert out.predicted[s] == pytest.approx(out.measured[s], abs=1e-9), s


def test_compare_step_errors_name_the_fix():
    good = {0: [{"kind": "F", "start": 0, "end": 1}, {"kind": "B", "start": 1, "end": 3}]}
    with pytest.raises(ConfigError, match="no compute spans"):
        compare_step({0: [{"kind": "send", "start": 0, "end": 1}]}, "1f1b", 1, 1)
    with pytest.raises(ConfigError, match=r"stages 0\.\.1 \(pipeline=2\), got stages \[0\]"):
        compare_step(good, "1f1b", 2, 1)
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; choose one of"):
        compare_step(good, "nope", 1, 1)
    with pytest.raises(ConfigError, match="cover no time"):
        compare_step(
            {0: [{"kind": "F", "start": 2, "end": 2}, {"kind": "B", "start": 2, "end": 2}]}, "1f1b", 1, 1
        )
    with pytest.raises(ConfigError, match="virtual stage 0 has no B span"):
        compare_step({0: [{"kind": "F", "start": 0, "end": 1}]}, "1f1b", 1, 1)
    with pytest.raises(ConfigError, match="2 chunks per rank .* names no vstage"):
        compare_step(good, "interleaved-1f1b", 1, 2)
