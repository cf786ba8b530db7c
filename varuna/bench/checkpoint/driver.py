"""`varuna bench checkpoint`: what a background checkpoint costs the training steps, against a blocking one.

    python -m varuna.bench checkpoint --json     # ~6.9M-parameter GPT, 3 rounds
    python -m varuna.bench checkpoint --quick    # tiny GPT, one round: a smoke run of every path

One process, one rank (1x1, one torch thread), so that the background writer has the host's other
core(s) to itself and competes with training only for memory bandwidth, the disk and the GIL (the
writer's file writes and CRC-32s release it). Each round runs three segments, one per mode, each with a
fresh engine, a fresh run directory (removed afterwards), and the same weights, data and seed:

    none        step, step, step, ...                              no checkpoint
    background  step, step, ... step + checkpoint(blocking=False)  every `checkpoint_every` steps
    blocking    step, step, ... step + checkpoint()                 every `checkpoint_every` steps

Every step is timed (`time.perf_counter`) together with the checkpoint call that follows it; the batch
is made before the clock starts. A background checkpoint's call copies the state and returns (it
first waits for the previous write, if that is still going: part of what it costs); its write goes on
while the next steps run, so those steps carry its interference. The first `warmup` steps of a
segment are not counted. The order of the modes rotates from round to round, so that a drift of the
machine (its clock, its page cache) favours none of them.

Each background checkpoint's record (`copy_s`: the copy the step waited for; `seconds`: from the copy
to the commit) is read from `engine.last_checkpoint` after the timed step that ended its wait (the
engine waits for a finished write at the next `step` or `checkpoint`), and the last from
`wait_checkpoint()` after the segment; every record is a committed checkpoint, and the bench fails if
one is missing. A mode's `overhead` is its mean step time over the mean step time without
checkpoints, minus one.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from varuna.bench import log, print_report, require_positive
from varuna.errors import CheckpointError, ConfigError

__all__ = ["CheckpointBench", "MODES", "full", "quick", "run", "format_table", "main"]

Mode = Literal["none", "background", "blocking"]
MODES: tuple[Mode, ...] = ("none", "background", "blocking")
"""The segments of a round: no checkpoint, `checkpoint(blocking=False)`, `checkpoint()`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointBench:
    """What the checkpoint benchmark measures; see `full` and `quick` for the presets."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `varuna.models.GPTConfig`."""
    global_batch_size: int = 8
    """Samples per optimizer step."""
    micro_batch_size: int = 2
    """Samples per micro-batch."""
    steps: int = 40
    """Steps per segment (one mode, one fresh engine)."""
    warmup: int = 5
    """The first steps of a segment, run but not counted."""
    checkpoint_every: int = 5
    """A checkpoint after every step s with (s + 1) % checkpoint_every == 0 (none in mode `none`)."""
    rounds: int = 3
    """Rounds of the three modes, each round in a rotated order."""
    lr: float = 1e-4
    """AdamW's learning rate."""
    seed: int = 0
    """Seed of the weights and the data, the same in every segment."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ConfigError naming the first setting that cannot be measured as asked."""
        require_positive(self, "global_batch_size", "micro_batch_size", "steps", "checkpoint_every", "rounds")
        name = type(self).__name__
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"{name}.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if (
            not isinstance(self.warmup, int)
            or isinstance(self.warmup, bool)
            or not 0 <= self.warmup < self.steps
        ):
            raise ConfigError(
                f"{name}.warmup must be an integer in [0, steps) = [0, {self.steps}) (got {self.warmup!r}): "
                "some steps must be counted"
            )
        counted = self.steps - self.warmup
        if not 2 <= self.checkpoint_every <= counted:
            raise ConfigError(
                f"{name}.checkpoint_every must be in [2, steps - warmup] = [2, {counted}] "
                f"(got {self.checkpoint_every}): the counted steps need one with a checkpoint and one without"
            )
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"{name}.lr must be a positive number (got {self.lr!r})")
        from varuna.models import GPTConfig

        try:
            GPTConfig(**self.model)
        except TypeError as exc:
            fields = ", ".join(GPTConfig.__dataclass_fields__)
            raise ConfigError(f"{name}.model: {exc}; GPTConfig's fields are {fields}") from None
        except ConfigError as exc:
            raise ConfigError(f"{name}.model: {exc}") from None


