"""The engine's acceptance test: pipeline x data-parallel training equals plain training.

For a GPT-like model (tied embeddings, causal mask) and a BERT-like MLM encoder (padding mask
used by every stage), at every P x D in {1x1, 2x1, 1x2, 2x2, 4x1, 3x1 uneven} and with each
schedule, the 5 step losses and the final parameters match single-process training on the same
global batches within 1e-5 relative (fp32). One `varuna run` job per world size trains them all.

The jobs with more than one rank run under NCCL's point-to-point rules (`varuna.comm.nccl_rules`),
so every schedule here, shape changes included, is also what a GPU run would do; the other
multi-rank tests keep gloo's own behaviour. The 2-rank job runs under the strict rules (a rank's
operations on every communicator one after another), where the engine takes NCCL's links
(`varuna.comm.serial`: the exchange table, the shape probe, also for a sequence length that changes
every step, checkpoints between chunkings, mixed precision); the 3- and 4-rank jobs under rule 1 to 3
with gloo's links (`varuna.comm.p2p`, early receives, a group per direction).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from transparency_common import (  # noqa: E402
    CHUNK_CONFIGS,
    CLIP,
    CONFIGS,
    EVERY_W,
    EXTRA,
    MODELS,
    SCHEDULES,
    reference,
    varlen,
)

from varuna.schedule import schedule_spec  # noqa: E402

pytestmark = pytest.mark.multirank
RTOL = 1e-5
RULES = {2: "strict", 3: "1", 4: "1"}  # VARUNA_NCCL_RULES of each world's job


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, varuna_popen) -> dict[int, Path]:
    """One job per world size, all started at once (they oversubscribe the cores, but overlap)."""
    base = tmp_path_factory.mktemp("transparency")
    cwd = base / "cwd"
    cwd.mkdir()
    procs = {}
    for world in CONFIGS:
        out = base / f"w{world}"
        log = open(base / f"w{world}.log", "w")
        procs[world] = (
            varuna_popen(
                [SCRIPTS / "transparency_worker.py", out, str(world)],
                pipeline=world,
                data=1,
                run_dir=base / f"run{world}",
                env={"VARUNA_NCCL_RULES": RULES[world]} if world > 1 else None,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
            ),
            out,
            log,
        )
    outs = {}
    for world, (proc, out, log) in procs.items():
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        text = (base / f"w{world}.log").read_text()
        assert code == 0, f"world {world} job failed ({code}):\n{text[-6000:]}"
        assert (world > 1) == ("follows NCCL's rules" in text), text[-3000:]
        outs[world] = out
    # nothing is written to the working directory: caches and logs live in the run directory
    assert list(cwd.iterdir()) == []
    assert list((base / "run2").glob("cache/segments-*.json"))
    return outs


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    torch.set_num_threads(1)
    return {kind: reference(kind) for kind in MODELS}


CASES = [
    (world, P, D, kind, schedule)
    for world, configs in CONFIGS.items()
    for (P, D, _) in configs
    for kind in MODELS
    for schedule in SCHEDULES
] + [(world, P, D, kind, schedule) for world, extra in EXTRA.items() for P, D, kind, schedule in extra]


@pytest.mark.parametrize(
    ("world", "P", "D", "kind", "schedule"), CASES, ids=[f"{k}-{P}x{D}-{s}" for _, P, D, k, s in CASES]
)
def test_equals_plain_training(runs, references, world, P, D, kind, schedule) -> None:
    ref_losses, ref_params = references[kind]
    folder = runs[world] / f"{kind}-{P}x{D}-{schedule}"
    results = [torch.load(f, weights_only=True) for f in sorted(folder.glob("rank*.pt"))]
    assert len(results) == world
    for r in results:  # every rank reports the same global mean loss
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    seen: dict[str, int] = {}
    for r in results:
        for name, value in r["params"].items():
            torch.testing.assert_close(
                value, ref_params[name], rtol=RTOL, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )
            seen[name] = seen.get(name, 0) + 1
    # every parameter is held by some rank: D copies, more for weights tied across stages
    assert set(seen) == set(ref_params)
    assert min(seen.values()) >= D
    for r in results:  # and a rank keeps no other stage's parameters in memory (they are meta)
        assert r["in_memory"] == sorted(r["params"])
    for r in results:  # stages after the first split their first and last backward (the default), or
        # where the schedule places each weight half itself (zb-h1: every backward, less those its
        # order fitted to the profiled costs merged back, `fuse_weights`), each W one split backward
        every = not schedule_spec(schedule.split(":")[0]).split_backward
        split = r["weights"] if every else min(r["microbatches"], 2)
        assert r["split"] == (0 if r["stage"] == 0 else split), r["stage"]
        assert r["weights"] <= r["microbatches"] and (r["stage"] > 0 or r["weights"] == 0)
        if schedule.endswith(EVERY_W):  # the paper's zb-h1: every backward after stage 0 split
            assert r["weights"] == (r["microbatches"] if r["stage"] > 0 else 0)
    _check_refit(results, schedule, P)
    _check_overlap(results, D, schedule)
    if schedule in ("1f1b", "eager-1f1b", "zb-h1"):  # activations held: 1F1B's P - s; eager-1F1B one
        # more at most (whether it takes that one depends on when gradients arrive: test_comm_jobs
        # checks it pulls); zb-h1 up to P on later stages (its W's), its first stage P + 1 (pulls)
        M = results[0]["microbatches"]
        most = {
            s: min(M, P + (s == 0) if schedule == "zb-h1" else P - s + (schedule == "eager-1f1b"))
            for s in range(P)
        }
        held = [(r["stage"], r["peak_held"]) for r in results]
        assert all(h <= most[s] for s, h in held), (held, most)


def _check_overlap(results: list[dict], D: int, schedule: str) -> None:
    """With replicas, every gradient bucket's all-reduce starts before the schedule's ALLREDUCE
    (`EngineConfig.overlap_allreduce`), except on serial links (NCCL's just-in-time path), which
    start them all there; where a stage's last backward is whole (stage 0 of gpipe and 1f1b), buckets
    start inside it, as their last gradients are accumulated."""
    for r in results:
        assert r["buckets"] > 1, r["buckets"]
        if D == 1 or r["serial"]:
            assert r["started_early"] == 0, r
            continue
        assert r["started_early"] == r["buckets"], r
        if r["stage"] == 0 and schedule in ("gpipe", "1f1b"):
            assert r["started_in_backward"] >= 1, r


CHUNK_CASES = [
    (world, P, D, "" if part == "balanced" or P == 3 else "-uneven", kind, schedule)
    for world, configs in CHUNK_CONFIGS.items()
    for (P, D, part, kinds, schedules) in configs
    for kind in kinds
    for schedule in schedules
]


@pytest.mark.parametrize(
    ("world", "P", "D", "uneven", "kind", "schedule"),
    CHUNK_CASES,
    ids=[f"{k}-{P}x{D}{u}-{s}" for _, P, D, u, k, s in CHUNK_CASES],
)
def test_two_chunks_per_rank_equal_plain_training(runs, world, P, D, uneven, kind, schedule) -> None:
    """interleaved-1f1b and zb-v (P x 2 virtual stages) train exactly as one process does."""
    folder = runs[world] / f"{kind}-{P}x{D}{uneven}-{schedule}"
    _check_against(folder, "rank*.pt", reference(kind), world)
    results = [torch.load(f, weights_only=True) for f in sorted(folder.glob("rank*.pt"))]
    held = {name for r in results for name in r["params"]}
    assert held == set(reference(kind)[1])  # every parameter is held by some rank
    spec = schedule_spec(schedule.split(":")[0])
    M = results[0]["microbatches"]
    for r in results:
        assert r["chunk_stages"] == spec.stages_of(r["stage"], P) and len(r["chunk_stages"]) == 2
        assert r["in_memory"] == sorted(r["params"])  # only its two chunks' parameters are real
        # zb-v splits the backwards after virtual stage 0 whose W its order keeps (`fuse_weights`
        # merges the others back, on the profiled costs); interleaved none
        per_chunk = {"zb-v": M, "interleaved-1f1b": 0}[schedule.split(":")[0]]
        assert r["split"] == r["weights"] <= per_chunk * sum(1 for v in r["chunk_stages"] if v > 0)
        if schedule.endswith(EVERY_W):  # the paper's zb-v: every backward after virtual stage 0 split
            assert r["weights"] == per_chunk * sum(1 for v in r["chunk_stages"] if v > 0)
    _check_refit(results, schedule, P)
    _check_overlap(results, D, schedule)


def _check_refit(results: list[dict], schedule: str, P: int) -> None:
    """zb-h1 and zb-v ran steps 3-5 in the order refitted to the chunk costs step 2 measured
    (`EngineConfig.refit_after`), every rank on the same costs; other schedules keep theirs."""
    timed = schedule_spec(schedule.split(":")[0]).timed_order and P > 1
    for r in results:
        assert (r["refit"] is not None) == timed, (schedule, r["refit"])
        if timed:
            assert r["refit"]["step"] == 2 and r["refit"]["costs"] == results[0]["refit"]["costs"]
            assert all(x > 0 for row in r["refit"]["costs"] for x in row)


def _check_against(
    folder: Path,
    pattern: str,
    ref: tuple[list[float], dict[str, torch.Tensor]],
    ranks: int,
    rename: dict[str, str] | None = None,
) -> None:
    ref_losses, ref_params = ref
    files = sorted(folder.glob(pattern))
    assert len(files) == ranks
    for f in files:
        r = torch.load(f, weights_only=True)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
        for name, value in r["params"].items():
            expected = ref_params[(rename or {}).get(name, name)]
            torch.testing.assert_close(
                value, expected, rtol=RTOL, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_checkpoints_move_between_chunkings(runs) -> None:
    """2 steps of zb-v, resumed for 2 of interleaved-1f1b (with recompute), resumed for 1 of 1f1b:
    the 5 losses and final parameters of uninterrupted plain training."""
    _check_against(runs[2], "chunk-resume-rank*.pt", reference("gpt"), 2)


def test_variable_sequence_length(runs) -> None:
    _check_against(runs[2], "varlen-rank*.pt", reference("gpt", transform=varlen), 2)


def test_shared_weights_train_like_a_tied_model(runs) -> None:
    _check_against(runs[2], "shared-rank*.pt", reference("gpt"), 2, rename={"lm_head.weight": "wte.weight"})


@pytest.mark.parametrize("boundary", [0, 2])
def test_a_boundary_inside_a_block(runs, boundary) -> None:
    _check_against(runs[2], f"midcut{boundary}-rank*.pt", reference("gpt"), 2)


def test_clipping_by_the_global_norm(runs) -> None:
    _check_against(runs[4], "clip-rank*.pt", reference("gpt", clip=CLIP), 4)


def test_gradients_all_reduced_in_bf16_are_close_not_equal(runs, references) -> None:
    """allreduce_dtype="bf16" rounds each replica's gradient share to bfloat16 before the sum: the
    parameters stay within bfloat16's precision of plain training's, and differ from them."""
    ref_losses, ref_params = references["gpt"]
    files = sorted(runs[4].glob("bf16-allreduce-rank*.pt"))
    assert len(files) == 4
    differ = 0
    for f in files:
        r = torch.load(f, weights_only=True)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-2, atol=0)
        for name, value in r["params"].items():
            expected = ref_params[name]
            torch.testing.assert_close(value, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
            differ += not torch.allclose(value, expected, rtol=RTOL, atol=1e-7)
    assert differ > 0


def test_closed_engines_leave_no_threads_sockets_or_stages_behind(runs) -> None:
    # Each job builds and closes dozens of engines in one process (as a notebook, a bench or a resize
    # does): each close must release the engine's process groups (gloo gives every group its own
    # threads and sockets) and let the engine be collected (its stage's weights, optimizer, graphs).
    for world, out in runs.items():
        for rank in range(world):
            released = json.loads((out / f"released-rank{rank}.json").read_text())
            assert len(released) > 10, (world, rank)
            assert not any(r["alive"] for r in released), (world, rank, [r["alive"] for r in released])
            first, last = released[0], released[-1]
            assert last["threads"] <= first["threads"] + 2, (world, rank, first, last)
            assert last["fds"] <= first["fds"] + 4, (world, rank, first, last)


def test_uneven_split_is_uneven(runs) -> None:
    r = torch.load(runs[3] / "gpt-3x1-1f1b" / "rank0.pt", weights_only=True)
    assert tuple(r["boundaries"]) == (0, 1)  # stages of 1, 1 and 2 segments


def test_tied_embedding_lives_on_first_and_last_stage(runs) -> None:
    folder = runs[4] / "gpt-4x1-1f1b"
    held = {int(f.stem[4:]): set(torch.load(f, weights_only=True)["params"]) for f in folder.glob("rank*.pt")}
    assert "wte.weight" in held[0] and "wte.weight" in held[3]
    assert "wte.weight" not in held[1] and "wte.weight" not in held[2]
    # no rank holds another stage's blocks
    assert not held[0] & held[1] and not held[1] & held[2]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(runs, precision) -> None:
    results = [json.loads(f.read_text()) for f in sorted(runs[4].glob(f"{precision}-rank*.json"))]
    assert len(results) == 4
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


def test_fp16_overflow_skips_the_step_on_every_rank(runs) -> None:
    results = [json.loads(f.read_text()) for f in sorted(runs[4].glob("fp16-rank*.json"))]
    assert len(results) == 4
    for r in results:
        assert r["skipped"] is True and r["unchanged"] is True
        assert r["next_skipped"] is False
    # every rank that had the common scale halved it
    assert sum(r["scale_after"] == r["scale_before"] / 2 for r in results) == 3
