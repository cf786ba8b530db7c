"""``python -m varuna.bench standin``: what the stand-ins cost a stage's forward on real models.

A stage runs the user's whole forward: before its input CutPoint, glue code on stand-ins and
skipped modules inferred on meta (`varuna.cut.standin`); then its own modules; it stops at its output
CutPoint. This bench cuts transformers GPT-2 and Llama (12 blocks by default) with `auto_cut`, runs
them at P = 2 and P = 4 with even stages in real `varuna run` jobs, and times each stage's forward
with the stand-in work measured inside it. ``overhead`` is stand-in time over the rest of the
forward (the stage's own modules and its glue on real values); the issue's bound is 5%.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from varuna.bench import bench_env, log, print_report, require_positive
from varuna.errors import ConfigError, LaunchError

__all__ = ["StandinBench", "full", "quick", "run", "format_table", "main"]


@dataclass(kw_only=True, slots=True)
class StandinBench:
    """What the bench runs."""

    models: tuple[str, ...] = ("gpt2", "llama")
    blocks: int = 12
    d_model: int = 256
    seq_len: int = 128
    micro_batch: int = 4
    vocab: int = 512
    repeats: int = 10
    pipelines: tuple[int, ...] = (2, 4)

    def __post_init__(self) -> None:
        require_positive(self, "blocks", "d_model", "seq_len", "micro_batch", "vocab", "repeats")
        unknown = [m for m in self.models if m not in ("gpt2", "llama")]
        if unknown or not self.models:
            raise ConfigError(
                f"StandinBench.models must name 'gpt2' and/or 'llama' (got {list(self.models)})"
            )
        for p in self.pipelines:
            if not isinstance(p, int) or p < 2 or self.blocks % p:
                raise ConfigError(
                    f"StandinBench.pipelines must be integers >= 2 dividing blocks={self.blocks} (got {p!r})"
                )


def full() -> StandinBench:
    return StandinBench()


def quick() -> StandinBench:
    return StandinBench(blocks=4, d_model=64, seq_len=16, micro_batch=2, vocab=96, repeats=3, pipelines=(2,))


def run(bench: StandinBench) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the stand-in bench needs the transformers package: pip install transformers"
        ) from None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="varuna-standin-") as tmp:
        for p in bench.pipelines:
            log(f"P={p}: {', '.join(bench.models)} with {bench.blocks} blocks")
            out = Path(tmp) / f"p{p}"
            out.mkdir()
            spec = json.dumps(asdict(bench) | {"pipeline": p})
            cmd = [
                sys.executable,
                "-m",
                "varuna",
                "run",
                "--pipeline",
                str(p),
                "--data",
                "1",
                "--run-dir",
                str(Path(tmp) / f"run{p}"),
                "-m",
                "varuna.bench.standin.worker",
                spec,
                str(out),
            ]
            env = bench_env(300) | {"TRANSFORMERS_VERBOSITY": "error"}
            proc = subprocess.run(
                cmd, env=env, cwd=tmp, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900
            )
            if proc.returncode != 0:
                raise LaunchError(
                    f"the P={p} stand-in job failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
                )
            for f in sorted(out.glob("rank*.json")):
                rows += json.loads(f.read_text())
    rows.sort(key=lambda r: (r["model"], r["pipeline"], r["stage"]))
    worst = {m: max(r["overhead"] for r in rows if r["model"] == m) for m in bench.models}
    return {"bench": "standin", "config": asdict(bench), "stages": rows, "max_overhead": worst}


def format_table(report: dict[str, Any]) -> str:
    lines = ["model  P  stage  forward ms  stand-in ms  overhead"]
    for r in report["stages"]:
        lines.append(
            f"{r['model']:<6} {r['pipeline']}  {r['stage']:>5}  {r['forward_ms']:>10.1f}  "
            f"{r['standin_ms']:>11.2f}  {100 * r['overhead']:>7.2f}%"
        )
    lines.append(
        "max overhead: " + ", ".join(f"{m} {100 * v:.2f}%" for m, v in report["max_overhead"].items())
    )
    return "\n".join(lines)


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench standin`; `args` has `json` and `quick`."""
    report = run(quick() if args.quick else full())
    return print_report(report, format_table(report), args.json)
