"""Checkpoints keyed by parameter name, so one saved at P x D loads at any P' x D'.

Layout under the run directory:

    checkpoints/
      step-00000012/            a committed checkpoint (renamed from .step-00000012.tmp when complete)
        metadata.json           every key's shape and dtype, and where its bytes lie (file, offset,
                                length, CRC-32 of the bytes): DCP's metadata, as JSON, not a pickle
        __R_0.distcp            rank R's tensors, "model.<name>", "optim.<name>.<key>", "rng.rank<r>",
                                "buffer.<state_dict key>", their raw bytes one after the other —
                                replicated copies (data parallel, tied) written once
        extra.json              step, config, loss scale, LR scheduler, optimizer hyper-parameters,
                                the model's state_dict layout (for varuna.consolidate)
        manifest.json           every file with its size (and CRC-32 of the small ones), written last
      latest                    the name of the newest committed checkpoint, replaced atomically

Nothing in a checkpoint is unpickled: a forged file is a CheckpointError, never code
(`varuna.checkpoint._plain`). `latest` must name a `step-N` directory directly inside
`checkpoints/` (not a path, not a symbolic link).

A kill at any moment leaves `latest` on a complete checkpoint: the data goes to a temporary
directory, the manifest is written after every byte is fsynced, the directory is renamed, and
only then is `latest` replaced. Every byte that needs disk space (the new `latest` too) is written
before that rename, so a full disk fails the save on every rank before anything is committed,
and the temporary directory is removed. Re-saving a step swaps the new directory with the old
one in one rename (Linux RENAME_EXCHANGE), so `latest` never names a missing directory (a file
system without it gets rename-aside-then-replace, a short window). Retention keeps the checkpoint
just committed and the highest-numbered others. A `latest` naming a missing or damaged
checkpoint falls back to the highest-numbered complete one, with a warning naming both.

Loading checks the manifest on one rank (every file there with its size, `metadata.json` and
`extra.json` matching their CRC-32), then every tensor's bytes as they are read, against the
CRC-32 computed from memory when they were written (see `varuna.checkpoint.storage`): a
truncated or damaged file fails the load on every rank, naming it. `verify(path, deep=True)`
checks every byte of every file without loading.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from varuna.checkpoint import _plain
from varuna.checkpoint import storage as cio
from varuna.checkpoint._commit import NAME, SMALL, checkpoint_names, commit, remove
from varuna.errors import CheckpointError

__all__ = [
    "save",
    "resolve",
    "latest",
    "verify",
    "read_extra",
    "load_tensors",
    "stored_tensors",
    "checkpoint_names",
    "FORMAT",
]

FORMAT = cio.FORMAT
_OLD_FORMATS = (
    "checkpoints of format 2 and older keep their metadata as a pickle, which this Varuna does not load "
    "(unpickling can run code). Start without resume=, or, if you trust the checkpoint, export its weights "
    "with the Varuna that wrote it (`varuna consolidate`) and load them into the model before training"
)


def save(
    root: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    extra: dict[str, Any],
    *,
    rank: int,
    keep: int,
    group: Any = None,
) -> tuple[Path, int]:
    """Collective (over `group`, default every rank): write one checkpoint and commit it; returns its
    path and its size in bytes. A checkpoint written in a background thread while training goes on
    uses a group of its own, so that its collectives never interleave with the step's.

    Any failure (a full disk on any rank, a value that cannot be stored) is the same
    CheckpointError on every rank, with nothing committed and the temporary directory removed.
    """
    name = f"step-{step:08d}"
    tmp, final = root / f".{name}.tmp", root / name
    # Every rank encodes `extra` (the same on all), so a value JSON cannot hold fails everywhere at once.
    extra_json = json.dumps(_plain.encode(extra, "the checkpoint's extra value"), indent=1).encode()
    box: list[Any] = [None]
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove(tmp)
            tmp.mkdir()
        except OSError as exc:
            box[0] = str(cio.write_failed(tmp, exc))
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise CheckpointError(box[0])
    # Every rank's data file is written and fsynced, and rank 0 has written metadata.json (with the
    # extents' CRC-32s, fsynced too), when dcp.save returns; a failure anywhere raises on every rank.
    try:
        with cio.dcp_errors(f"checkpoint {tmp} could not be written"):
            dcp.save(tensors, storage_writer=cio.Writer(tmp), process_group=group)
    except CheckpointError:
        if rank == 0:
            remove(tmp)
        raise
    box = [0, None]
    if rank == 0:
        try:
            box[0] = commit(root, tmp, name, step, extra_json, fmt=FORMAT, keep=keep)
        except CheckpointError as exc:
            box[1] = str(exc)
    dist.broadcast_object_list(box, src=0, group=group)
    if box[1] is not None:
        raise CheckpointError(box[1])
    return final, int(box[0])


def resolve(resume: str | os.PathLike[str], run_dir: Path | None) -> Path | None:
    """The checkpoint directory `resume` names: "latest" (see `latest`; None if there is none yet) or a path."""
    if str(resume) == "latest":
        if run_dir is None:
            raise CheckpointError(
                'resume="latest" needs a run directory (run_dir=... or `varuna run --run-dir`) to look in'
            )
        return latest(run_dir / "checkpoints")
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} does not exist (resume= takes 'latest' or a checkpoint directory)"
        )
    return path


def _pointed(root: Path) -> Path:
    """The directory `root/latest` names, which must be a real step-N directory directly in `root`."""
    pointer = root / "latest"
    if not os.path.lexists(pointer):
        raise CheckpointError(f"{pointer} is missing")
    if pointer.is_symlink() or not pointer.is_file():
        raise CheckpointError(f"{pointer} is not a file (it must be a file naming a step-XXXXXXXX directory)")
    with open(pointer, "rb") as f:
        text = f.read(256).decode(errors="replace").strip()
    if not NAME.fullmatch(text):
        raise CheckpointError(
            f"{pointer} names {text[:80]!r}, not a checkpoint directory inside {root} (step-XXXXXXXX); "
            "it is never followed outside checkpoints/"
        )
    path = root / text
    if path.is_symlink() or not path.is_dir():
        what = "a symbolic link" if path.is_symlink() else "missing"
        raise CheckpointError(
            f"{pointer} names {text}, which is {what} (it must be a directory inside {root})"
        )
    return path


def latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, verified; None if `root` holds no checkpoint yet.

    A `latest` that is missing, names anything but a step-N directory inside `root` (a path, a
    symbolic link), or names an incomplete or damaged checkpoint falls back to the newest complete
    one, with a warning naming both; with none, a CheckpointError.
    """
    names = checkpoint_names(root)
    if not os.path.lexists(root / "latest") and not names:
        return None
    try:
        path = _pointed(root)
        verify(path)
        return path
    except CheckpointError as exc:
        problem = str(exc)
    for name in reversed(names):
        try:
            verify(root / name)
        except CheckpointError:
            continue
        warnings.warn(
            f"varuna: checkpoints/latest is unusable ({problem}); resuming from the newest complete "
            f"checkpoint, {root / name}, instead",
            stacklevel=3,
        )
        return root / name
    raise CheckpointError(
        f"{problem}; and no other checkpoint in {root} is complete. Resume from a checkpoint directory "
        f"(resume=PATH), or move {root} away to start afresh"
    )


