"""No pickle on the load path: a forged metadata file is refused or ignored without running code, and
the extra values (step, config, scheduler, optimizer hyper-parameters) round-trip through JSON."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from _helpers import make_gpt_engine as make

import varuna
from varuna.checkpoint import _plain
from varuna.checkpoint import layout as ckpt
from varuna.checkpoint import storage as cio
from varuna.errors import CheckpointError


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    engine, data = make(tmp_path / "run")
    engine.step(engine.batch(data, 0))
    path = engine.checkpoint()
    engine.close()
    return path


class _Plant:
    """Unpickling this creates a file: the proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def _forge(checkpoint: Path, fname: str, data: bytes) -> None:
    """Put `data` in `fname` and make the manifest agree (size and CRC-32), as an attacker would."""
    (checkpoint / fname).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][fname] = {"bytes": len(data), "crc32": cio.file_crc(checkpoint / fname)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_no_pickle_is_written(saved: Path) -> None:
    assert sorted(p.name for p in saved.iterdir()) == [
        "__0_0.distcp",
        "extra.json",
        "manifest.json",
        "metadata.json",
    ]
    for fname in ("extra.json", "metadata.json", "manifest.json"):
        json.loads((saved / fname).read_text())  # plain JSON, every one


def test_a_forged_dcp_metadata_is_never_read(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Plant(marker))
    _forge(saved, ".metadata", payload)
    ckpt.verify(saved, deep=True)
    engine, _ = make(saved.parent.parent, resume="latest")
    assert engine.step_count == 1
    engine.close()
    varuna.consolidate(saved, tmp_path / "out.safetensors")
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: unpickling it is what the loader must never do
    assert marker.exists()


def test_a_pickle_in_place_of_the_metadata_is_refused_without_running(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _forge(saved, "metadata.json", pickle.dumps(_Plant(marker)))
    ckpt.verify(saved)  # sizes and CRC-32s agree: only reading the file can tell
    refused = r"metadata.json is not JSON .*a checkpoint's metadata is never unpickled"
    with pytest.raises(CheckpointError, match=refused):
        ckpt.verify(saved, deep=True)
    with pytest.raises(CheckpointError, match=refused):
        make(saved.parent.parent, resume=saved)
    with pytest.raises(CheckpointError, match=refused):
        varuna.consolidate(saved, tmp_path / "out.safetensors")
    assert not marker.exists()


def test_a_pickle_in_place_of_extra_is_refused_without_running(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _forge(saved, "extra.json", pickle.dumps(_Plant(marker)))
    with pytest.raises(CheckpointError, match=r"extra.json cannot be read"):
        make(saved.parent.parent, resume=saved)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda doc: doc["extents"][0].update(file="../../etc/passwd"),
            r"names '../../etc/passwd', not a file of",
        ),
        (lambda doc: doc["extents"][0].update(at=-5), r"extent offset is -5, not a non-negative integer"),
        (lambda doc: next(iter(doc["tensors"].values())).update(dtype="object"), r"has dtype 'object'"),
        (lambda doc: doc.pop("extents"), r"KeyError: 'extents'"),
    ],
)
def test_damaged_metadata_json_is_a_checkpoint_error(saved: Path, edit, message: str) -> None:
    doc = json.loads((saved / "metadata.json").read_text())
    edit(doc)
    _forge(saved, "metadata.json", json.dumps(doc).encode())
    with pytest.raises(CheckpointError, match=rf"metadata.json is damaged: .*{message}"):
        ckpt.stored_tensors(saved)


def test_a_format_2_checkpoint_says_why_it_is_refused(saved: Path) -> None:
    manifest = json.loads((saved / "manifest.json").read_text())
    (saved / "manifest.json").write_text(json.dumps(manifest | {"format": 2}))
    with pytest.raises(
        CheckpointError, match=r"has format 2, this Varuna reads 3; .* keep their metadata as a pickle"
    ):
        make(saved.parent.parent, resume=saved)


def test_resume_restores_the_extra_values_exactly(saved: Path) -> None:
    a, _ = make(saved.parent.parent, resume=saved)
    extra = ckpt.read_extra(saved)
    assert extra["optimizer_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again, not a list
    assert a.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert a.lr_scheduler.state_dict() == extra["lr_scheduler"]
    a.close()


def test_values_round_trip_and_others_are_refused_naming_where() -> None:
    value = {
        "t": (1, 2.5, None, "x"),
        "ints": {3: "three", (1, 2): [True]},
        "$odd": 1,
        "inf": math.inf,
        "raw": b"\x00\xff",
        "dtype": torch.bfloat16,
        "tensors": [torch.arange(6, dtype=torch.int16).reshape(2, 3), torch.tensor(0.5), torch.empty(0, 4)],
    }
    back = _plain.decode(json.loads(json.dumps(_plain.encode(value))))
    tensors = back.pop("tensors")
    assert back == {k: v for k, v in value.items() if k != "tensors"}
    for got, want in zip(tensors, value["tensors"]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(
        CheckpointError, match=r"extra\['hook'\]\[0\] is a builtins.function, which a checkpoint"
    ):
        _plain.encode({"hook": [lambda: 0]})
    with pytest.raises(
        CheckpointError, match=r"extra\['d'\] has dtype torch.qint8, which a checkpoint does not store"
    ):
        _plain.encode({"d": torch.qint8})


def test_a_value_that_cannot_be_stored_fails_the_save_before_writing(tmp_path: Path) -> None:
    engine, data = make(tmp_path)
    engine.step(engine.batch(data, 0))
    engine.optimizer.param_groups[0]["callback"] = object()
    with pytest.raises(
        CheckpointError, match=r"\['optimizer_groups'\]\[0\]\['callback'\] is a builtins.object"
    ):
        engine.checkpoint()
    assert not (tmp_path / "checkpoints").exists()
    engine.close()
