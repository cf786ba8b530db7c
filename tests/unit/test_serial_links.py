"""Which links a pipeline gets (`varuna.comm.serial.wanted`); the links themselves run in
tests/multirank/test_comm_jobs.py (every one-chunk schedule under the strict NCCL rules)."""

from __future__ import annotations

import pytest
import torch

from varuna.comm.serial import wanted
from varuna.errors import ConfigError

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("p2p", "rules", "device", "chunks", "serial"),
    [
        ("", "", CPU, 1, False),  # gloo: the early receives
        ("", "", CUDA, 1, True),  # NCCL: serial
        ("", "", CUDA, 2, False),  # two chunks per rank keep a group per virtual boundary
        ("", "1", CPU, 1, False),  # the rules model NCCL's ordering; the early path keeps it
        ("", "strict", CPU, 1, True),  # strict: what NCCL promises at the least
        ("early", "strict", CPU, 1, False),
        ("early", "", CUDA, 1, False),
        ("serial", "", CPU, 1, True),
    ],
)
def test_the_links_follow_the_transport_and_the_setting(
    monkeypatch, p2p, rules, device, chunks, serial
) -> None:
    monkeypatch.setenv("VARUNA_P2P", p2p)
    monkeypatch.setenv("VARUNA_NCCL_RULES", rules)
    assert wanted(device, chunks, "1f1b") is serial


def test_serial_with_two_chunks_per_rank_or_an_unknown_mode_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_P2P", "serial")
    with pytest.raises(ConfigError, match=r"one chunk per rank; schedule 'zb-v' places 2.*unset VARUNA_P2P"):
        wanted(CPU, 2, "zb-v")
    monkeypatch.setenv("VARUNA_P2P", "eager")
    with pytest.raises(ConfigError, match=r"VARUNA_P2P='eager': expected 'serial' or 'early'"):
        wanted(CPU, 1, "1f1b")
