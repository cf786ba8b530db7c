"""Which links a pipeline gets (`varuna.comm.serial.wanted`) and when their messages cross
(`varuna.comm._ticks`); the links themselves run in tests/multirank/test_comm_jobs.py (every
schedule under the strict NCCL rules)."""

from __future__ import annotations

import pytest
import torch

from varuna.comm._ticks import exchange_ticks, message
from varuna.comm.serial import wanted
from varuna.errors import ConfigError, ScheduleError
from varuna.schedule import SCHEDULES, Action, build_schedule, schedule_spec

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("p2p", "rules", "device", "chunks", "serial"),
    [
        ("", "", CPU, 1, False),  # gloo: the early receives
        ("", "", CUDA, 1, True),  # NCCL: serial
        ("", "", CUDA, 2, True),  # two chunks per rank too
        ("", "1", CPU, 1, False),  # the rules model NCCL's ordering; the early path keeps it
        ("", "strict", CPU, 1, True),  # strict: what NCCL promises at the least
        ("early", "strict", CPU, 1, False),
        ("early", "", CUDA, 1, False),
        ("serial", "", CPU, 1, True),
        ("serial", "", CPU, 2, True),
    ],
)
def test_the_links_follow_the_transport_and_the_setting(
    monkeypatch, p2p, rules, device, chunks, serial
) -> None:
    monkeypatch.setenv("VARUNA_P2P", p2p)
    monkeypatch.setenv("VARUNA_NCCL_RULES", rules)
    assert wanted(device, chunks, "1f1b") is serial


def test_an_unknown_mode_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("VARUNA_P2P", "eager")
    with pytest.raises(
        ConfigError,
        match=r"VARUNA_P2P='eager' \(schedule '1f1b', 1 chunk\(s\) per rank\): expected 'serial' or 'early'",
    ):
        wanted(CPU, 1, "1f1b")


def test_1f1b_messages_cross_at_the_ticks_their_stages_make_them() -> None:
    """1F1B, 2 stages, 2 micro-batches, unit costs: stage 1 runs F0 at tick 1 (the activation made
    at 0), B0 at 2, its split-off W0 at 3, F1 at 4, B1 at 5; stage 0 waits for each gradient."""
    table = exchange_ticks(build_schedule("1f1b", 2, 2), lambda v: v)
    assert table == {("F", 1, 0): (0, 0), ("F", 1, 1): (1, 0), ("B", 0, 0): (2, 1), ("B", 0, 1): (5, 1)}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (3, 6), (4, 8)])
def test_every_cross_rank_message_crosses_after_its_inputs_and_in_its_senders_order(
    name, stages, micro
) -> None:
    """The table holds exactly the messages between ranks; each rank makes its messages in its
    list's order, and a message a rank needs crosses before any message it makes after needing it."""
    if name == "interleaved-1f1b" and micro % stages:
        pytest.skip("interleaved-1f1b needs M % P == 0")
    spec = schedule_spec(name)
    schedule = build_schedule(name, stages, micro)

    def rank_of(v: int) -> int:
        return spec.rank_of(v, stages)

    table = exchange_ticks(schedule, rank_of)
    crossing = set()
    for p, actions in schedule.items():
        needed = -1  # the latest tick of a message this rank received so far
        last_made = -1
        for a in actions:
            msg = message(a)
            if msg is None:
                continue
            if a.kind.startswith("SEND") and rank_of(msg[1]) != p:
                crossing.add(msg)
                tick, sender = table[msg]
                assert sender == p and tick >= last_made and tick > needed, (p, a, tick, needed)
                last_made = tick
            elif a.kind.startswith("RECV") and msg in table:
                needed = max(needed, table[msg][0])
    assert crossing == set(table)


def test_lists_that_wait_for_each_other_are_refused() -> None:
    """Each stage receives before it sends what the other waits for."""
    stuck = {
        0: [Action(0, "RECV_B", 0), Action(0, "F", 0), Action(0, "SEND_F", 0)],
        1: [Action(1, "RECV_F", 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, "SEND_B", 0)],
    }
    with pytest.raises(ScheduleError, match=r"the stages wait for each other at tick 0"):
        exchange_ticks(stuck, lambda v: v)
