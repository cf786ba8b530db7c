"""Tests of varuna/comm.py: headers, and arrivals seen without blocking (2 ranks over gloo)."""

from __future__ import annotations

import pytest
import torch

from varuna.comm.p2p import P2P, decode_header, encode_header
from varuna.errors import PartitionError


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


class _OrderedWire:
    """torch.distributed's isend/irecv as NCCL pairs them: tags ignored, the k-th receive posted
    from a peer takes the k-th tensor sent to this rank by it, and must match its size and dtype.
    One process plays both ranks: P2P(None, 1) is rank 0, P2P(0, None) is rank 1."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.posted: dict[tuple[int, int], int] = {}

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: object = None) -> object:
        self.sent.setdefault((1 - dst, dst), []).append(tensor.clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, group: object = None) -> object:
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


def _rows(step: int, mb: int) -> int:
    return 5 if (mb == 1 and step == 3) else 3


def _steps_over(wire: _OrderedWire, ordered: bool, stepped: bool = True) -> tuple[int, int]:
    """Five steps of three micro-batches, micro-batch 1 changing shape at step 3 and back at 4, each
    received and its gradient sent back in order as the runtime does; returns the early arrivals
    and the headers sent. `stepped`: as the runtime, with `begin_step` (else every activation
    comes with a header)."""
    cpu = torch.device("cpu")
    first, second = P2P(None, 1, cpu, ordered=ordered), P2P(0, None, cpu, ordered=ordered)
    for step in range(5):
        if stepped:
            micro = [{"ids": torch.zeros(_rows(step, mb), 4, dtype=torch.int64)} for mb in range(3)]
            first.begin_step(micro)
            second.begin_step(micro)
        else:
            for mb in range(3):
                second.post_activation_header(mb)
        for mb in range(3):
            rows = _rows(step, mb)
            value = torch.full((rows, 4), float(10 * step + mb))
            first.send_activation(mb, value)
            got = second.recv_activation(mb)
            assert torch.equal(got.detach(), value)
            got.grad = 2 * got.detach()
            second.send_grad(mb, got)
            assert torch.equal(first.recv_grad(mb)[0], 2 * value)
        first.finish()
        second.finish()
    return second.early_received, first.headers_sent


def test_an_ordered_transport_posts_receives_in_the_order_of_the_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL ignores tags: posting every micro-batch's header at the start of a step and the data
    after the header would pair the first data with the second header. Ordered, P2P posts one
    micro-batch ahead and still uses the early receives (10 of 15, as over gloo)."""
    import varuna.comm.p2p as comm

    wire = _OrderedWire()
    for stepped, headers in ((True, 5), (False, 15)):
        monkeypatch.setattr(comm.dist, "isend", (wire := _OrderedWire()).isend)
        monkeypatch.setattr(comm.dist, "irecv", wire.irecv)
        # 3 in step 0, then only micro-batch 1's at steps 3 and 4, when its batch changes shape
        assert _steps_over(wire, ordered=True, stepped=stepped) == (10, headers)
        monkeypatch.setattr(comm.dist, "isend", (fresh := _OrderedWire()).isend)
        monkeypatch.setattr(comm.dist, "irecv", fresh.irecv)
        with pytest.raises(AssertionError, match="paired with a send|a send that never comes"):
            _steps_over(fresh, ordered=False, stepped=stepped)  # gloo's way (by tags) on an ordered wire
