"""Timed orders refitted to measured chunk costs (`varuna.engine.refit`), the cost they read from a
step's spans (`measured_cost`), and which fitted order `zb_v_order` keeps once W's are fused.
The refit inside real engines, trained against plain training, is in tests/multirank/test_transparency.py."""

from __future__ import annotations

import pytest

from varuna.engine.config import VarunaConfig
from varuna.engine.refit import OrderRefit
from varuna.engine.runtime import StepTimes
from varuna.errors import ConfigError
from varuna.planner.timeline import StageCost, measured_cost
from varuna.schedule import Action, Span, build_schedule
from varuna.schedule.chunked import (
    _best_timed,
    _paper_order,
    _timed_list_schedule,
    checked_costs,
    fuse_weights,
    order_span,
)

# The bench GPT's ZB-V chunks at [4, 9, 13] as one pipelined step measured them (ms: F, split B, W,
# whole B): the order fitted to the profile left the first rank waiting 86 ms of the step.
MEASURED = (
    (22.6, 27.9, 21.5, 43.0),
    (25.7, 28.0, 23.0, 44.2),
    (20.1, 23.1, 17.3, 35.0),
    (20.2, 24.4, 17.7, 38.0),
)


def _spans(kind_mb_s: list[tuple[str, int, float]]) -> list[dict]:
    t, out = 0.0, []
    for kind, mb, s in kind_mb_s:
        out.append({"kind": kind, "mb": mb, "start": t, "end": t + s})
        t += s
    return out


def test_measured_cost_reads_split_and_whole_backwards() -> None:
    spans = _spans([("F", 0, 1.0), ("F", 1, 1.0), ("B", 0, 2.0), ("B", 1, 1.3), ("W", 1, 1.0)])
    cost = measured_cost(spans)
    assert cost is not None
    assert cost.order_costs() == pytest.approx((1.0, 1.3, 1.0, 2.0))
    assert measured_cost(_spans([("B", 0, 2.0)])) is None  # no forward: no cost
    # a recomputing stage's F spans ran without autograd: they price its no-grad forward
    cost = measured_cost(_spans([("F", 0, 0.8), ("R", 0, 1.1), ("B", 0, 2.0)]))
    assert cost is not None and cost.seconds("F", recomputes=True) == pytest.approx(0.8)
    assert cost.seconds("R") == pytest.approx(1.1)


def test_every_backward_split_prices_the_whole_one_from_the_shares() -> None:
    spans = _spans([("F", 0, 1.0), ("B", 0, 1.3), ("W", 0, 1.0)])
    summed, shared = measured_cost(spans), measured_cost(spans, unsplit_from_shares=True)
    assert summed is not None and shared is not None
    assert summed.seconds("B") == pytest.approx(2.3)  # a split that costs nothing
    d = StageCost(forward_s=1.0, backward_s=1.0)
    assert shared.seconds("B") == pytest.approx(2.3 / (d.input_share + d.weight_share))
    # the halves stay as measured either way
    assert shared.seconds("B", split=True) == pytest.approx(1.3) and shared.seconds("W") == pytest.approx(1.0)


def test_order_span_times_compute_only() -> None:
    costs = [(1.0, 1.0, 1.0, 2.0), (1.0, 1.0, 1.0, 2.0)]
    lowered = build_schedule("zb-h1", 2, 4, costs=costs)
    assert any(a.kind.startswith(("SEND", "RECV")) for a in lowered[0])  # the messages are free
    assert order_span(lowered, costs) == pytest.approx(13.0)  # 3M + P - 1: 1F1B's 3 x (M + P - 1) = 15
    recomputed = build_schedule("1f1b", 2, 4, recompute=True)
    assert order_span(recomputed, costs) is None


