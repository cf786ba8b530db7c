"""Cutting models into stages: CutPoint order, parameter placement, balancing, and bad input."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from varuna import CutPoint
from varuna.cut.partition import balance, make_partition, profile_segments, trace_model
from varuna.data import SyntheticLM, collate
from varuna.errors import ConfigError, PartitionError
from varuna.models import GPT, gpt_tiny


def gpt_and_batch() -> tuple[GPT, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 8)
    return GPT(cfg), collate([data[i] for i in range(2)])


class Chain(nn.Module):
    """Linear layers with a CutPoint after each; `calls` says which CutPoint each gap calls."""

    def __init__(self, n: int = 4, calls: list[int] | None = None, width: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(n - 1))
        self.calls = calls if calls is not None else list(range(n - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.calls):
                x = self.cuts[self.calls[i]](x)
        return x.sum()


def test_trace_finds_cut_order_and_parameter_segments() -> None:
    model, batch = gpt_and_batch()
    trace = trace_model(model, batch)
    assert trace.cut_names == ["cuts.0", "cuts.1", "cuts.2"]
    assert trace.num_segments == 4
    assert trace.param_segments["blocks.0.attn.qkv.weight"] == {0}
    assert trace.param_segments["blocks.3.mlp.fc.weight"] == {3}
    # the tied embedding is used by the embedding (segment 0) and by the head (segment 3)
    assert trace.param_segments["wte.weight"] == {0, 3}


def test_trace_follows_call_order_not_registration_order() -> None:
    trace = trace_model(Chain(4, calls=[2, 0, 1]), {"x": torch.ones(1, 4)})
    assert trace.cut_names == ["cuts.2", "cuts.0", "cuts.1"]


def test_partition_places_tied_weight_on_both_ends() -> None:
    model, batch = gpt_and_batch()
    part = make_partition(trace_model(model, batch), 2, boundaries=[1])
    assert "wte.weight" in part.stage_params[0] and "wte.weight" in part.stage_params[1]
    assert [g.names for g in part.tied] == [("wte.weight",)]
    assert part.tied[0].stages == (0, 1)
    assert "blocks.2.attn.qkv.weight" in part.stage_params[1]
    assert "blocks.2.attn.qkv.weight" not in part.stage_params[0]
    assert list(part.stage_segments(0)) == [0, 1] and list(part.stage_segments(1)) == [2, 3]
    assert part.start_cut(1) == 1 and part.end_cut(0) == 1 and part.end_cut(1) is None


def test_uneven_split_and_p_not_dividing_segments() -> None:
    model, batch = gpt_and_batch()
    part = make_partition(trace_model(model, batch), 3, boundaries=[0, 1])
    assert [len(part.stage_segments(s)) for s in range(3)] == [1, 1, 2]
    balanced = make_partition(trace_model(model, batch), 3, segment_costs=[1.0, 1.0, 1.0, 1.0])
    assert sum(len(balanced.stage_segments(s)) for s in range(3)) == 4


@pytest.mark.parametrize(
    ("costs", "stages", "expected"),
    [
        ([1, 1, 1, 1], 2, (1,)),
        ([1, 1, 1, 3], 2, (2,)),
        ([3, 1, 1, 1], 2, (0,)),
        ([1, 1, 1, 1, 1, 1], 3, (1, 3)),
        ([5, 1, 1, 1, 1, 1], 3, (0, 2)),
        ([1, 2, 3], 3, (0, 1)),
        ([1, 1, 1, 1], 1, ()),
    ],
)
def test_balance_minimises_the_slowest_stage(
    costs: list[float], stages: int, expected: tuple[int, ...]
) -> None:
    assert balance(costs, stages) == expected


def test_profile_measures_the_heavy_segment_as_heavy() -> None:
    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return self.lin(x)

    model = Chain(4)
    model.layers[2] = Slow()
    costs = profile_segments(
        model, {"x": torch.ones(2, 4)}, repeats=5
    )  # a median that skips a descheduled pass
    assert len(costs) == 4
    assert all(c > 0 for c in costs)
    assert costs[2] > 5 * max(costs[0], costs[1], costs[3])
    assert balance(costs, 2) in ((1,), (2,))


def test_no_cutpoint_with_pipeline_is_an_error() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).sum()

    trace = trace_model(Plain(), {"x": torch.ones(1, 4)})
    with pytest.raises(PartitionError, match=r"pipeline=2 needs CutPoints .* add varuna.CutPoint\(\)"):
        make_partition(trace, 2)


def test_more_stages_than_segments_is_an_error() -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(
        PartitionError, match=r"pipeline=5 is more stages .* 3 CutPoints give 4 segments; use pipeline <= 4"
    ):
        make_partition(trace_model(model, batch), 5)


def test_cutpoint_called_twice_is_an_error() -> None:
    with pytest.raises(
        PartitionError, match=r"CutPoint 'cuts.0' was called twice .* its own CutPoint instance"
    ):
        trace_model(Chain(4, calls=[0, 1, 0]), {"x": torch.ones(1, 4)})


def test_cutpoint_never_called_is_an_error() -> None:
    with pytest.raises(
        PartitionError, match=r"\['cuts.2'\] are registered in the model but were never called"
    ):
        trace_model(Chain(4, calls=[0, 1]), {"x": torch.ones(1, 4)})


def test_unknown_shared_weight_name_is_an_error() -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(
        ConfigError, match=r"'wte.weights', which is not a parameter .* Did you mean \['wte.weight'"
    ):
        make_partition(trace_model(model, batch), 2, shared_weights=[("wte.weights", "ln_f.weight")])
    with pytest.raises(ConfigError, match=r"tuples of two or more parameter names"):
        make_partition(trace_model(model, batch), 2, shared_weights=["wte.weight"])


def test_shared_weights_join_two_parameters() -> None:
    model, batch = gpt_and_batch()
    part = make_partition(
        trace_model(model, batch), 2, boundaries=[1], shared_weights=[("wpe.weight", "ln_f.weight")]
    )
    names = [g.names for g in part.tied]
    assert ("wpe.weight", "ln_f.weight") in names and ("wte.weight",) in names


def test_stage_without_parameters_is_an_error() -> None:
    class Gap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.cuts = nn.ModuleList(CutPoint() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.cuts[0](self.a(x))
            x = self.cuts[1](torch.relu(x))  # a segment of parameter-free code
            return self.b(x).sum()

    trace = trace_model(Gap(), {"x": torch.ones(1, 4)})
    with pytest.raises(
        PartitionError,
        match=r"stage 1 \(segments 1-1, between CutPoints cuts.0 and cuts.1\) holds no parameters",
    ):
        make_partition(trace, 3)


def test_bad_explicit_boundaries() -> None:
    model, batch = gpt_and_batch()
    trace = trace_model(model, batch)
    with pytest.raises(PartitionError, match=r"has 2 boundaries but pipeline=2 needs 1"):
        make_partition(trace, 2, boundaries=[0, 1])
    with pytest.raises(PartitionError, match=r"strictly increasing CutPoint indices in 0..2"):
        make_partition(trace, 3, boundaries=[1, 1])


# The bench GPT's profile (forward + backward seconds of its 16 half-block segments, the last with
# the LM head), measured on the 2-core host.
BENCH_SEGMENTS = [
    0.01399,
    0.01568,
    0.01171,
    0.01546,
    0.01175,
    0.01535,
    0.01133,
    0.01531,
    0.01171,
    0.01516,
    0.01127,
    0.01540,
    0.01178,
    0.01516,
    0.01284,
    0.05077,
]


def test_fastest_cut_is_balanced_where_the_schedule_wants_it_and_moves_where_it_does_not() -> None:
    from varuna.planner.cuts import fit_boundaries, simulated_step

    assert balance(BENCH_SEGMENTS, 2) == (8,)
    # 1F1B's drain is a chain of backwards: its best cut is balance or the next (its stages split
    # their first and last backward, and a split costs more than a whole one)
    assert fit_boundaries(BENCH_SEGMENTS, (8,), "1f1b", 2, 8) in ((8,), (9,))
    # ZB-H1's last stage fills its drain with W; its first stage may take more than half
    fitted = fit_boundaries(BENCH_SEGMENTS, (8,), "zb-h1", 2, 8)
    assert fitted == (9,)
    assert simulated_step(BENCH_SEGMENTS, fitted, "zb-h1", 2, 8) < simulated_step(
        BENCH_SEGMENTS, (8,), "zb-h1", 2, 8
    )
    # Varuna's first stage recomputes every forward: it gets less
    assert fit_boundaries(BENCH_SEGMENTS, (8,), "varuna", 2, 8)[0] < 8
    # started anywhere, the fit never leaves a stage empty and never ends slower than it began
    for start in [(0,), (14,), (0, 1, 2), (12, 13, 14)]:
        name, P = ("1f1b", 2) if len(start) == 1 else ("interleaved-1f1b", 2)
        cut = fit_boundaries(BENCH_SEGMENTS, start, name, P, 8)
        assert list(cut) == sorted(set(cut)) and 0 <= cut[0] and cut[-1] <= len(BENCH_SEGMENTS) - 2
        assert simulated_step(BENCH_SEGMENTS, cut, name, P, 8) <= simulated_step(
            BENCH_SEGMENTS, start, name, P, 8
        )
    assert fit_boundaries(BENCH_SEGMENTS, (0,), "1f1b", 2, 8) != (0,)


def test_fastest_cut_refuses_boundaries_that_do_not_fit() -> None:
    from varuna.planner.cuts import fit_boundaries

    with pytest.raises(
        PartitionError, match=r"got 1 boundaries for 4 stages \(interleaved-1f1b at P=2\); give 3"
    ):
        fit_boundaries(BENCH_SEGMENTS, (8,), "interleaved-1f1b", 2, 8)
    with pytest.raises(PartitionError, match=r"must rise strictly within \[0, 14\]"):
        fit_boundaries(BENCH_SEGMENTS, (9, 8, 12), "interleaved-1f1b", 2, 8)
    with pytest.raises(PartitionError, match=r"must rise strictly"):
        fit_boundaries(BENCH_SEGMENTS, (15,), "1f1b", 2, 8)