def verify(path: Path, *, deep: bool = False) -> dict[str, Any]:
    """Check the manifest against the files on disk; returns the manifest.

    Every file must be there with the size the manifest gives, and the small files (`metadata.json`,
    `extra.json`) must match their CRC-32. The tensors' bytes are checked as they are loaded (see
    the module docstring); `deep=True` reads every data file here and checks every extent.
    """
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no manifest.json (it was not committed; "
            "resume from another one, e.g. the directory named in checkpoints/latest)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: manifest.json is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        why = (
            _OLD_FORMATS
            if isinstance(got, int) and got < FORMAT
            else "resume from a checkpoint this Varuna wrote"
        )
        raise CheckpointError(f"checkpoint {path} has format {got}, this Varuna reads {FORMAT}; {why}")
    files = manifest.get("files")
    if not isinstance(files, dict) or any(f not in files or "crc32" not in files[f] for f in SMALL):
        raise CheckpointError(
            f"checkpoint {path}: manifest.json does not list {' and '.join(SMALL)} with their CRC-32s; "
            "it is damaged; resume from another checkpoint"
        )
    for fname, info in files.items():
        if "/" in fname or fname in (".", "..") or not isinstance(info, dict):
            raise CheckpointError(
                f"checkpoint {path}: manifest.json lists {fname!r}, not a file of the checkpoint"
            )
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {f} is missing")
        actual = f.stat().st_size
        if actual != info.get("bytes"):
            raise CheckpointError(
                f"checkpoint file {f} is truncated or damaged: {actual} bytes, the manifest says {info.get('bytes')}"
            )
        if "crc32" in info and cio.file_crc(f) != info["crc32"]:
            raise CheckpointError(f"checkpoint file {f} is corrupted: its CRC-32 does not match the manifest")
    if deep:
        cio.verify_extents(path, manifest)
    return manifest