def full() -> CheckpointBench:
    """A ~6.9M-parameter GPT (vocab 8192, seq 64, d_model 256, 6 blocks, 8 heads), batch 8 of 2;
    40 steps (5 warmup) per segment with a checkpoint every 5 steps; 3 rounds."""
    return CheckpointBench(
        model={"vocab_size": 8192, "seq_len": 64, "d_model": 256, "n_layer": 6, "n_head": 8}
    )


def quick() -> CheckpointBench:
    """A tiny GPT (vocab 256, seq 16, d_model 32, 2 blocks, 2 heads), 12 steps with a checkpoint every
    3, one round: every path in seconds. The 3 warmup steps hold the first checkpoint of each segment."""
    return CheckpointBench(
        model={"vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 2},
        steps=12,
        warmup=3,
        checkpoint_every=3,
        rounds=1,
    )


# --------------------------------------------------------------------------------------- measuring


def _segment(bench: CheckpointBench, mode: Mode, data: Any, example: dict[str, Any]) -> dict[str, Any]:
    """Train one fresh engine for `bench.steps` steps in `mode`; the counted steps' times, which of
    them held a checkpoint call, the calls' times and the committed checkpoints' records."""
    import torch

    from varuna import Varuna
    from varuna.models import GPT, GPTConfig

    run_dir = Path(tempfile.mkdtemp(prefix="varuna-bench-checkpoint-"))
    engine = None
    try:
        torch.manual_seed(bench.seed)
        engine = Varuna(
            GPT(GPTConfig(**bench.model)),
            global_batch_size=bench.global_batch_size,
            micro_batch_size=bench.micro_batch_size,
            pipeline=1,
            run_dir=run_dir,
            example_batch=example,
        )
        engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=bench.lr))
        params = sum(p.numel() for p in engine.parameters())
        step_s: list[float] = []
        with_checkpoint: list[bool] = []
        call_s: list[float] = []
        records: dict[int, dict[str, Any]] = {}
        for s in range(bench.steps):
            due = mode != "none" and (s + 1) % bench.checkpoint_every == 0
            batch = engine.batch(data, s, seed=bench.seed)
            t0 = time.perf_counter()
            engine.step(batch)
            t1 = time.perf_counter()
            if due:
                engine.checkpoint(blocking=mode == "blocking")
            t2 = time.perf_counter()
            if s >= bench.warmup:
                step_s.append(t2 - t0)
                with_checkpoint.append(due)
                if due:
                    call_s.append(t2 - t1)
            record = engine.last_checkpoint  # a background write's, once a step or checkpoint waited
            if record is not None:
                records[record["step"]] = record
        record = engine.wait_checkpoint()
        if record is not None:
            records[record["step"]] = record
    finally:
        if engine is not None:
            engine.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    expected = [s + 1 for s in range(bench.steps) if mode != "none" and (s + 1) % bench.checkpoint_every == 0]
    if sorted(records) != expected:
        raise CheckpointError(
            f"checkpoint bench, mode {mode}: committed checkpoints after steps {sorted(records)}, "
            f"expected one after each of steps {expected}: a record was lost, see the engine's log"
        )
    return {
        "params": params,
        "step_s": step_s,
        "with_checkpoint": with_checkpoint,
        "call_s": call_s,
        "records": [records[s] for s in expected],
    }


