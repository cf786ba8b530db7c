"""Telemetry in the workers (varuna/telemetry.py) and its formats (varuna/_events.py), in one process.

Pure tests of signing and the events log first, then a 1x1 engine with a run directory: its
events, the sampling switches, and a controller command acted on at the end of a step.
"""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path

import pytest
import torch
import zmq

from varuna import Varuna
from varuna.data import SyntheticLM
from varuna.errors import ConfigError
from varuna.models import GPT, gpt_tiny
from varuna.telemetry import events as _events

KEY = bytes.fromhex(_events.new_key())
CONTROLLER = _events.Sender("controller")


def command(key: bytes = KEY, **message: object) -> list[bytes]:
    """A command as the controller's channel sends it: stamped (sender, seq, time), then signed."""
    return _events.encode(key, CONTROLLER.stamp(message))


# --- signing and framing ---------------------------------------------------------------------------


def test_signed_message_round_trips() -> None:
    frames = _events.encode(KEY, {"type": "hello", "rank": 3})
    assert _events.decode(KEY, frames) == {"type": "hello", "rank": 3}


def test_bad_key_tampering_and_malformed_frames_are_dropped() -> None:
    frames = _events.encode(KEY, {"type": "hello", "rank": 3})
    assert _events.decode(bytes.fromhex(_events.new_key()), frames) is None
    assert _events.decode(KEY, [frames[0], frames[1].replace(b"3", b"4")]) is None
    assert _events.decode(KEY, [frames[1]]) is None
    assert _events.decode(KEY, [b"", frames[1]]) is None
    bad_json = b"{not json"
    assert _events.decode(KEY, [_events.sign(KEY, bad_json), bad_json]) is None


def test_key_is_fresh_and_hex() -> None:
    a, b = _events.new_key(), _events.new_key()
    assert a != b and len(bytes.fromhex(a)) == 32


# --- the events log --------------------------------------------------------------------------------


def test_event_log_round_trip_skips_a_torn_line(tmp_path: Path) -> None:
    log = _events.EventLog(tmp_path / "events" / "rank0.jsonl")
    log.write({"type": "hello", "rank": 0, "time": 2.0})
    log.write({"type": "ready", "rank": 0, "time": 3.0})
    log.close()
    other = _events.EventLog(tmp_path / "events" / "rank1.jsonl")
    other.write({"type": "hello", "rank": 1, "time": 1.0})
    other.close()
    with open(tmp_path / "events" / "rank0.jsonl", "a") as f:
        f.write('{"type": "spans", "ra')  # killed mid-write
    assert [e["type"] for e in _events.read_log(tmp_path / "events" / "rank0.jsonl")] == ["hello", "ready"]
    assert [(e["rank"], e["type"]) for e in _events.read_events(tmp_path)] == [
        (1, "hello"),
        (0, "hello"),
        (0, "ready"),
    ]