def read_extra(path: Path) -> dict[str, Any]:
    """The checkpoint's values beside the tensors (step, config, loss scale, ...), from `extra.json`."""
    f = path / _plain.EXTRA
    try:
        extra = _plain.decode(json.loads(f.read_bytes()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint file {f} cannot be read: {type(exc).__name__}: {exc}") from None
    if not isinstance(extra, dict) or extra.get("format") != FORMAT:
        got = extra.get("format") if isinstance(extra, dict) else None
        raise CheckpointError(f"checkpoint {path} has format {got}, this Varuna reads {FORMAT}")
    return extra


def stored_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of every tensor in the checkpoint."""
    metadata = cio.read_metadata(path)
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, dcp.TensorStorageMetadata):
            out[key] = (tuple(md.size), md.properties.dtype)
    return out


def load_tensors(path: Path, tensors: Mapping[str, torch.Tensor], *, process_group: Any = None) -> None:
    """Collective over `process_group` (default: all ranks): fill `tensors` in place from the checkpoint.

    A damaged extent fails the load on every rank with the same CheckpointError naming the file.
    Without an initialised process group it reads in this process alone, checking every extent it
    reads (`varuna.consolidate` reads a checkpoint so, outside any job).
    """
    metadata = cio.read_metadata(path)  # a damaged metadata.json: our error, not DCP's fallbacks
    with cio.dcp_errors(f"checkpoint {path} could not be read"), warnings.catch_warnings():
        # Without a process group DCP reads alone and warns that it assumes so; that is the intent.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")
        dcp.load(dict(tensors), storage_reader=cio.Reader(path, metadata), process_group=process_group)


# ---------------------------------------------------------------------------------------------------
# What an engine puts in a checkpoint, keyed by parameter name.


def _names_by_id(named: list[tuple[str, torch.nn.Parameter]]) -> dict[int, str]:
    return {id(p): n for n, p in named}


def optimizer_tensors(
    optimizer: torch.optim.Optimizer | None, named: list[tuple[str, torch.nn.Parameter]]
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The optimizer's state as "optim.<param name>.<key>" tensors, and its hyper-parameters."""
    if optimizer is None:
        return {}, []
    names = _names_by_id(named)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value)
                out[f"optim.{names[id(p)]}.{key}"] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return out, groups


def optimizer_placeholders(
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]], named: list[tuple[str, torch.nn.Parameter]]
) -> dict[str, torch.Tensor]:
    """Empty tensors for the stored optimizer state of the parameters this rank holds."""
    out = {}
    for name, p in named:
        prefix = f"optim.{name}."
        for key, (shape, dtype) in stored.items():
            if key.startswith(prefix) and "." not in key[len(prefix) :]:
                device = p.device if len(shape) else torch.device("cpu")
                out[key] = torch.empty(shape, dtype=dtype, device=device)
    return out


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer,
    named: list[tuple[str, torch.nn.Parameter]],
    tensors: dict[str, torch.Tensor],
    groups: list[dict[str, Any]],
) -> None:
    """Install state loaded by name into `optimizer` (built over this rank's parameters)."""
    names = _names_by_id(named)
    if groups and len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one {len(optimizer.param_groups)}; "
            "build the optimizer with the same groups as the run that saved it"
        )
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"optim.{names[id(p)]}."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                optimizer.state[p] = state


def check_model(
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]], shapes: dict[str, tuple[int, ...]], path: Path
) -> None:
    """The checkpoint holds exactly this model's parameters, with the same shapes."""
    saved = {k[len("model.") :]: v[0] for k, v in stored.items() if k.startswith("model.")}
    missing = sorted(set(shapes) - set(saved))
    unexpected = sorted(set(saved) - set(shapes))
    wrong = sorted(n for n in set(shapes) & set(saved) if tuple(shapes[n]) != tuple(saved[n]))
    if missing or unexpected or wrong:
        lines = [f"checkpoint {path} is from a different model:"]
        for what, names, show in (
            ("missing from the checkpoint", missing, lambda n: f"{n} {tuple(shapes[n])}"),
            ("not in this model", unexpected, lambda n: f"{n} {tuple(saved[n])}"),
            (
                "shape differs",
                wrong,
                lambda n: f"{n} model {tuple(shapes[n])} vs checkpoint {tuple(saved[n])}",
            ),
        ):
            lines += [f"  {what}: {show(n)}" for n in names[:20]]
            if len(names) > 20:
                lines.append(f"  ... and {len(names) - 20} more {what}")
        raise CheckpointError("\n".join(lines))
