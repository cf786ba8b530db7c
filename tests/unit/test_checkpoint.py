"""Checkpoints: exact resume, atomic commit, and the errors of damaged or mismatched checkpoints.

One process (world size 1); the multi-rank save-at-one-shape, load-at-another path is in test_morph, and
the tests that start processes (a SIGKILL mid-write, damage seen by one rank of two) in test_checkpoint_jobs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _helpers import make_gpt_engine as make

from varuna import Varuna
from varuna.checkpoint import layout as ckpt
from varuna.data import SyntheticLM
from varuna.errors import CheckpointError
from varuna.models import GPT, GPTConfig, gpt_tiny


def test_resume_continues_exactly(tmp_path: Path) -> None:
    a, data = make(tmp_path)
    for k in range(2):
        a.step(a.batch(data, k))
    path = a.checkpoint()
    assert path == tmp_path / "checkpoints" / "step-00000002"
    expected = [a.step(a.batch(data, k)) for k in (2, 3)]
    b, _ = make(tmp_path, seed=99, resume=path)  # other initial weights: all must come from the checkpoint
    assert b.step_count == 2
    assert b.lr_scheduler.last_epoch == 2 and b.optimizer.param_groups[0]["lr"] == pytest.approx(
        1e-2 * 0.9**2
    )
    got = [b.step(b.batch(data, k)) for k in range(b.step_count, 4)]
    assert got == expected  # bitwise: the same process, the same kernels
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    a.close()
    b.close()


def test_latest_and_keep_last(tmp_path: Path) -> None:
    engine, data = make(tmp_path, checkpoint_keep=2)
    for k in range(3):
        engine.step(engine.batch(data, k))
        engine.checkpoint()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000002", "step-00000003"]
    assert (root / "latest").read_text().strip() == "step-00000003"
    manifest = json.loads((root / "step-00000003" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["bytes"] > 0 and "extra.json" in manifest["files"]
    resumed, _ = make(tmp_path, resume="latest")
    assert resumed.step_count == 3
    engine.close()
    resumed.close()


def test_resume_latest_with_nothing_saved_starts_fresh(tmp_path: Path) -> None:
    engine, _ = make(tmp_path, resume="latest")
    assert engine.step_count == 0 and engine.resumed_from is None
    engine.close()


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    engine, data = make(tmp_path)
    engine.step(engine.batch(data, 0))
    path = engine.checkpoint()
    engine.close()
    return path


def test_truncated_file_is_named(saved: Path) -> None:
    victim = next(saved.glob("*.distcp"))
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint file .*{victim.name} is truncated or damaged: \d+ bytes, the manifest says \d+",
    ):
        make(saved.parent.parent, resume=saved)


def test_corrupted_file_is_named(saved: Path) -> None:
    victim = next(saved.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checkpoint file .*{victim.name} is corrupted"):
        make(saved.parent.parent, resume=saved)


def test_uncommitted_checkpoint_is_refused(saved: Path) -> None:
    (saved / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: it has no manifest.json"):
        make(saved.parent.parent, resume=saved)


def test_checkpoint_of_another_model_lists_the_differences(saved: Path) -> None:
    other = GPTConfig(vocab_size=64, seq_len=16, d_model=48, n_layer=5, n_head=2)
    with pytest.raises(CheckpointError, match=r"from a different model") as err:
        make(saved.parent.parent, cfg=other, resume=saved)
    text = str(err.value)
    assert "missing from the checkpoint: blocks.4.ln_1.weight (48,)" in text
    assert "shape differs: blocks.0.attn.qkv.weight model (144, 48) vs checkpoint (96, 32)" in text
    assert "more shape differs" in text


def test_other_global_batch_is_refused_unless_allowed(saved: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"global_batch_size=8, this run asks for 16; .* allow_batch_change=True"
    ):
        make(saved.parent.parent, batch=16, resume=saved)
    engine, _ = make(saved.parent.parent, batch=16, resume=saved, allow_batch_change=True)
    assert engine.step_count == 1
    engine.close()


def test_other_optimizer_is_refused(saved: Path) -> None:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    engine = Varuna(GPT(cfg), global_batch_size=8, micro_batch_size=2, resume=saved)
    with pytest.raises(CheckpointError, match=r"saved with a AdamW optimizer, this run gives SGD"):
        engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    del data
    engine.close()


def test_every_byte_is_in_one_extent_with_its_crc(saved: Path) -> None:
    import zlib

    from varuna.checkpoint import storage as cio

    ckpt.verify(saved, deep=True)
    extents = cio.read_metadata(saved).storage_data.values()
    by_file: dict[str, list] = {}
    for e in extents:
        by_file.setdefault(e.relative_path, []).append(e)
    for fname, es in by_file.items():
        data = (saved / fname).read_bytes()
        es.sort(key=lambda e: e.offset)
        assert [e.offset for e in es] == [sum(x.length for x in es[:i]) for i in range(len(es))]
        assert sum(e.length for e in es) == len(data)
        for e in es:  # the CRC computed from memory while writing is the CRC of what is on disk
            assert zlib.crc32(data[e.offset : e.offset + e.length]) == e.crc32


def test_deep_verify_names_the_damaged_tensor(saved: Path) -> None:
    victim = next(saved.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    ckpt.verify(saved)  # sizes and the small files are fine; tensors are checked as they are read
    with pytest.raises(
        CheckpointError, match=rf"checkpoint file .*{victim.name} is corrupted: the bytes of '"
    ):
        ckpt.verify(saved, deep=True)


def test_checkpoint_of_another_format_is_refused(saved: Path) -> None:
    manifest = json.loads((saved / "manifest.json").read_text())
    (saved / "manifest.json").write_text(json.dumps(manifest | {"format": 1}))
    with pytest.raises(CheckpointError, match=rf"has format 1, this Varuna reads {ckpt.FORMAT}"):
        make(saved.parent.parent, resume=saved)


def test_loads_into_tensors_of_another_dtype_or_layout(saved: Path) -> None:
    stored = ckpt.stored_tensors(saved)
    key = next(k for k, (shape, _) in stored.items() if k.startswith("model.") and len(shape) == 2)
    shape, dtype = stored[key]
    exact = {key: torch.empty(shape, dtype=dtype)}
    ckpt.load_tensors(saved, exact)
    wide = {key: torch.empty(shape, dtype=torch.float64)}
    strided = {key: torch.empty(shape[::-1], dtype=dtype).t()}  # not contiguous: read, then copied
    ckpt.load_tensors(saved, wide)
    ckpt.load_tensors(saved, strided)
    assert torch.equal(wide[key], exact[key].double()) and torch.equal(strided[key], exact[key])


def test_only_tensors_are_saved(tmp_path: Path) -> None:
    from varuna.comm.rendezvous import init_distributed

    rank, _ = init_distributed()
    with pytest.raises(CheckpointError, match=r"checkpoint entry 'answer' is not a tensor"):
        ckpt.save(tmp_path, 1, {"w": torch.ones(3), "answer": 42}, {"format": ckpt.FORMAT}, rank=rank, keep=1)  # type: ignore[dict-item]
    assert not (tmp_path / "latest").exists()
