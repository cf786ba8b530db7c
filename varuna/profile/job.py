"""The `varuna profile` command: launch a training script and profile the model it builds.

    varuna profile --gpus 2 train.py --lr 3e-4
      -> launch_profile(...)            the launcher starts `python -m varuna.profile.job train.py ...`
                                        on every rank, with VARUNA_PROFILE=1
      -> main() on every rank           runs train.py with `varuna.Varuna` replaced by a stand-in
                                        that captures (model, example_batch, precision) and stops it
      -> varuna.profile.measure.run_profile     network on all ranks, the model on rank 0,
                                        RUN_DIR/profile.json

The script needs no change. Code before `Varuna(...)` runs as usual (a script may test
``VARUNA_PROFILE`` to skip set-up the profile does not need); nothing after it runs.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from varuna.errors import ConfigError, check_int
from varuna.profile.measure import PROFILE_FILE, check_sizes, run_profile

__all__ = ["main", "launch_profile", "parse_sizes"]


class _Captured(BaseException):
    """Raised by the stand-in `Varuna` to stop the user's script once the model is in hand."""

    def __init__(self, model: nn.Module, options: dict[str, Any]) -> None:
        super().__init__("varuna profile captured the model")
        self.model, self.options = model, options


class _StandIn:
    """Takes the place of `varuna.Varuna` while ``python -m varuna.profile.job`` runs a script."""

    def __init__(self, model: nn.Module, **options: Any) -> None:
        raise _Captured(model, options)


def _capture(argv: list[str]) -> tuple[nn.Module, dict[str, Any]]:
    """Run ``script.py args`` (or ``-m module args``) until it constructs `varuna.Varuna`."""
    import varuna
    import varuna.engine.engine
    from varuna.launch.worker import run_target

    saved = (varuna.__dict__.get("Varuna"), varuna.engine.engine.Varuna)
    varuna.Varuna = varuna.engine.engine.Varuna = _StandIn  # type: ignore[misc,assignment]
    try:
        run_target(argv)
    except _Captured as got:
        return got.model, got.options
    finally:
        varuna.engine.engine.Varuna = saved[1]  # type: ignore[misc]
        if saved[0] is None:
            del varuna.Varuna
        else:
            varuna.Varuna = saved[0]  # type: ignore[misc]
    raise ConfigError(
        f"{' '.join(argv)} finished without constructing varuna.Varuna(...); `varuna profile` profiles the "
        "model a training script gives Varuna (with example_batch=...)"
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m varuna.profile.job script.py args``: what `varuna profile` runs on every rank.

    Settings come from the environment `launch_profile` sets: ``VARUNA_PROFILE_MBS`` (micro-batch
    sizes, "1,2,4") and ``VARUNA_PROFILE_REPEATS`` (3).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m varuna.profile.job (script.py | -m module) [args ...]")
    from varuna.engine.engine import Varuna  # the real class again, once the script was captured

    model, options = _capture(argv)
    batch = options.get("example_batch")
    if batch is None:
        raise ConfigError(
            "varuna profile needs the batch to profile: pass example_batch=<one batch dict> to Varuna(...)"
        )
    run_profile(
        model,
        batch,
        micro_batch_sizes=parse_sizes(os.environ.get("VARUNA_PROFILE_MBS", "1,2,4")),
        precision=str(options.get("precision", "fp32")),
        repeats=int(os.environ.get("VARUNA_PROFILE_REPEATS", "3")),
        engine=Varuna,
    )


def parse_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; ConfigError naming the flag on anything else."""
    try:
        return check_sizes([int(part) for part in text.split(",") if part.strip()])
    except ValueError:
        raise ConfigError(
            f"--micro-batch-sizes {text!r}: give comma-separated positive integers, e.g. 1,2,4"
        ) from None


def launch_profile(
    script_argv: list[str],
    *,
    gpus: int = 2,
    run_dir: Path | None = None,
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 3,
    hostfile: Path | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run ``varuna profile``: `script_argv` on `gpus` ranks under the launcher; return the exit code.

    The ranks are laid out as one pipeline of `gpus` stages (``VARUNA_PIPELINE=gpus``); the table
    lands in ``run_dir/profile.json`` (default ``runs/profile-<time>``).
    """
    from varuna.launch.job import run_job

    check_int(
        gpus, "--gpus", minimum=2, message=f"--gpus {gpus!r}: profiling the network needs at least 2 ranks"
    )
    if not script_argv or script_argv == ["-m"]:
        raise ConfigError("nothing to profile: give the training script (`varuna profile train.py ...`)")
    if script_argv[0] != "-m" and not Path(script_argv[0]).is_file():
        raise ConfigError(f"script not found: {script_argv[0]} (relative to {os.getcwd()})")
    sizes = check_sizes(micro_batch_sizes)
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: time at least one pass per micro-batch size")
    run_dir = Path(run_dir) if run_dir is not None else Path("runs") / time.strftime("profile-%Y%m%d-%H%M%S")
    env = {
        "VARUNA_PROFILE": "1",
        "VARUNA_PROFILE_MBS": ",".join(map(str, sizes)),
        "VARUNA_PROFILE_REPEATS": str(repeats),
    }
    code = run_job(
        ["-m", "varuna.profile.job", *script_argv],
        pipeline=gpus,
        data=1,
        run_dir=run_dir,
        hostfile=hostfile,
        extra_env=env,
        timeout_s=timeout_s,
    )
    if code == 0:
        print(f"varuna: profile in {run_dir / PROFILE_FILE}", file=sys.stderr)
    return code


if __name__ == "__main__":  # `python -m varuna.profile.job script.py ...`, as `varuna profile` runs it
    main()
