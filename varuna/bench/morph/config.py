"""The morph benchmark's settings (`MorphBench`) and presets, apart from `varuna.bench.morph.driver`,
which runs it, so that the job runner and the report can name the settings without importing the bench."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from varuna.bench import require_positive
from varuna.errors import ConfigError

__all__ = ["MorphBench", "full", "quick", "TARGET_REQUEST_TO_STEP_S", "TARGET_WRITE_FRACTION"]

TARGET_REQUEST_TO_STEP_S = 20.0
TARGET_WRITE_FRACTION = 0.5


@dataclass(kw_only=True, slots=True)
class MorphBench:
    """What the morph benchmark measures; see `full` and `quick` for the presets."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `varuna.models.GPTConfig`."""
    global_batch_size: int = 4
    """Samples per optimizer step, the same in both shapes."""
    micro_batch_size: int = 1
    """Samples per micro-batch."""
    start_shape: tuple[int, int] = (2, 1)
    """P x D the job starts with."""
    to_shape: tuple[int, int] = (1, 2)
    """P x D the resize asks for."""
    steps_before: int = 2
    """Steps logged before the resize is requested (the request then lands in the next step)."""
    steps_after: int = 2
    """Steps the relaunched job runs before it ends."""
    max_steps: int = 40
    """A first launch that sees no stop request ends after this many steps (the bench then fails)."""
    job_timeout_s: float = 240.0
    """The whole elastic job (both launches) runs at most this long, or the bench fails naming it."""
    plain_write_repeats: int = 3
    """Plain sequential writes after the job; `plain_write_mb_s` is their median."""
    plain_write_settle_s: float = 3.0
    """Seconds between the job's end and the plain writes, so that the memory its exit freed is no
    longer at hand and the writes get new pages, as the checkpoint did."""
    early_checkpoint_step: int | None = None
    """If set, the first launch also checkpoints after this step, before the resize, as periodic
    checkpointing would (the morph's checkpoint is then not the first one of its processes)."""

    def __post_init__(self) -> None:
        require_positive(
            self,
            "global_batch_size",
            "micro_batch_size",
            "steps_before",
            "steps_after",
            "plain_write_repeats",
        )
        if self.max_steps <= self.steps_before:
            raise ConfigError(
                f"MorphBench.max_steps ({self.max_steps}) must exceed steps_before ({self.steps_before})"
            )
        if not self.plain_write_settle_s >= 0:
            raise ConfigError(
                f"MorphBench.plain_write_settle_s must be >= 0 seconds (got {self.plain_write_settle_s!r})"
            )
        early = self.early_checkpoint_step
        if early is not None and not 0 <= early < self.steps_before:
            raise ConfigError(
                f"MorphBench.early_checkpoint_step ({early}) must be in [0, steps_before) = [0, {self.steps_before}): "
                "it has to happen before the resize"
            )
        for name in ("start_shape", "to_shape"):
            P, D = getattr(self, name)
            if P < 1 or D < 1 or self.global_batch_size % (D * self.micro_batch_size):
                raise ConfigError(
                    f"MorphBench.{name} = {P}x{D}: global_batch_size ({self.global_batch_size}) must be a "
                    f"multiple of data x micro_batch_size ({D} x {self.micro_batch_size})"
                )


def full() -> MorphBench:
    """A ~98M-parameter GPT (d_model 768, 12 blocks, 12 heads, vocab 16384, seq 64), batch 4 of 1, 2x1 -> 1x2."""
    return MorphBench(model={"vocab_size": 16384, "seq_len": 64, "d_model": 768, "n_layer": 12, "n_head": 12})


def quick() -> MorphBench:
    """`gpt_tiny()`, 2 steps at 2x1, resize to 1x2, 1 step: every path in well under a minute."""
    from varuna.models import gpt_tiny

    return MorphBench(
        model=asdict(gpt_tiny()),
        steps_after=1,
        job_timeout_s=150.0,
        plain_write_repeats=1,
        plain_write_settle_s=1.0,
    )
