"""Fault-bench cases on checkpoints: forged files, `latest` pointing elsewhere, damage, a full disk,
retention. Each runs the real engine in this process (world size 1) on a copy of one run directory
that holds step-00000001 and step-00000002 (latest)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from varuna.bench.faults.case import Case, Result, first_line, raises, warned


def engine(run_dir: Path, **kw: Any) -> tuple[Any, Any]:
    """A one-process tiny GPT engine with AdamW, and its synthetic data."""
    import torch

    from varuna import Varuna
    from varuna.data import SyntheticLM, collate
    from varuna.models import GPT, gpt_tiny

    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    eng = Varuna(
        GPT(cfg),
        global_batch_size=4,
        micro_batch_size=2,
        run_dir=run_dir,
        example_batch=collate([data[0], data[1]]),
        **kw,
    )
    eng.set_optimizer(torch.optim.AdamW(eng.parameters(), lr=1e-2))
    return eng, data


def two_checkpoints(tmp: Path) -> Path:
    """A run directory with step-00000001 and step-00000002, made once and copied per case."""
    template = tmp.parent / "two-checkpoints"
    if not (template / "checkpoints" / "latest").exists():
        eng, data = engine(template)
        for k in range(2):
            eng.step(eng.batch(data, k))
            eng.checkpoint()
        eng.close()
    run = tmp / "run"
    shutil.copytree(template, run)
    return run


class _Plant:
    """Unpickling this creates a file: the proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _forge(checkpoint: Path, fname: str, data: bytes) -> None:
    """Put `data` in `fname` and make the manifest agree (size and CRC-32), as an attacker would."""
    from varuna.checkpoint import storage as cio

    (checkpoint / fname).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][fname] = {"bytes": len(data), "crc32": cio.file_crc(checkpoint / fname)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _marker(marker: Path) -> str:
    return "marker file PRESENT (code ran)" if marker.exists() else "marker file absent"


def forged_dcp_metadata(tmp: Path) -> Result:
    import varuna
    from varuna.checkpoint import layout as ckpt

    run = two_checkpoints(tmp)
    saved, marker = run / "checkpoints" / "step-00000002", tmp / "pwned"
    _forge(saved, ".metadata", pickle.dumps(_Plant(marker)))
    ckpt.verify(saved, deep=True)
    eng, _ = engine(run, resume="latest")
    step = eng.step_count
    eng.close()
    varuna.consolidate(saved, tmp / "out.safetensors")
    return step == 2 and not marker.exists(), f"verify, resume (step {step}), consolidate: {_marker(marker)}"


def pickle_in_place_of(fname: str, pattern: str) -> Callable[[Path], Result]:
    def case(tmp: Path) -> Result:
        from varuna.errors import CheckpointError

        run = two_checkpoints(tmp)
        saved, marker = run / "checkpoints" / "step-00000002", tmp / "pwned"
        _forge(saved, fname, pickle.dumps(_Plant(marker)))
        ok, seen = raises(lambda: engine(run, resume=saved), CheckpointError, pattern)
        return ok and not marker.exists(), f"{seen}; {_marker(marker)}"

    return case


def latest_pointing(pointer: str | None) -> Callable[[Path], Result]:
    """`latest` names `pointer`, or (None) a symlinked step directory outside checkpoints/."""

    def case(tmp: Path) -> Result:
        from varuna.checkpoint import layout as ckpt

        run = two_checkpoints(tmp)
        root = run / "checkpoints"
        name = pointer
        if name is None:
            outside = tmp / "elsewhere" / "step-00000009"
            shutil.copytree(root / "step-00000002", outside)  # complete, but not this run's
            (root / "step-00000009").symlink_to(outside)
            name = "step-00000009"
        (root / "latest").write_text(name + "\n")
        got, said = warned(lambda: ckpt.resolve("latest", run))
        ok = got == root / "step-00000002" and len(said) == 1 and "latest" in said[0]
        return ok, f"resolved to {got.name if got else None}; warned: {said[0] if said else 'nothing'}"

    return case


def damaged_latest(tmp: Path) -> Result:
    run = two_checkpoints(tmp)
    data = next((run / "checkpoints" / "step-00000002").glob("*.distcp"))
    os.truncate(data, data.stat().st_size - 1)
    eng, said = warned(lambda: engine(run, resume="latest")[0])
    step = eng.step_count
    eng.close()
    named = [s for s in said if "step-00000001" in s]
    return step == 1 and bool(named), f"resumed at step {step}; warned: {named[0] if named else said}"


def full_disk(tmp: Path) -> Result:
    """The data file is a link to /dev/full when it is written: the kernel's own ENOSPC."""
    from varuna.checkpoint import layout as ckpt
    from varuna.checkpoint import storage as cio
    from varuna.errors import CheckpointError

    run = two_checkpoints(tmp)
    root = run / "checkpoints"
    before = sorted(p.name for p in root.iterdir())
    real_write = cio.Writer.write_data

    def write_to_full_disk(self: Any, plan: Any, planner: Any) -> Any:
        (Path(self.path) / "__0_0.distcp").symlink_to("/dev/full")
        return real_write(self, plan, planner)

    eng, data = engine(run, resume="latest")
    eng.step(eng.batch(data, 2))
    cio.Writer.write_data = write_to_full_disk  # type: ignore[method-assign]
    try:
        ok, seen = raises(
            eng.checkpoint, CheckpointError, r"No space left on device \(ENOSPC\).*not committed"
        )
    finally:
        cio.Writer.write_data = real_write  # type: ignore[method-assign]
        eng.close()
    after = sorted(p.name for p in root.iterdir())
    try:
        ckpt.verify(root / "step-00000002", deep=True)
        intact = "step-00000002 verifies"
    except Exception as exc:  # noqa: BLE001
        intact = f"step-00000002 damaged ({first_line(exc)})"
    ok = ok and after == before and intact.endswith("verifies")
    return ok, f"{seen}; left {after}; {intact}"


def retention_after_older_resume(tmp: Path) -> Result:
    from varuna.checkpoint import layout as ckpt

    run = tmp / "run"
    eng, data = engine(run, checkpoint_keep=3)
    for k in range(4):
        eng.step(eng.batch(data, k))
        if k != 1:
            eng.checkpoint()  # steps 1, 3, 4
    eng.close()
    root = run / "checkpoints"
    eng, data = engine(run, resume=root / "step-00000001", checkpoint_keep=2)
    eng.step(eng.batch(data, 1))
    eng.checkpoint()  # step 2, older than 3 and 4
    eng.close()
    names = ckpt.checkpoint_names(root)
    latest = (root / "latest").read_text().strip()
    ok = "step-00000002" in names and latest == "step-00000002" and len(names) == 2
    return ok, f"kept {names}, latest -> {latest}"


def cases() -> list[Case]:
    refused_meta = r"metadata.json is not JSON .*never unpickled"
    return [
        Case(
            "forged .metadata pickle",
            "attack",
            "never unpickled: verify/resume/consolidate work, marker file absent",
            forged_dcp_metadata,
        ),
        Case(
            "pickle as metadata.json",
            "attack",
            "CheckpointError: not JSON, never unpickled; no code ran",
            pickle_in_place_of("metadata.json", refused_meta),
        ),
        Case(
            "pickle as extra.json",
            "attack",
            "CheckpointError: extra.json cannot be read; no code ran",
            pickle_in_place_of("extra.json", r"extra.json cannot be read"),
        ),
        Case(
            "latest -> ../../outside",
            "attack",
            "ignored with a warning; newest valid step-00000002",
            latest_pointing("../../outside"),
        ),
        Case(
            "latest -> /tmp (absolute)",
            "attack",
            "ignored with a warning; newest valid step-00000002",
            latest_pointing("/tmp"),
        ),
        Case(
            "latest -> symlink out of checkpoints/",
            "attack",
            "symlink not followed; warning; step-00000002",
            latest_pointing(None),
        ),
        Case(
            "damaged latest (truncated data)",
            "fault",
            "warning names the fallback; resume at step 1",
            damaged_latest,
        ),
        Case(
            "ENOSPC during a checkpoint",
            "fault",
            "CheckpointError (ENOSPC); previous checkpoint intact; no leftovers",
            full_disk,
        ),
        Case(
            "retention after resuming an older step",
            "fault",
            "the checkpoint just committed kept; latest names it",
            retention_after_older_resume,
        ),
    ]
