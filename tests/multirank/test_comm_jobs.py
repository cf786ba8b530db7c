"""varuna/comm over 2 ranks of gloo: arrivals seen without blocking, receives posted early."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import REPO, SCRIPTS

pytestmark = [pytest.mark.multirank, pytest.mark.foreground]


def _two_ranks(varuna_run, tmp_path: Path, script: str, marker: str, **env_extra: str) -> dict[int, Any]:
    """Run tests/scripts/`script` on 2 ranks with `varuna run`; each rank's JSON after `marker`."""
    done = varuna_run(
        [SCRIPTS / script],
        pipeline=2,
        run_dir=tmp_path / "run",
        flags=["--timeout", "90"],
        env=env_extra,
        cwd=tmp_path,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        if marker + " " in line:
            seen[int(line.split("[rank ")[1].split()[0])] = json.loads(line.split(marker + " ", 1)[1])
    return seen


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_an_arrival_is_seen_without_waiting_for_it(tmp_path: Path, varuna_run) -> None:
    """What Varuna's pull-ahead relies on: gloo's works report completion only once waited for,
    so without the watcher threads `activation_ready`/`grad_ready` would stay False for good."""
    # the watchers are off by default (see README); without them no arrival is ever seen
    seen = _two_ranks(varuna_run, tmp_path, "p2p_arrivals.py", "ARRIVALS", VARUNA_P2P_WATCH="1")
    receiver, sender = seen[0], seen[1]
    assert receiver["ready_at_once"] is False  # sent 0.3 s later
    assert receiver["after_s"] is not None and receiver["after_s"] > 0.1  # seen when it came, not before
    assert receiver["value"] == torch.arange(12.0).reshape(3, 4).tolist()
    assert sender["grad_ready_at_once"] is False
    assert sender["grad_after_s"] is not None and sender["grad_after_s"] > 0.1
    assert sender["grad"] == (2 * torch.arange(12.0).reshape(3, 4)).tolist()


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_activations_go_to_receives_posted_early_and_shape_changes_still_arrive(
    tmp_path: Path, varuna_run
) -> None:
    """After the first step an activation moves to receives posted with its previous shape (so it
    travels while the receiver computes); a micro-batch whose shape changes, a tuple with an int
    tensor, and every receiving path (with and without the watcher threads, and posting in the
    order of the sends as for NCCL) still deliver exactly."""
    seen = _two_ranks(varuna_run, tmp_path, "p2p_early.py", "EARLY")
    for mode in ("watch=0", "watch=1", "ordered", "unstepped", "unstepped-watch=1"):
        assert seen[0][mode]["wrong"] == [] and seen[1][mode]["wrong"] == []
        # 5 steps x 3 micro-batches: step 0 has no early receives; micro-batch 1 changes shape at
        # step 3 and back at step 4, so it misses twice: 15 - 3 - 2 = 10
        assert seen[0][mode]["early"] == 10
        # with begin_step, headers only where the batch changed shape: 3 at step 0, then micro-batch
        # 1's at steps 3 and 4; without it (the profiler's use), one with every activation
        assert seen[1][mode]["headers"] == (15 if mode.startswith("unstepped") else 5)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_cut_changing_shape_while_its_batch_does_not_fails_loudly_unless_headers_every(
    tmp_path: Path, varuna_run
) -> None:
    """The stages send a cut's shapes only when the batch's change; a model whose cut shape changes
    on its own stops the job with the setting to change, which then delivers every value."""
    done = varuna_run(
        [SCRIPTS / "p2p_mismatch.py"],
        pipeline=2,
        run_dir=tmp_path / "run",
        flags=["--timeout", "60"],
        cwd=tmp_path,
        timeout=90,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "PartitionError: micro-batch 1's value at the cut changed shape to float32 (4, 4)" in out
    assert "from last step's float32 (3, 4)" in out and "VARUNA_P2P_HEADERS=every" in out
    seen = _two_ranks(varuna_run, tmp_path, "p2p_mismatch.py", "MISMATCH", VARUNA_P2P_HEADERS="every")
    assert seen[0] == {"wrong": [], "received": 6}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_serial_links_learn_shapes_once_per_batch_shape_and_refuse_a_cut_that_changes_alone(
    tmp_path: Path, varuna_run
) -> None:
    """The serial links (NCCL's) know every activation's shapes before it comes, from one probe per
    batch shape; a cut that changes shape on its own stops the job with the setting that probes
    every micro-batch, which then delivers every value."""
    (tmp_path / "a").mkdir()
    done = varuna_run(
        [SCRIPTS / "p2p_mismatch.py"],
        pipeline=2,
        run_dir=tmp_path / "a" / "run",
        flags=["--timeout", "60"],
        cwd=tmp_path / "a",
        timeout=90,
        check=False,
        env={"MISMATCH_LINK": "serial"},
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "PartitionError: micro-batch 1's value at the cut after stage 0 has shapes float32 (4, 4)" in out
    assert (
        "not the float32 (3, 4) a micro-batch of the same shapes had" in out
        and "VARUNA_P2P_HEADERS=every" in out
    )
    seen = _two_ranks(
        varuna_run,
        tmp_path,
        "p2p_mismatch.py",
        "MISMATCH",
        VARUNA_P2P_HEADERS="every",
        MISMATCH_LINK="serial",
    )
    assert seen[0] == {"wrong": [], "received": 6}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_one_host_job_puts_the_store_and_gloo_on_loopback(tmp_path: Path, varuna_run) -> None:
    """A TCPStore given host 127.0.0.1 still listens on every interface unless handed a socket."""
    seen = _two_ranks(varuna_run, tmp_path, "store_address.py", "STORE")
    assert seen[0]["port"] == seen[1]["port"]
    assert seen[0]["listen"] == ["127.0.0.1"]  # the server, on rank 0: loopback only
    assert all(s["gloo_ifname"] == "lo" for s in seen.values())


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_nccl_rules_on_gloo_show_a_hang_and_a_mispairing_that_gloo_hides(tmp_path: Path, varuna_run) -> None:
    """VARUNA_NCCL_RULES=1: a receive posted early on the communicator both directions share holds
    back the gradient send the peer waits for (the first GPU run hung so) and raises; on a group per
    direction the same exchange completes; tags are ignored, so a receive posted out of order gets
    the other message; two ranks starting on different groups wait in NCCL's communicator creation
    (the second GPU run hung so) unless the groups were warmed in one order; a receive and a send
    posted as one batch proceed together. Without the rules gloo
    completes all of it and pairs by tag."""
    (tmp_path / "on").mkdir(), (tmp_path / "off").mkdir()
    ruled = _two_ranks(
        varuna_run, tmp_path / "on", "nccl_rules_check.py", "RULES", VARUNA_NCCL_RULES="1", VARUNA_TIMEOUT="4"
    )
    for r in (0, 1):
        assert ruled[r]["installed"] is True
        assert ruled[r]["split"] == "completed"
        assert ruled[r]["shared"].startswith("NcclRuleError"), ruled[r]
        assert "on NCCL this hangs" in ruled[r]["shared"] and "two communicators" in ruled[r]["shared"]
        assert ruled[r]["created"].startswith("NcclRuleError"), ruled[r]
        assert "creates a communicator on first use" in ruled[r]["created"]
        assert ruled[r]["warmed"] == "completed"
        assert ruled[r]["batched"] == [6.0 - r, 6.0 - r]  # the peer's value: the batch went through
    assert ruled[1]["order_b_got"] == [1.0, 1.0, 1.0]  # the first message sent, tag 1's
    plain = _two_ranks(varuna_run, tmp_path / "off", "nccl_rules_check.py", "RULES", VARUNA_TIMEOUT="4")
    assert [plain[r]["installed"] for r in (0, 1)] == [False, False]
    for case in ("shared", "created", "warmed"):
        assert [plain[r][case] for r in (0, 1)] == ["completed", "completed"]
    assert plain[1]["order_b_got"] == [2.0, 2.0, 2.0]  # gloo matches tag 2
    # strict (rule 4: a rank's operations on every communicator in one order): a batch still goes
    # through, but a receive posted early on one group holds back a send on the other
    (tmp_path / "strict").mkdir()
    strict = _two_ranks(
        varuna_run,
        tmp_path / "strict",
        "nccl_rules_check.py",
        "RULES",
        VARUNA_NCCL_RULES="strict",
        VARUNA_TIMEOUT="4",
        RULES_CASES="batched,split",
    )
    for r in (0, 1):
        assert strict[r]["batched"] == [6.0 - r, 6.0 - r]
        assert strict[r]["split"].startswith("NcclRuleError") and "strict: rule 4" in strict[r]["split"]


ONE_CHUNK = ("gpipe", "1f1b", "eager-1f1b", "varuna", "zb-h1")
TWO_CHUNKS = ("interleaved-1f1b", "zb-v")


@pytest.mark.multirank
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("pipeline", "data", "schedules", "models"),
    [
        (2, 1, ONE_CHUNK, ("gpt", "bert")),
        (2, 2, ONE_CHUNK, ("gpt", "bert")),
        (4, 1, ONE_CHUNK, ("gpt", "bert")),
        (2, 1, TWO_CHUNKS, ("gpt", "bert")),
        (2, 2, TWO_CHUNKS, ("gpt", "bert")),
        (4, 1, TWO_CHUNKS, ("gpt-midcut", "bert8")),  # 8 virtual stages need 8 segments
    ],
)
def test_serial_links_keep_the_strict_rules_and_train_as_plain_training(
    tmp_path: Path, varuna_run, pipeline: int, data: int, schedules: tuple[str, ...], models: tuple[str, ...]
) -> None:
    """Under VARUNA_NCCL_RULES=strict (a rank's operations on every communicator in one posting
    order: what NCCL promises at the least) the early-receive links hang, as the GPU runs did; the
    engine then takes `varuna.comm.serial` (one group per pipeline, sends batched with the next
    receive; a middle stage's batches hold both neighbours' messages; with two chunks per rank,
    each peer's messages taken in its send order, their shapes probed once), and every schedule
    trains GPT and BERT at 2x1, 2x2 and 4x1 exactly as plain training, Varuna's with its
    pull-ahead running forwards ahead of late gradients."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from _harness import compare

    done = varuna_run(
        [REPO / "tests" / "gpu" / "_equality_worker.py", tmp_path / "out", "3", *models],
        pipeline=pipeline,
        data=data,
        run_dir=tmp_path / "run",
        flags=["--timeout", "200"],
        cwd=tmp_path,
        env={
            "VARUNA_NCCL_RULES": "strict",
            "VARUNA_TIMEOUT": "20",
            "EQUALITY_SCHEDULES": ",".join(schedules),
        },
        timeout=220,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "follows NCCL's rules on gloo (VARUNA_NCCL_RULES=strict)" in done.stdout + done.stderr
    for kind in models:
        for schedule in schedules:
            folder = tmp_path / "out" / f"{kind}-{pipeline}x{data}-{schedule}"
            result = compare(folder, kind, pipeline * data, data, 3, 1e-5)
            assert result["ok"], (kind, schedule, result)
    for eager in {"varuna", "eager-1f1b"} & set(schedules):  # pull-ahead ran over these links too
        pulled = [  # (the rules' works report arrivals)
            torch.load(f, weights_only=True)["pulled_ahead"]
            for kind in models
            for f in (tmp_path / "out" / f"{kind}-{pipeline}x{data}-{eager}").glob("rank*.pt")
        ]
        assert sum(pulled) > 0, (eager, pulled)
    for timed in {"zb-h1", "zb-v"} & set(schedules):  # step 3 ran the order refitted to step 2's costs,
        refits = [  # its messages in the ticks of the new order (`Courier.replan`)
            torch.load(f, weights_only=True)["refit"]
            for kind in models
            for f in (tmp_path / "out" / f"{kind}-{pipeline}x{data}-{timed}").glob("rank*.pt")
        ]
        assert refits and all(r is not None and r["step"] == 2 for r in refits), (timed, refits)