def test_controller_info_is_private(tmp_path: Path) -> None:
    path = _events.write_controller_info(tmp_path, {"events": "tcp://127.0.0.1:1", "key": "ab"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _events.read_controller_info(tmp_path) == {"events": "tcp://127.0.0.1:1", "key": "ab"}
    assert _events.read_controller_info(tmp_path / "missing") is None


# --- a 1x1 engine ----------------------------------------------------------------------------------


def train(run_dir: Path | None, steps: int, between=None) -> Varuna:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    engine = Varuna(GPT(cfg), global_batch_size=8, micro_batch_size=2, run_dir=run_dir)
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    for step in range(steps):
        if between is not None:
            between(step)
        engine.step(engine.batch(data, step))
    engine.close()
    return engine


def logged(run_dir: Path) -> list[dict]:
    return list(_events.read_log(run_dir / "events" / "rank0.jsonl"))


def test_engine_logs_lifecycle_spans_metrics_and_memory(tmp_path: Path) -> None:
    train(tmp_path, 3)
    events = logged(tmp_path)
    assert [e["type"] for e in events[:2]] == ["hello", "ready"]
    hello = events[0]
    assert hello["pipeline"] == 1 and hello["data"] == 1 and hello["device"] == "cpu" and hello["pid"] > 0
    for e in events:
        assert {"rank", "stage", "replica", "step", "time", "seq"} <= set(e)
    spans = [e for e in events if e["type"] == "spans"]
    metrics = [e for e in events if e["type"] == "step_metrics"]
    assert [e["step"] for e in spans] == [e["step"] for e in metrics] == [0, 1, 2]
    kinds = [s["kind"] for s in spans[0]["spans"]]
    assert kinds.count("F") == kinds.count("B") == 4 and "optim" in kinds and "allreduce" in kinds
    now = time.time()
    for s in spans[0]["spans"]:
        assert now - 60 < s["start"] <= s["end"] <= now  # wall-clock seconds
    m = metrics[-1]
    assert 0.0 <= m["bubble"] < 1.0 and m["samples_per_s"] > 0 and m["loss"] > 0
    mem = m["memory"]
    n_params = sum(p.numel() for p in GPT(gpt_tiny()).parameters()) * 4
    assert mem["params_bytes"] == mem["grads_bytes"] == n_params
    assert mem["optimizer_bytes"] >= 2 * n_params  # AdamW: exp_avg and exp_avg_sq
    assert mem["activations_bytes"] > 0 and mem["peak_rss_bytes"] > mem["activations_bytes"]


def test_telemetry_off_and_span_sampling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_TELEMETRY", "0")
    train(tmp_path / "off", 2)
    assert not (tmp_path / "off" / "events").exists()
    monkeypatch.setenv("VARUNA_TELEMETRY", "1")
    monkeypatch.setenv("VARUNA_TELEMETRY_SPANS_EVERY", "2")
    train(tmp_path / "thin", 4)
    events = logged(tmp_path / "thin")
    assert [e["step"] for e in events if e["type"] == "spans"] == [1, 3]
    assert [e["step"] for e in events if e["type"] == "step_metrics"] == [0, 1, 2, 3]


def test_engine_without_run_dir_or_controller_emits_nothing() -> None:
    engine = train(None, 1)
    assert not engine.observer.enabled


def test_signed_events_and_a_checkpoint_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = zmq.Context.instance()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    try:
        events_port = pull.bind_to_random_port("tcp://127.0.0.1")
        commands_port = pub.bind_to_random_port("tcp://127.0.0.1")
        monkeypatch.setenv("VARUNA_EVENTS", f"tcp://127.0.0.1:{events_port}")
        monkeypatch.setenv("VARUNA_COMMANDS", f"tcp://127.0.0.1:{commands_port}")
        monkeypatch.setenv("VARUNA_EVENTS_KEY", KEY.hex())

        def between(step: int) -> None:
            if step == 1:
                time.sleep(0.3)  # let the SUB socket join
                older_stop = command(cmd="stop")  # stamped first: sent after, it is a replay
                pub.send_multipart(command(cmd="checkpoint"))
                pub.send_multipart(older_stop)
                pub.send_multipart(command(b"wrong", cmd="stop"))  # dropped: bad signature
                pub.send_multipart(command(cmd="set", spans_every="x"))  # dropped: malformed
                time.sleep(0.1)

        engine = train(tmp_path, 3, between)
        assert engine.last_checkpoint is not None and engine.last_checkpoint["step"] == 2
        assert (tmp_path / "checkpoints" / "step-00000002").is_dir()
        assert not engine.stop_request and engine.observer.spans_every == 1
        received = []
        while pull.poll(500):
            received.append(_events.decode(KEY, pull.recv_multipart()))
        types = [
            e["type"] for e in received if e is not None and e["type"] != "heartbeat"
        ]  # beats: sent only
        assert types[:2] == ["hello", "ready"] and "checkpoint_done" in types
        assert types == [e["type"] for e in logged(tmp_path)]  # the socket and the log agree
        seqs = [e["seq"] for e in received]
        assert seqs == list(range(1, len(seqs) + 1)) and len({e["sender"] for e in received}) == 1
        dropped = [e for e in received if e["type"] == "commands_dropped"]
        assert dropped[-1]["counts"] == {"replay": 1, "bad_signature": 1, "malformed": 1}
        done = next(e for e in received if e["type"] == "checkpoint_done")
        assert done["saved_step"] == 2 and done["bytes"] > 0 and Path(done["path"]).is_dir()
    finally:
        pull.close(linger=0)
        pub.close(linger=0)


def test_paused_steps_record_nothing_and_set_pauses_from_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        monkeypatch.setenv("VARUNA_COMMANDS", f"tcp://127.0.0.1:{port}")
        monkeypatch.setenv("VARUNA_EVENTS_KEY", KEY.hex())
        monkeypatch.setenv("VARUNA_EVENTS", f"tcp://127.0.0.1:{_events.free_port()}")  # nobody listens

        def between(step: int, engine: Varuna) -> None:
            if step == 1:
                engine.observer.paused = True  # steps 2 and 3
            if step == 3:
                time.sleep(0.3)  # let the SUB socket join
                pub.send_multipart(command(cmd="set", paused=False))  # read in step 4
                time.sleep(0.1)
            if step == 4:
                pub.send_multipart(command(cmd="set", paused=True))  # read in step 5
                time.sleep(0.1)

        torch.manual_seed(0)
        cfg = gpt_tiny()
        data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
        engine = Varuna(GPT(cfg), global_batch_size=8, micro_batch_size=2, run_dir=tmp_path)
        engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
        for step in range(7):
            between(step, engine)
            engine.step(engine.batch(data, step))
        engine.close()
    finally:
        pub.close(linger=0)
    events = logged(tmp_path)
    assert engine.observer.paused
    # paused for steps 2-3 by the attribute, resumed in step 4 (it still ran paused), paused again in 5
    assert [e["step"] for e in events if e["type"] == "step_metrics"] == [0, 4]
    assert [e["step"] for e in events if e["type"] == "spans"] == [0, 4]
    memory = [e["memory"] for e in events if e["type"] == "step_metrics"]
    assert all(m["grads_bytes"] > 0 and m["optimizer_bytes"] > 0 for m in memory)


def test_a_bad_set_value_is_ignored_and_reported_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pub = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        monkeypatch.setenv("VARUNA_COMMANDS", f"tcp://127.0.0.1:{port}")
        monkeypatch.setenv("VARUNA_EVENTS_KEY", KEY.hex())
        monkeypatch.setenv("VARUNA_EVENTS", f"tcp://127.0.0.1:{_events.free_port()}")  # nobody listens

        sender = _events.Sender("controller")

        def between(step: int) -> None:
            if step == 1:
                time.sleep(0.3)  # let the SUB socket join
                # a value of the right type that a controller without checks sent (a wrong type, e.g.
                # "x", which killed every rank, is dropped before this as malformed)
                bad = sender.stamp({"cmd": "set", "spans_every": 0, "paused": True})
                pub.send_multipart(_events.encode(KEY, bad))
                time.sleep(0.1)
            if step == 2:
                pub.send_multipart(_events.encode(KEY, sender.stamp({"cmd": "set", "spans_every": 2})))
                time.sleep(0.1)

        engine = train(tmp_path, 4, between)
    finally:
        pub.close(linger=0)
    assert engine.step_count == 4  # trained on
    # a warning on the "varuna" logger (pytest's log capture holds it here)
    assert "ignored the controller's set command: set(spans_every=...) takes an integer >= 1" in caplog.text
    assert not engine.observer.paused  # the bad command changed nothing, not even its good part
    assert engine.observer.spans_every == 2  # a good one after it still works


def test_heartbeats_name_the_host_and_the_last_action_and_are_not_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pull = zmq.Context.instance().socket(zmq.PULL)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        monkeypatch.setenv("VARUNA_EVENTS", f"tcp://127.0.0.1:{port}")
        monkeypatch.setenv("VARUNA_EVENTS_KEY", KEY.hex())
        monkeypatch.setenv("VARUNA_HEARTBEAT_S", "0.05")
        engine = train(tmp_path, 2, lambda step: time.sleep(0.3))  # idle between steps: beats say so
        time.sleep(0.3)
        engine.observer._last_beat()  # what atexit runs: no more beats, then "exited"
        rx = _events.Receiver(KEY, _events.EVENT_FIELDS, "type")
        received = []
        while pull.poll(300):
            received.append(rx.accept(pull.recv_multipart()))
        beats = [e for e in received if e is not None and e["type"] == "heartbeat"]
        actions = [b["action"] for b in beats]
        assert {"idle", "after step 0", "after step 1"} <= set(actions) and actions[-1] == "exited"
        assert all(b["host"] == socket.gethostname() and b["rank"] == 0 for b in beats)
        assert rx.dropped == {} and None not in received  # in order, one sender, all verified
        assert not [e for e in logged(tmp_path) if e["type"] == "heartbeat"]
    finally:
        pull.close(linger=0)


def test_a_bad_heartbeat_interval_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_EVENTS", f"tcp://127.0.0.1:{_events.free_port()}")
    monkeypatch.setenv("VARUNA_EVENTS_KEY", KEY.hex())
    for bad in ("fast", "-1", "nan"):
        monkeypatch.setenv("VARUNA_HEARTBEAT_S", bad)
        with pytest.raises(
            ConfigError, match=rf"VARUNA_HEARTBEAT_S must be a number of seconds >= 0 .*got '{bad}'"
        ):
            train(tmp_path, 1)