def _sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits (plain decimals in JSON down to 1e-4)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def _mode_report(bench: CheckpointBench, mode: Mode, segments: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over its segments (one per round)."""
    per_round = [statistics.mean(seg["step_s"]) for seg in segments]
    out: dict[str, Any] = {
        "step_s": [_sig(t) for t in per_round],
        "step_s_mean": _sig(statistics.mean(per_round)),
    }
    if mode == "none":
        return out
    timed = [(t, c) for seg in segments for t, c in zip(seg["step_s"], seg["with_checkpoint"])]
    calls = [t for seg in segments for t in seg["call_s"]]
    counted = [r for seg in segments for r in seg["records"] if r["step"] > bench.warmup]
    out |= {
        "checkpoints": sum(len(seg["records"]) for seg in segments),
        "checkpoint_step_s": _sig(statistics.mean(t for t, c in timed if c)),
        "other_step_s": _sig(statistics.mean(t for t, c in timed if not c)),
        "call_s": _sig(statistics.mean(calls)),
    }
    if mode == "background":
        out["copy_s"] = _sig(statistics.mean(r["copy_s"] for r in counted))
        out["write_s"] = _sig(statistics.mean(r["seconds"] for r in counted))
    else:
        out["write_s"] = out["call_s"]
    return out


def run(bench: CheckpointBench) -> dict[str, Any]:
    """Run `bench.rounds` rounds of the three modes; the report (a JSON-able dict)."""
    import torch

    from varuna.data import SyntheticLM, collate

    bench.check()
    wall0 = time.perf_counter()
    torch.set_num_threads(1)
    cfg = bench.model
    data = SyntheticLM(
        cfg.get("vocab_size", 256),
        cfg.get("seq_len", 64),
        bench.steps * bench.global_batch_size,
        seed=bench.seed,
    )
    example = collate([data[i] for i in range(bench.micro_batch_size)])
    segments: dict[Mode, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for r in range(bench.rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for mode in order:
            t0 = time.perf_counter()
            seg = _segment(bench, mode, data, example)
            segments[mode].append(seg)
            log(
                f"checkpoint: round {r + 1}/{bench.rounds} {mode:<10} mean step "
                f"{statistics.mean(seg['step_s']) * 1e3:.2f} ms ({time.perf_counter() - t0:.1f} s)"
            )
    modes = {mode: _mode_report(bench, mode, segments[mode]) for mode in MODES}
    base = modes["none"]["step_s_mean"]
    for mode in ("background", "blocking"):
        modes[mode]["overhead"] = round(modes[mode]["step_s_mean"] / base - 1, 4)
    blocking = modes["blocking"]["overhead"]
    ratio = modes["background"]["overhead"] / blocking if blocking > 0 else None
    record = segments["blocking"][0]["records"][0]
    return {
        "bench": "checkpoint",
        "date": time.strftime("%Y-%m-%d"),
        "settings": asdict(bench),
        "params": segments["none"][0]["params"],
        "checkpoint_bytes": record["bytes"],
        "modes": modes,
        "background_over_blocking": None if ratio is None else _sig(ratio),
        "seconds": round(time.perf_counter() - wall0, 1),
    }


def format_table(report: dict[str, Any]) -> str:
    """The per-mode figures as aligned text."""
    st, modes = report["settings"], report["modes"]
    lines = [
        f"checkpoint bench: GPT {report['params'] / 1e6:.2f}M params, 1x1, batch {st['global_batch_size']} "
        f"of {st['micro_batch_size']}, a checkpoint ({report['checkpoint_bytes'] / 2**20:.1f} MiB) every "
        f"{st['checkpoint_every']} steps, {st['steps'] - st['warmup']} counted steps x {st['rounds']} rounds",
        f"  {'mode':<11}{'step ms':>9}{'overhead':>10}{'ckpt step ms':>14}{'other ms':>10}"
        f"{'call ms':>9}{'copy ms':>9}{'write ms':>10}",
    ]

    def ms(m: dict[str, Any], key: str) -> str:
        return f"{m[key] * 1e3:.2f}" if key in m else "-"

    for mode in MODES:
        m = modes[mode]
        overhead = f"{m['overhead'] * 100:+.2f}%" if "overhead" in m else "-"
        lines.append(
            f"  {mode:<11}{ms(m, 'step_s_mean'):>9}{overhead:>10}{ms(m, 'checkpoint_step_s'):>14}"
            f"{ms(m, 'other_step_s'):>10}{ms(m, 'call_s'):>9}{ms(m, 'copy_s'):>9}{ms(m, 'write_s'):>10}"
        )
    ratio = report["background_over_blocking"]
    lines.append(
        "  background overhead / blocking overhead: "
        + (f"{ratio:.3f}" if ratio is not None else "n/a (blocking's overhead <= 0)")
    )
    lines.append(f"  wall {report['seconds']:.1f} s")
    return "\n".join(lines)


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench checkpoint`; `args` has `json` and `quick`."""
    report = run(quick() if args.quick else full())
    return print_report(report, format_table(report), args.json)
