"""Training metrics out to where people read them: TensorBoard, CSV, JSON lines, or your own tracker.

    engine.add_logger(varuna.metrics.TensorBoardLogger("runs/gpt/tb"))
    engine.add_logger(varuna.metrics.JSONLLogger("runs/gpt/metrics.jsonl"), every=10)

After every `every`-th step the engine hands each logger (on rank 0, unless added with
`all_ranks=True`) the step's figures, and after `evaluate` the evaluation's:

    train/loss  train/grad_norm  train/lr  train/step_time_s  train/samples_per_s  train/skipped
    eval/loss   eval/samples     eval/<each name your metrics function returned>

A logger is anything with `log_metrics(step, metrics)` and `close()` (`MetricsLogger`); the engine
closes its loggers in `engine.close()`. Weights & Biases or MLflow in three lines (docs/logging.md):

    class WandbLogger:
        def __init__(self, **kw): self.run = wandb.init(**kw)
        def log_metrics(self, step, metrics): self.run.log(dict(metrics), step=step)
        def close(self): self.run.finish()
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from varuna.errors import ConfigError

__all__ = ["MetricsLogger", "TensorBoardLogger", "CSVLogger", "JSONLLogger", "check_logger"]


@runtime_checkable
class MetricsLogger(Protocol):
    """What `engine.add_logger` takes."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` (name -> number) as of optimizer step `step`."""
        ...

    def close(self) -> None:
        """Flush and release whatever the logger holds (called by `engine.close()`)."""
        ...


def check_logger(logger: Any) -> MetricsLogger:
    """`logger`, or a ConfigError saying what a logger needs."""
    if not isinstance(logger, MetricsLogger):
        missing = [m for m in ("log_metrics", "close") if not callable(getattr(logger, m, None))]
        raise ConfigError(
            f"add_logger() takes an object with log_metrics(step, metrics) and close(); "
            f"{type(logger).__name__} has no {' or '.join(missing)} (see varuna.metrics: TensorBoardLogger, "
            "CSVLogger, JSONLLogger)"
        )
    return logger


class JSONLLogger:
    """One JSON object per call, `{"step": 3, "time": ..., "train/loss": 2.31, ...}`, appended to `path`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class CSVLogger:
    """Rows of `step,time,name,value` appended to `path` (a header on a new file): one row per metric,
    so metrics that appear later (an evaluation) need no new column."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["step", "time", "name", "value"])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        now = time.time()
        for name, value in metrics.items():
            self._writer.writerow([step, f"{now:.3f}", name, float(value)])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """Scalars in TensorBoard event files under `log_dir` (`torch.utils.tensorboard`; needs the
    `tensorboard` package)."""

    def __init__(self, log_dir: str | os.PathLike[str], *, flush_s: float = 10.0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                f"TensorBoardLogger needs the tensorboard package ({exc}); pip install tensorboard, or use "
                "varuna.metrics.JSONLLogger / CSVLogger"
            ) from None
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=max(int(flush_s), 1))

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
