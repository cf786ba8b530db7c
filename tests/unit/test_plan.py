"""The planner on synthetic cost tables: ranking, memory, rejections, errors and `varuna plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from varuna.cli import main
from varuna.planner.costs import CostTable, NetworkCost, SegmentCost
from varuna.planner.search import Candidate, PlanError, PlanResult, format_bytes, parse_memory, plan, predict
from varuna.planner.simulator import StageCost, simulate
from varuna.schedule import SCHEDULES

GiB = 2**30


def uniform_table(
    segments: int = 8,
    *,
    sizes: tuple[int, ...] = (1, 2, 4),
    param_bytes: int = 100 * 2**20,
    activation_memory: int = 10 * 2**20,
    boundary_bytes: int = 2**20,
    bandwidth: float = 1e10,
    allreduce_Bps: float = 1e10,
    tied_bytes: int = 0,
) -> CostTable:
    """Identical segments; a micro-batch of n costs (1 + n) ms forward, twice that backward."""
    seg = SegmentCost(
        forward_s={n: (1 + n) * 1e-3 for n in sizes},
        backward_s={n: 2 * (1 + n) * 1e-3 for n in sizes},
        activation_bytes={n: n * boundary_bytes for n in sizes},
        activation_memory_bytes={n: n * activation_memory for n in sizes},
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=2 * param_bytes,
    )
    points = [(0, 1e-5), (2**30, 1e-5 + 2**30 / allreduce_Bps)]
    return CostTable(
        model_signature="synthetic",
        segments=[seg] * segments,
        network=NetworkCost(
            p2p_latency_s=1e-5, p2p_bandwidth_Bps=bandwidth, allreduce={g: points for g in (2, 4, 8)}
        ),
        micro_batch_sizes=list(sizes),
        tied_bytes=tied_bytes,
    )


def test_best_is_first_and_ranked_by_predicted_step() -> None:
    result = plan(uniform_table(), gpus=4, memory_bytes=64 * GiB, global_batch_size=32)
    steps = [c.predicted_step_s for c in result.ranked]
    assert steps == sorted(steps) and result.best is result.ranked[0]
    for c in result.ranked:
        assert c.pipeline * c.data == 4
        assert c.num_microbatches * c.data * c.micro_batch_size == 32
        assert c.samples_per_s == pytest.approx(32 / c.predicted_step_s)
        assert c.timeline.step_s == c.predicted_step_s and len(c.memory_per_stage_bytes) == c.pipeline


def test_schedules_that_run_the_same_actions_are_one_candidate() -> None:
    """At P=1 1F1B, Varuna's schedule and ZB-H1 are all F B per micro-batch: one candidate, under
    the first name given; GPipe (all forwards first) stays apart, and at P=2 all differ. Varuna's
    schedule is eager-1f1b recomputing: each setting is listed under the schedule it is its own."""
    result = plan(
        uniform_table(), gpus=2, memory_bytes=64 * GiB, global_batch_size=32, micro_batch_sizes=(2,)
    )
    at = {(c.pipeline, c.schedule, c.recompute) for c in result.ranked}
    assert {(1, "gpipe", False), (1, "1f1b", False)} == {k for k in at if k[0] == 1}
    assert set(SCHEDULES) == {k[1] for k in at if k[0] == 2}
    assert {(2, "eager-1f1b", False), (2, "varuna", True)} <= at
    assert not {(2, "eager-1f1b", True), (2, "varuna", False)} & at
    # two chunks on one rank would only add hand-offs: ruled out at P=1, with the reason
    assert {r.schedule for r in result.rejected if r.pipeline == 1} == {"interleaved-1f1b", "zb-v"}
    flipped = plan(
        uniform_table(),
        gpus=2,
        memory_bytes=64 * GiB,
        global_batch_size=32,
        micro_batch_sizes=(2,),
        schedules=("varuna", "1f1b"),
        pipelines=(1,),
    )
    assert [(c.schedule, c.recompute) for c in flipped.ranked] == [("varuna", False)]


def test_more_stages_are_not_always_better() -> None:
    # a fast all-reduce: pure data parallelism has no bubble and wins
    cheap = plan(uniform_table(allreduce_Bps=1e12), gpus=4, memory_bytes=64 * GiB, global_batch_size=32)
    assert (cheap.best.pipeline, cheap.best.data) == (1, 4)
    # big gradients over a slow all-reduce: a deeper pipeline reduces less per device and wins
    slow = plan(uniform_table(allreduce_Bps=1e8), gpus=4, memory_bytes=64 * GiB, global_batch_size=32)
    assert slow.best.pipeline == 4


def test_candidate_matches_a_hand_simulation() -> None:
    table = uniform_table(boundary_bytes=0)
    result = plan(table, gpus=2, memory_bytes=64 * GiB, global_batch_size=8, schedules=("gpipe",))
    c = next(c for c in result.ranked if (c.pipeline, c.micro_batch_size) == (2, 2))
    assert c.boundaries == (3,)  # 4 + 4 segments
    assert c.num_microbatches == 4 and not c.recompute
    stage = StageCost(forward_s=4 * 3e-3, backward_s=4 * 6e-3, recompute_s=4 * 3e-3)
    net = table.network
    expected = simulate(
        "gpipe",
        2,
        4,
        [stage, stage],
        comm=[net.p2p_time(0)],
        final_allreduce_s=net.allreduce_time(64, 2),
        split_backward=True,  # as the engine runs it by default
    )
    assert c.predicted_step_s == pytest.approx(expected.step_s)
    # 4 segments of 400 MiB static state + GPipe holds all 4 micro-batches of 4 x 20 MiB, and the
    # second stage's split backward one more
    static, micro = 4 * 400 * 2**20, 4 * 20 * 2**20
    assert c.memory_per_stage_bytes == [static + 4 * micro, static + 5 * micro]


def test_memory_per_stage_follows_the_schedule() -> None:
    table = uniform_table(segments=4, param_bytes=0, activation_memory=2**20, boundary_bytes=2**10)
    kw = {"gpus": 4, "memory_bytes": 64 * GiB, "global_batch_size": 8, "recompute_options": (False, True)}
    result = plan(table, **kw)  # type: ignore[arg-type]

    def mem(schedule: str, recompute: bool) -> list[int]:
        (c,) = [
            c
            for c in result.ranked
            if (c.pipeline, c.micro_batch_size, c.schedule, c.recompute) == (4, 1, schedule, recompute)
        ]
        return c.memory_per_stage_bytes

    # M = 8 micro-batches of 1 MiB each; stages after the first split a backward: one more
    assert mem("gpipe", False) == [8 * 2**20] + [9 * 2**20] * 3
    assert mem("1f1b", False) == [4 * 2**20, 4 * 2**20, 3 * 2**20, 2 * 2**20]  # min(P - s, M) (+ 1)
    # recompute keeps only the stage inputs (1 KiB each) plus one micro-batch; the last stage keeps all
    assert mem("1f1b", True) == [2**20, 3 * 2**10 + 2 * 2**20, 2 * 2**10 + 2 * 2**20, 2 * 2**20]


def test_memory_limit_forces_recompute_and_deeper_pipelines() -> None:
    # 8 x 400 MiB of weights and state: P=1 needs 3.1 GiB before any activation
    table = uniform_table(activation_memory=256 * 2**20)
    result = plan(table, gpus=4, memory_bytes=2 * GiB, global_batch_size=32)
    assert result.ranked and all(c.pipeline >= 2 for c in result.ranked)
    assert all(c.max_memory_bytes <= 2 * GiB for c in result.ranked)
    reasons = {r.reason for r in result.rejected if r.kind == "memory"}
    assert any(r.startswith("out of memory: stage 0 needs") and r.endswith("> 2.0 GiB") for r in reasons)
    tight = plan(table, gpus=4, memory_bytes=int(2.2 * GiB), global_batch_size=8)
    assert tight.ranked and all(c.recompute and c.pipeline == 4 for c in tight.ranked)
    # with room to spare recompute only costs time, so the best does without
    assert not plan(table, gpus=4, memory_bytes=64 * GiB, global_batch_size=8).best.recompute


def test_every_rejection_reason_appears() -> None:
    result = plan(uniform_table(segments=4, sizes=(1, 4)), gpus=8, memory_bytes=4 * GiB, global_batch_size=12)
    by_kind = {r.kind: r.reason for r in result.rejected}
    assert by_kind["stages"] == "P=8 > 4 segments (add CutPoints to cut the model finer)"
    assert "global batch 12 not divisible by D x mbs = 8 x 1" in {r.reason for r in result.rejected}
    assert "global batch 12 not divisible by D x mbs = 2 x 4" in {r.reason for r in result.rejected}
    text = result.format(top=3)
    assert "too many stages" in text and "batch" in text and "best first" in text
    assert json.loads(json.dumps(result.to_json(top=2)))["rejected"][0]["kind"] in (
        "batch",
        "stages",
        "memory",
    )


def test_any_pipeline_depth_not_only_divisors_of_the_segment_count() -> None:
    result = plan(uniform_table(segments=8), gpus=3, memory_bytes=64 * GiB, global_batch_size=6)
    c = next(c for c in result.ranked if c.pipeline == 3 and len(c.boundaries) == 2)
    sizes = [len(r) for r in (range(0, c.boundaries[0] + 1), range(c.boundaries[0] + 1, c.boundaries[1] + 1))]
    assert sorted([*sizes, 8 - sum(sizes)]) == [2, 3, 3]


def test_tied_weights_cost_the_last_stage_memory_and_an_allreduce() -> None:
    base = plan(
        uniform_table(segments=2), gpus=2, memory_bytes=64 * GiB, global_batch_size=4, schedules=("1f1b",)
    )
    tied = plan(
        uniform_table(segments=2, tied_bytes=2**20),
        gpus=2,
        memory_bytes=64 * GiB,
        global_batch_size=4,
        schedules=("1f1b",),
    )

    def pick(result: PlanResult) -> Candidate:
        return next(c for c in result.ranked if c.pipeline == 2 and c.micro_batch_size == 1)

    b, t = pick(base), pick(tied)
    assert t.memory_per_stage_bytes[0] == b.memory_per_stage_bytes[0]
    assert t.memory_per_stage_bytes[1] == b.memory_per_stage_bytes[1] + 4 * 2**20
    assert t.timeline.allreduce_s[0] > 0 == b.timeline.allreduce_s[0]


def test_errors_teach_the_fix() -> None:
    table = uniform_table()
    with pytest.raises(PlanError, match="zero GPUs: gpus must be at least 1, got 0"):
        plan(table, gpus=0, memory_bytes=GiB, global_batch_size=8)
    with pytest.raises(PlanError, match="a profile from another model.*re-run `varuna profile`"):
        plan(table, gpus=2, memory_bytes=GiB, global_batch_size=8, model_signature="other")
    with pytest.raises(
        PlanError, match=r"nothing fits in 1.0 GiB per device: the smallest requirement is 1.\d GiB"
    ):
        plan(table, gpus=2, memory_bytes=GiB, global_batch_size=8)
    with pytest.raises(PlanError, match="raise --memory to at least that"):
        plan(table, gpus=2, memory_bytes=GiB, global_batch_size=8)
    with pytest.raises(PlanError, match="no configuration for 4 GPUs and global batch 3"):
        plan(uniform_table(sizes=(2, 4)), gpus=4, memory_bytes=64 * GiB, global_batch_size=3)
    with pytest.raises(PlanError, match="unknown schedules"):
        plan(table, gpus=2, memory_bytes=GiB, global_batch_size=8, schedules=("zb",))  # type: ignore[arg-type]
    assert issubclass(PlanError, ValueError)


def test_parse_memory() -> None:
    assert parse_memory("16GiB") == 16 * GiB
    assert parse_memory("80 GB") == 80 * 10**9
    assert parse_memory("1.5MiB") == 3 * 2**19
    assert parse_memory("512mb") == 512 * 10**6
    assert parse_memory("2G") == 2 * GiB
    assert parse_memory("4096") == parse_memory("4KiB") == parse_memory(4096) == 4096
    with pytest.raises(PlanError, match="cannot read the memory size '16 gigs'.*e.g. 16GiB"):
        parse_memory("16 gigs")
    with pytest.raises(PlanError, match="cannot read the memory size ''"):
        parse_memory("")
    with pytest.raises(PlanError, match="more than 0 bytes"):
        parse_memory("0GiB")
    assert format_bytes(17.2 * GiB) == "17.2 GiB" and format_bytes(80) == "80 B"


def test_cli_plan_prints_the_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = uniform_table().save(tmp_path / "profile.json")
    args = ["plan", "--gpus", "4", "--memory", "2GiB", "--profile", str(path), "--global-batch", "32"]
    assert main([*args, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "best first" in out and "rejected" in out
    assert main([*args, "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 2 and data["gpus"] == 4 and data["ranked"][0]["pipeline"] >= 2


def test_cli_plan_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = uniform_table().save(tmp_path / "profile.json")
    base = ["plan", "--profile", str(path), "--global-batch", "32"]
    assert main([*base, "--gpus", "0", "--memory", "16GiB"]) == 2
    assert "varuna: error: zero GPUs" in capsys.readouterr().err
    assert main([*base, "--gpus", "2", "--memory", "lots"]) == 2
    assert "varuna: error: cannot read the memory size 'lots'" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                "--gpus",
                "2",
                "--memory",
                "1GiB",
                "--profile",
                str(tmp_path / "x.json"),
                "--global-batch",
                "8",
            ]
        )
        == 2
    )
    assert "varuna: error: no profile at" in capsys.readouterr().err


def test_shared_cores_and_the_update_enter_the_prediction() -> None:
    import dataclasses

    base = uniform_table(segments=4)
    kw = {"gpus": 4, "memory_bytes": 64 * GiB, "global_batch_size": 8, "schedules": ("1f1b",)}

    def pick(table: CostTable, P: int) -> Candidate:
        result = plan(table, **kw)  # type: ignore[arg-type]
        return next(c for c in result.ranked if c.pipeline == P and c.micro_batch_size == 1)

    def step(table: CostTable, P: int) -> float:
        return pick(table, P).predicted_step_s

    # 4 ranks on 2 cores: two busy ranks run at full speed, four at half
    shared = dataclasses.replace(base, compute_slowdown={1: 1.0, 2: 1.0, 3: 1.5, 4: 2.0})
    compute = pick(base, 1).timeline.busy_s[0]
    assert step(shared, 1) == pytest.approx(step(base, 1) + compute)  # 4 replicas: always all busy
    assert pick(shared, 1).timeline.busy_s[0] == pytest.approx(2 * compute)
    assert step(base, 4) < step(shared, 4) < 2 * step(base, 4)  # the pipeline's bubbles leave cores free
    # each message's CPU work takes core time from the stages computing meanwhile; P=1 sends none
    net = dataclasses.replace(shared.network, message_cpu=[(1, 1e-3)])
    chatty = dataclasses.replace(shared, network=net)
    assert step(chatty, 4) > step(shared, 4) and step(chatty, 1) == step(shared, 1)
    seg = dataclasses.replace(base.segments[0], update_s=0.01)
    updated = dataclasses.replace(base, segments=[seg] * 4)
    assert step(updated, 4) == pytest.approx(step(base, 4) + 0.01)  # one segment per stage, in parallel
    assert step(updated, 1) == pytest.approx(step(base, 1) + 0.04)


def test_plan_can_be_restricted_to_what_a_user_fixed() -> None:
    result = plan(
        uniform_table(),
        gpus=4,
        memory_bytes=64 * GiB,
        global_batch_size=32,
        micro_batch_sizes=(2,),
        pipelines=(2,),
    )
    assert {(c.pipeline, c.micro_batch_size) for c in result.ranked} == {(2, 2)}
    with pytest.raises(
        PlanError, match=r"pipeline depths \[3\] do not divide 4 GPUs \(possible: \[1, 2, 4\]\)"
    ):
        plan(uniform_table(), gpus=4, memory_bytes=64 * GiB, global_batch_size=32, pipelines=(3,))
    with pytest.raises(PlanError, match=r"micro-batch sizes \[8\] are not in the profile"):
        plan(uniform_table(), gpus=4, memory_bytes=64 * GiB, global_batch_size=32, micro_batch_sizes=(8,))


def test_predict_one_configuration_with_its_boundaries() -> None:
    table = uniform_table()
    kw = {"pipeline": 2, "data": 2, "micro_batch_size": 2, "schedule": "1f1b", "global_batch_size": 32}
    planned = plan(table, gpus=4, memory_bytes=64 * GiB, global_batch_size=32, schedules=("1f1b",))
    best = next(c for c in planned.ranked if (c.pipeline, c.micro_batch_size, c.recompute) == (2, 2, False))
    assert predict(table, **kw).predicted_step_s == best.predicted_step_s  # type: ignore[arg-type]
    lopsided = predict(table, boundaries=[0], **kw)  # type: ignore[arg-type]
    assert lopsided.boundaries == (0,) and lopsided.predicted_step_s > best.predicted_step_s
    with pytest.raises(PlanError, match=r"boundaries \[3, 5\]: P=2 needs 1 strictly increasing CutPoint"):
        predict(table, boundaries=[3, 5], **kw)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"micro-batch size 3 is not in the profile"):
        predict(table, **(kw | {"micro_batch_size": 3}))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"P=16 > 8 segments"):
        predict(table, **(kw | {"pipeline": 16}))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"global batch 32 not divisible by D x mbs = 3 x 2"):
        predict(table, **(kw | {"data": 3}))  # type: ignore[arg-type]


def test_the_runtime_overhead_per_action_is_charged_to_pipelined_stages_only() -> None:
    import dataclasses

    base = uniform_table(segments=2, boundary_bytes=0)
    overhead = dataclasses.replace(base, action_overhead_s=5e-4)
    kw = {"micro_batch_size": 1, "global_batch_size": 4, "schedule": "gpipe", "split_backward": False}
    # GPipe P=2 M=4, uniform 2/4 ms stages, nothing else: 5 forward slots + 5 backward slots
    # (each with its 0.5 ms) and latency, against the same without
    plain = predict(base, pipeline=2, data=1, **kw)  # type: ignore[arg-type]
    charged = predict(overhead, pipeline=2, data=1, **kw)  # type: ignore[arg-type]
    assert charged.predicted_step_s - plain.predicted_step_s == pytest.approx(10 * 5e-4)
    # one stage: the profile's whole pass already holds the once-per-action cost
    one = predict(overhead, pipeline=1, data=2, **kw)  # type: ignore[arg-type]
    assert one.predicted_step_s == predict(base, pipeline=1, data=2, **kw).predicted_step_s  # type: ignore[arg-type]
    recomputing = predict(overhead, pipeline=2, data=1, **{**kw, "schedule": "varuna"}, recompute=True)  # type: ignore[arg-type]
    assert recomputing.timeline.busy_s[0] == pytest.approx(
        predict(base, pipeline=2, data=1, **{**kw, "schedule": "varuna"}, recompute=True).timeline.busy_s[0]  # type: ignore[arg-type]
        + 12 * 5e-4  # stage 0: 4 F, 4 R, 4 B
    )


def test_a_split_backward_costs_one_micro_batch_of_memory_on_later_stages_only() -> None:
    table = uniform_table(segments=4, param_bytes=0, activation_memory=2**20, boundary_bytes=2**10)
    kw = {"pipeline": 2, "data": 1, "micro_batch_size": 1, "schedule": "1f1b", "global_batch_size": 4}
    split = predict(table, **kw).memory_per_stage_bytes  # type: ignore[arg-type]
    plain = predict(table, split_backward=False, **kw).memory_per_stage_bytes  # type: ignore[arg-type]
    full = 2 * 2**20  # stage 1's two segments of 1 MiB each
    assert split[0] == plain[0] and split[1] == plain[1] + full
    assert any(s.kind == "W" for s in predict(table, **kw).timeline.spans[1])  # type: ignore[arg-type]
    assert not any(s.kind == "W" for s in predict(table, split_backward=False, **kw).timeline.spans[1])  # type: ignore[arg-type]
