"""Schedules with two chunks per rank (interleaved-1f1b, zb-v): placement, orders, theory against the
simulator, and the engine running both chunks of a one-rank pipeline (hand-offs on the rank)."""

from __future__ import annotations

import pytest
import torch

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.errors import ScheduleError
from varuna.models import GPT, gpt_tiny
from varuna.planner.simulator import StageCost, simulate
from varuna.schedule import SCHEDULES, bubble_fraction, build_schedule, schedule_spec, validate
from varuna.schedule.chunked import rank_of, stages_of

CHUNKED = [n for n, s in SCHEDULES.items() if s.chunks_per_rank > 1]


def test_placements() -> None:
    assert [stages_of(r, 4, 2, "loop") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert schedule_spec("zb-v").stages_of(0, 2) == [0, 3]
    with pytest.raises(
        ScheduleError, match=r"virtual stage 8 does not exist: 4 ranks x 2 chunks have stages 0..7"
    ):
        rank_of(8, 4, 2)


def test_interleaved_needs_whole_rounds() -> None:
    with pytest.raises(ScheduleError, match=r"multiple of 3 \(given 4\); choose global_batch_size"):
        build_schedule("interleaved-1f1b", 3, 4)


def test_validate_rejects_an_action_on_the_wrong_rank() -> None:
    schedule = build_schedule("zb-v", 2, 2)
    moved = {0: [a._replace(stage=2) if a.stage == 3 else a for a in schedule[0]], 1: schedule[1]}
    with pytest.raises(ScheduleError, match=r"names stage 2 \(0 holds virtual stages 0, 3 of 4\)"):
        validate(moved, 2, 2, chunks=2, placement="v")


@pytest.mark.parametrize(("P", "M"), [(2, 4), (2, 8), (4, 8), (4, 16), (3, 6)])
def test_theory_bubble_is_the_simulated_one(P: int, M: int) -> None:
    """Uniform chunks, free communication: interleaved with F=1, B=2; zb-v with F=B=W=1."""
    for name in CHUNKED:
        spec = schedule_spec(name)
        cost = StageCost(forward_s=1, backward_s=2, input_share=0.5, weight_share=0.5)
        split = name == "zb-v"
        t = simulate(name, P, M, [cost] * (P * spec.chunks_per_rank), split_backward=split)  # type: ignore[arg-type]
        if name == "interleaved-1f1b":
            assert t.bubble_fraction == pytest.approx(bubble_fraction(name, P, M))  # type: ignore[arg-type]
        else:  # zb-v's whole backward on stage 0 takes 2: the unit-cost timeline's own length
            assert t.bubble_fraction == pytest.approx(bubble_fraction(name, P, M), abs=1e-9)  # type: ignore[arg-type]
        assert bubble_fraction(name, P, M) < bubble_fraction("zb-h1", P, M) or name == "interleaved-1f1b"  # type: ignore[arg-type]
        assert bubble_fraction(name, P, M) < bubble_fraction("1f1b", P, M)  # type: ignore[arg-type]


@pytest.mark.parametrize(("P", "M"), [(2, 8), (4, 8), (4, 16)])
def test_zb_v_holds_no_more_than_1f1b(P: int, M: int) -> None:
    """1F1B's first stage holds P micro-batches of a whole stage: 2P chunk-activations here."""
    cost = StageCost(forward_s=1, backward_s=2, input_share=0.5, weight_share=0.5)
    t = simulate("zb-v", P, M, [cost] * (2 * P))
    assert max(t.peak_inflight) <= 2 * P


@pytest.mark.parametrize("name", CHUNKED)
def test_one_rank_two_chunks_trains_like_plain(name: str) -> None:
    """P=1: both chunks on this rank, handed over locally. Each block runs once per micro-batch (a
    chunk's forward skips the other chunk's modules), and the step equals plain training."""
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    batch = collate([data[i] for i in range(8)])
    plain = GPT(cfg)
    model = GPT(cfg)
    model.load_state_dict(plain.state_dict())
    engine = Varuna(
        model, pipeline=1, global_batch_size=8, micro_batch_size=2, schedule=name, example_batch=batch
    )
    assert engine.chunk_stages == [0, 1]
    calls: list[int] = []
    first_linear = next(m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_hook(lambda *_: calls.append(1))
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    loss = engine.step(batch)
    assert len(calls) == engine.config.num_microbatches  # not twice: chunk 1 skipped block 0
    ref = plain(**batch)
    ref.backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    reference = dict(plain.named_parameters())
    for n, p in engine.named_parameters():
        torch.testing.assert_close(p, reference[n], rtol=1e-5, atol=1e-7)
    engine.close()


def test_resize_keeps_a_shape_the_chunked_schedule_runs() -> None:
    """`varuna resize --gpus N` without a profile: P x 2 chunks must fit the segments, and
    interleaved-1f1b needs M a multiple of P."""
    from varuna.elastic.protocol import Shape
    from varuna.elastic.reshape import choose_shape
    from varuna.errors import ConfigError

    info = {"global_batch_size": 24, "micro_batch_size": 2, "num_segments": 6, "pipeline": 4}
    assert choose_shape(4, info | {"schedule": "1f1b"}) == Shape(4, 1)
    assert choose_shape(4, info | {"schedule": "zb-v"}) == Shape(2, 2)  # 4 ranks x 2 chunks > 6 segments
    small = {"global_batch_size": 6, "micro_batch_size": 2, "num_segments": 8, "pipeline": 2}
    assert choose_shape(2, small | {"schedule": "1f1b"}) == Shape(2, 1)
    with pytest.raises(ConfigError, match=r"at most 8 stages \(2 chunks per rank for interleaved-1f1b\)"):
        choose_shape(2, small | {"schedule": "interleaved-1f1b"})  # M = 3 is no whole round of P = 2


def test_chunks_are_balanced_per_rank() -> None:
    """Two chunks per rank: the boundaries balance the ranks' loads, not only the stages'."""
    import random

    from varuna.cut.partition import balance, balance_ranks

    def rank_loads(costs: list[float], bounds: tuple[int, ...], owners: list[int]) -> list[float]:
        edges = (0, *(b + 1 for b in bounds), len(costs))
        loads = [0.0] * (max(owners) + 1)
        for v, owner in enumerate(owners):
            loads[owner] += sum(costs[edges[v] : edges[v + 1]])
        return loads

    v_shape, loop = [0, 1, 1, 0], [0, 1, 0, 1]
    assert balance([1, 3, 1, 1, 1, 1], 4) == (0, 1, 3)  # stages balanced: rank loads 3 and 5
    assert rank_loads([1, 3, 1, 1, 1, 1], balance_ranks([1, 3, 1, 1, 1, 1], v_shape), v_shape) == [4, 4]
    rng = random.Random(3)
    for _ in range(200):
        costs = [float(rng.randint(1, 5)) for _ in range(rng.randint(4, 9))]
        for owners in (v_shape, loop):
            best = max(rank_loads(costs, balance_ranks(costs, owners), owners))
            assert best <= max(rank_loads(costs, balance(costs, 4), owners))
