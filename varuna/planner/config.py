"""The planner's settings, used when pipeline="auto" chooses the shape."""

from __future__ import annotations

from dataclasses import dataclass

from varuna.errors import ConfigError

__all__ = ["PlannerConfig"]


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    memory_limit: int | str | None = None
    """Memory per device that pipeline="auto" plans for ("16GiB" or bytes); None: the CUDA device's
    total, or on CPU the host's RAM shared by the ranks."""

    def __post_init__(self) -> None:
        if self.memory_limit is not None:
            from varuna.planner.memory import parse_memory

            try:
                parse_memory(self.memory_limit)
            except ConfigError as exc:  # PlanError is a ConfigError; it names the format
                raise type(exc)(f"memory_limit={self.memory_limit!r}: {exc}") from None
