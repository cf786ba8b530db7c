"""The elastic settings of a job: what a stop request (signal, resize, controller) does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from varuna.errors import ConfigError

__all__ = ["ElasticConfig"]


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    on_stop: Literal["exit", "flag"] = "exit"
    """On a stop request: checkpoint and exit with MORPH_EXIT, or only set `engine.should_stop` and
    let the script decide."""

    def __post_init__(self) -> None:
        if self.on_stop not in ("exit", "flag"):
            raise ConfigError(f"on_stop={self.on_stop!r}: use 'exit' or 'flag'")
