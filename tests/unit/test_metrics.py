"""Metrics loggers (`varuna.metrics`) fed by the engine, in one process, read back as their users
read them: TensorBoard's own event reader, csv, json. And the library's log (`varuna._log`)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.errors import ConfigError
from varuna.metrics import CSVLogger, JSONLLogger, TensorBoardLogger
from varuna.models import GPT, gpt_tiny


def _engine() -> tuple[Varuna, SyntheticLM]:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    engine = Varuna(
        GPT(cfg), global_batch_size=4, micro_batch_size=2, example_batch=collate([data[0], data[1]])
    )
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    return engine, data


def test_the_engine_feeds_tensorboard_csv_and_jsonl(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, data = _engine()
    engine.add_logger(TensorBoardLogger(tmp_path / "tb"))
    engine.add_logger(CSVLogger(tmp_path / "m.csv"))
    engine.add_logger(JSONLLogger(tmp_path / "m.jsonl"), every=2)
    losses = [engine.step(engine.batch(data, k)) for k in range(4)]
    result = engine.evaluate(
        [data[i] for i in range(10)], metrics=lambda out, b: {"rows": len(b["input_ids"])}
    )
    engine.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/step_time_s",
        "eval/loss",
        "eval/rows",
    } <= set(events.Tags()["scalars"])
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert [e.value for e in scalars] == pytest.approx(losses)
    assert events.Scalars("train/lr")[0].value == pytest.approx(0.1)
    [ev] = events.Scalars("eval/loss")
    assert (ev.step, ev.value) == (4, pytest.approx(result.loss))
    assert events.Scalars("eval/rows")[0].value == 10

    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert [float(r["value"]) for r in rows if r["name"] == "train/loss"] == pytest.approx(losses)
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 4]  # every 2nd step, and the evaluation
    assert lines[-1]["eval/loss"] == pytest.approx(result.loss)


def test_a_logger_without_the_protocol_is_refused() -> None:
    engine, _ = _engine()
    with pytest.raises(
        ConfigError,
        match=r"add_logger\(\) takes an object with log_metrics\(step, metrics\) "
        r"and close\(\); dict has no log_metrics or close",
    ):
        engine.add_logger({})
    with pytest.raises(ConfigError, match=r"every must be a positive integer, got 0"):
        engine.add_logger(JSONLLogger("/dev/null"), every=0)


def test_the_library_logs_on_rank_0_through_logging(tmp_path: Path) -> None:
    """Without an application's logging configuration, rank 0's messages reach stdout as they are;
    VARUNA_LOG_LEVEL=WARNING silences them; a bad level is a typed error."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from varuna import Varuna\n"
        "from varuna.data import SyntheticLM, collate\n"
        "from varuna.models import GPT, gpt_tiny\n"
        "cfg = gpt_tiny(); data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 16)\n"
        "kw = dict(global_batch_size=4, micro_batch_size=2, example_batch=collate([data[0], data[1]]))\n"
        "e = Varuna(GPT(cfg), run_dir=r'RUN', **kw)\n"
        "e.set_optimizer(torch.optim.SGD(e.parameters(), lr=0.1)); e.step(e.batch(data, 0)); e.checkpoint()\n"
        "Varuna(GPT(cfg), run_dir=r'RUN', resume='latest', **kw)\n".replace("RUN", str(tmp_path / "run"))
    )

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        import os

        return subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdin=subprocess.DEVNULL,
        )

    shown = run()
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "varuna: resumed from " in shown.stdout and " at step 1" in shown.stdout
    quiet = run(VARUNA_LOG_LEVEL="warning")
    assert quiet.returncode == 0 and "resumed from" not in quiet.stdout + quiet.stderr
    bad = run(VARUNA_LOG_LEVEL="chatty")
    assert bad.returncode != 0
    assert "VARUNA_LOG_LEVEL='chatty' is not a logging level; use DEBUG, INFO, WARNING" in bad.stderr