def test_zb_v_keeps_the_order_that_is_shortest_once_fused() -> None:
    """Three fitted orders take equally long with every W (which of them was kept came down to
    rounding); fused, they take 1.099, 1.070 and 1.044 s: the fit keeps the last."""
    costs = checked_costs([tuple(x / 1000 for x in c) for c in MEASURED], 4)
    found = [_timed_list_schedule(2, 8, 4, costs, r, w) for w in (False, True) for r in range(3)]
    paper = [_paper_order(r, 2, 8) for r in range(2)]
    done = [f for f in found if f is not None] + [(paper, order_span(dict(enumerate(paper)), costs))]
    shortest = min(f[1] for f in done)
    tied = [lists for lists, span in done if span == pytest.approx(shortest)]
    fused = [order_span(dict(enumerate(fuse_weights(lists, costs))), costs) for lists in tied]
    assert len(tied) == 3 and max(fused) > 1.05 * min(fused), fused
    assert order_span(dict(enumerate(_best_timed(2, 8, costs))), costs) == pytest.approx(min(fused))


def _config(**kw) -> VarunaConfig:
    return VarunaConfig(pipeline=2, data=1, global_batch_size=16, micro_batch_size=4, **kw)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_refit_after_must_be_a_positive_count_or_none(bad) -> None:
    with pytest.raises(ConfigError, match=r"refit_after must be a positive number of steps, or None"):
        _config(refit_after=bad)


def test_only_timed_orders_in_a_pipeline_refit() -> None:
    def make(cfg: VarunaConfig) -> OrderRefit | None:
        return OrderRefit.create(cfg, lambda v: v, stage=0, chunk_stages=[0], courier=None, device=None)

    assert make(_config(schedule="1f1b")) is None  # its order does not depend on costs
    assert make(_config(schedule="zb-h1", refit_after=None)) is None
    assert make(_config(schedule="zb-h1")) is not None


def test_refit_after_two_steps_builds_the_order_of_the_measured_costs() -> None:
    """One process holding both stages' spans (no all-reduce): nothing before step 3, then the
    order `build_schedule` fits to the costs the spans give, and never again."""
    cfg = _config(schedule="zb-h1")
    profiled = [(1.0, 0.65, 0.5, 1.0), (1.0, 0.65, 0.5, 1.0)]
    current = build_schedule("zb-h1", 2, 4, costs=profiled)
    refit = OrderRefit.create(cfg, lambda v: v, stage=0, chunk_stages=[0, 1], courier=None, device=None)
    assert refit is not None
    spans: list[Span] = []
    t = 0.0
    for v, (f, b) in enumerate([(1.0, 2.0), (3.0, 6.0)]):  # the second stage three times the first
        for m in range(4):
            for kind, s in (("F", f), ("B", b)):
                spans.append(Span(kind, m, t, t + s, v))
                t += s
    last = StepTimes(spans=spans)
    assert refit.before_step(None, current) is None and refit.before_step(last, current) is None
    new = refit.before_step(last, current)  # the third step starts
    assert refit.info is not None and refit.info["step"] == 2
    assert refit.info["costs"] == [pytest.approx((1.0, 1.3, 1.0, 2.0)), pytest.approx((3.0, 3.9, 3.0, 6.0))]
    assert new == build_schedule("zb-h1", 2, 4, costs=refit.info["costs"]) != current
    assert refit.info["refitted_order_s"] <= refit.info["startup_order_s"]
    assert refit.before_step(last, new) is None  # once
    assert all(isinstance(a, Action) for a in new[1])


def test_an_order_no_longer_on_the_measured_costs_stays() -> None:
    """The step already ran the order the measured costs give: nothing changes, the costs are kept."""
    cfg = _config(schedule="zb-h1")
    costs = [(1.0, 1.3, 1.0, 2.0), (1.0, 1.3, 1.0, 2.0)]
    current = build_schedule("zb-h1", 2, 4, costs=costs)
    refit = OrderRefit.create(cfg, lambda v: v, stage=0, chunk_stages=[0, 1], courier=None, device=None)
    assert refit is not None
    spans = [
        Span(kind, m, 0.0, s, v) for v in (0, 1) for m in range(4) for kind, s in (("F", 1.0), ("B", 2.0))
    ]
    last = StepTimes(spans=spans)
    assert refit.before_step(last, current) is None and refit.before_step(last, current) is None
    assert refit.before_step(last, current) is None  # the refit ran and kept the order
    assert refit.info is not None and refit.info["refitted_order_s"] >= refit.info["startup_order_s"]
