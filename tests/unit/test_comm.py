"""Tests of varuna/comm.py: headers, and arrivals seen without blocking (2 ranks over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from varuna.comm.p2p import P2P, decode_header, encode_header
from varuna.errors import PartitionError

REPO = Path(__file__).resolve().parents[1]


def test_header_round_trips_shapes_and_dtypes() -> None:
    tensors = [
        torch.zeros(2, 3),
        torch.zeros(5, dtype=torch.int64),
        torch.zeros(1, 2, 3, dtype=torch.bfloat16),
    ]
    specs, is_tuple = decode_header(encode_header(tensors, True))
    assert is_tuple and specs == [(t.dtype, tuple(t.shape)) for t in tensors]
    with pytest.raises(PartitionError, match="cannot send a torch.complex64 tensor"):
        encode_header([torch.zeros(1, dtype=torch.complex64)], False)


def _two_ranks(tmp_path: Path, script: str, marker: str, **env_extra: str) -> dict[int, Any]:
    """Run tests/scripts/`script` on 2 ranks with `varuna run`; each rank's JSON after `marker`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env_extra}
    path = str(REPO / "tests" / "scripts" / script)
    argv = [
        sys.executable,
        "-m",
        "varuna",
        "run",
        "--pipeline",
        "2",
        "--run-dir",
        "run",
        "--timeout",
        "90",
        path,
    ]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        if marker + " " in line:
            seen[int(line.split("[rank ")[1].split()[0])] = json.loads(line.split(marker + " ", 1)[1])
    return seen


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_an_arrival_is_seen_without_waiting_for_it(tmp_path: Path) -> None:
    """What Varuna's pull-ahead relies on: gloo's works report completion only once waited for,
    so without the watcher threads `activation_ready`/`grad_ready` would stay False for good."""
    # the watchers are off by default (see README); without them no arrival is ever seen
    seen = _two_ranks(tmp_path, "p2p_arrivals.py", "ARRIVALS", VARUNA_P2P_WATCH="1")
    receiver, sender = seen[0], seen[1]
    assert receiver["ready_at_once"] is False  # sent 0.3 s later
    assert receiver["after_s"] is not None and receiver["after_s"] > 0.1  # seen when it came, not before
    assert receiver["value"] == torch.arange(12.0).reshape(3, 4).tolist()
    assert sender["grad_ready_at_once"] is False
    assert sender["grad_after_s"] is not None and sender["grad_after_s"] > 0.1
    assert sender["grad"] == (2 * torch.arange(12.0).reshape(3, 4)).tolist()


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_activations_go_to_receives_posted_early_and_shape_changes_still_arrive(tmp_path: Path) -> None:
    """After the first step an activation moves to receives posted with its previous shape (so it
    travels while the receiver computes); a micro-batch whose shape changes, a tuple with an int
    tensor, and every receiving path (with and without the watcher threads, and posting in the
    order of the sends as for NCCL) still deliver exactly."""
    seen = _two_ranks(tmp_path, "p2p_early.py", "EARLY")
    for mode in ("watch=0", "watch=1", "ordered"):
        assert seen[0][mode]["wrong"] == [] and seen[1][mode]["wrong"] == []
        # 5 steps x 3 micro-batches: step 0 has no early receives; micro-batch 1 changes shape at
        # step 3 and back at step 4, so it misses twice: 15 - 3 - 2 = 10
        assert seen[0][mode]["early"] == 10


class _OrderedWire:
    """torch.distributed's isend/irecv as NCCL pairs them: tags ignored, the k-th receive posted
    from a peer takes the k-th tensor sent to this rank by it, and must match its size and dtype.
    One process plays both ranks: P2P(None, 1) is rank 0, P2P(0, None) is rank 1."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.posted: dict[tuple[int, int], int] = {}

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> object:
        self.sent.setdefault((1 - dst, dst), []).append(tensor.clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> object:
        link = (src, 1 - src)
        k = self.posted.get(link, 0)
        self.posted[link] = k + 1
        return _Match(self, link, k, tensor)


class _Done:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class _Match(_Done):
    def __init__(self, wire: _OrderedWire, link: tuple[int, int], k: int, into: torch.Tensor) -> None:
        self.wire, self.link, self.k, self.into, self.done = wire, link, k, into, False

    def wait(self) -> None:
        if self.done:
            return
        sent = self.wire.sent.get(self.link, [])
        assert self.k < len(sent), f"receive {self.k} on {self.link} waits for a send that never comes"
        got = sent[self.k]
        assert (got.dtype, got.numel()) == (self.into.dtype, self.into.numel()), (
            f"receive {self.k} on {self.link} of {self.into.dtype} x {self.into.numel()} paired with a "
            f"send of {got.dtype} x {got.numel()}"
        )
        self.into.copy_(got.reshape(self.into.shape))
        self.done = True


def _steps_over(wire: _OrderedWire, ordered: bool) -> int:
    """Five steps of three micro-batches, micro-batch 1 changing shape at step 3 and back at 4, each
    received and its gradient sent back in order as the runtime does; returns the early arrivals."""
    cpu = torch.device("cpu")
    first, second = P2P(None, 1, cpu, ordered=ordered), P2P(0, None, cpu, ordered=ordered)
    for step in range(5):
        for mb in range(3):
            second.post_activation_header(mb)  # the runtime posts every micro-batch at the start
        for mb in range(3):
            rows = 5 if (mb == 1 and step == 3) else 3
            value = torch.full((rows, 4), float(10 * step + mb))
            first.send_activation(mb, value)
            got = second.recv_activation(mb)
            assert torch.equal(got.detach(), value)
            got.grad = 2 * got.detach()
            second.send_grad(mb, got)
            assert torch.equal(first.recv_grad(mb)[0], 2 * value)
        first.finish()
        second.finish()
    return second.early_received


def test_an_ordered_transport_posts_receives_in_the_order_of_the_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL ignores tags: posting every micro-batch's header at the start of a step and the data
    after the header would pair the first data with the second header. Ordered, P2P posts one
    micro-batch ahead and still uses the early receives (10 of 15, as over gloo)."""
    import varuna.comm.p2p as comm

    wire = _OrderedWire()
    monkeypatch.setattr(comm.dist, "isend", wire.isend)
    monkeypatch.setattr(comm.dist, "irecv", wire.irecv)
    assert _steps_over(wire, ordered=True) == 10
    monkeypatch.setattr(comm.dist, "isend", (fresh := _OrderedWire()).isend)
    monkeypatch.setattr(comm.dist, "irecv", fresh.irecv)
    with pytest.raises(AssertionError, match="paired with a send|a send that never comes"):
        _steps_over(fresh, ordered=False)  # gloo's way (by tags) mismatches or hangs on an ordered wire
