"""Tests of the data sampler (a pure function of step, replica and D) and the synthetic datasets."""

from __future__ import annotations

import gc
import math
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from varuna.data import (
    Loaders,
    ReplicaLoader,
    StreamLoader,
    SyntheticLM,
    SyntheticMLM,
    collate,
    global_indices,
    is_stream,
    open_loader,
    prefetched,
    sample_indices,
)
from varuna.errors import ConfigError

torch.set_num_threads(1)


# ------------------------------------------------------------------------------- sample_indices


@pytest.mark.parametrize(
    ("step", "replica", "D", "B", "N", "expected"),
    [
        (0, 0, 1, 4, 10, [0, 1, 2, 3]),
        (1, 0, 1, 4, 10, [4, 5, 6, 7]),
        (2, 0, 1, 4, 10, [8, 9, 0, 1]),  # straddles epochs 0 and 1
        (2, 0, 2, 4, 10, [8, 9]),
        (2, 1, 2, 4, 10, [0, 1]),
        (3, 2, 4, 8, 10, [8, 9]),  # positions 24..31; replica 2 gets 28, 29
        (3, 3, 4, 8, 10, [0, 1]),  # ... and replica 3 gets 30, 31
        (0, 0, 1, 7, 3, [0, 1, 2, 0, 1, 2, 0]),  # batch larger than the dataset
        (5, 0, 1, 1, 1, [0]),
    ],
)
def test_sample_indices_table_unshuffled(
    step: int, replica: int, D: int, B: int, N: int, expected: list[int]
) -> None:
    assert sample_indices(step, replica, D, B, N, shuffle=False) == expected


@pytest.mark.parametrize("D", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_union_over_replicas_is_the_global_batch(D: int, shuffle: bool) -> None:
    B, N = 16, 37
    for step in range(12):
        parts = [sample_indices(step, r, D, B, N, seed=3, shuffle=shuffle) for r in range(D)]
        assert all(len(p) == B // D for p in parts)
        assert sum(parts, []) == global_indices(step, B, N, seed=3, shuffle=shuffle)


def test_changing_data_parallel_never_changes_the_steps_samples() -> None:
    B, N = 24, 50
    for step in range(10):
        batches = {
            D: sorted(i for r in range(D) for i in sample_indices(step, r, D, B, N, seed=7))
            for D in (1, 2, 3, 4, 6, 8, 12, 24)
        }
        assert len({tuple(b) for b in batches.values()}) == 1


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    B, N = 4, 10  # 5 steps = 2 epochs; steps 2 straddles the boundary
    stream = sum((global_indices(step, B, N, seed=0) for step in range(5)), [])
    first, second = stream[:N], stream[N:]
    assert sorted(first) == list(range(N)) and sorted(second) == list(range(N))
    assert first != second
    assert first != list(range(N))  # it is shuffled


def test_straddling_step_joins_the_end_of_one_epoch_and_the_start_of_the_next() -> None:
    B, N = 4, 10
    epoch0 = sum((global_indices(s, 5, N, seed=2) for s in range(2)), [])  # positions 0..9
    epoch1 = sum((global_indices(s, 5, N, seed=2) for s in range(2, 4)), [])  # positions 10..19
    assert global_indices(2, B, N, seed=2) == epoch0[8:] + epoch1[:2]


def test_sampler_is_deterministic_and_seeded() -> None:
    a = [global_indices(s, 8, 100, seed=11) for s in range(30)]
    b = [global_indices(s, 8, 100, seed=11) for s in range(30)]
    c = [global_indices(s, 8, 100, seed=12) for s in range(30)]
    assert a == b
    assert a != c
    # Pure: asking out of order, or after other seeds, gives the same answer.
    global_indices(3, 8, 100, seed=99)
    assert global_indices(17, 8, 100, seed=11) == a[17]


def test_sampler_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    global_indices(4, 8, 100, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_returns_python_ints() -> None:
    idx = sample_indices(0, 0, 1, 4, 10)
    assert all(type(i) is int for i in idx)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"global_batch_size": 10, "data_parallel": 4},
            r"global_batch_size must be divisible by data_parallel \(global_batch_size: 10, "
            r"data_parallel: 4\); change data_parallel to one of \[1, 2, 5, 10\]",
        ),
        ({"replica": 2, "data_parallel": 2}, r"replica must be in \[0, data_parallel\) = \[0, 2\) \(got 2\)"),
        ({"replica": -1}, r"replica must be in \[0, data_parallel\)"),
        ({"dataset_size": 0}, r"dataset_size must be >= 1 \(got 0\)"),
        ({"step": -1}, r"step must be >= 0 \(got -1\)"),
        ({"global_batch_size": 0}, r"global_batch_size must be >= 1 \(got 0\)"),
        ({"data_parallel": 0}, r"data_parallel must be >= 1 \(got 0\)"),
        ({"step": 1.0}, r"step must be an integer \(got 1.0 of type float\)"),
        ({"seed": "0"}, r"seed must be an integer"),
    ],
)
def test_sample_indices_errors(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "step": 0,
        "replica": 0,
        "data_parallel": 2,
        "global_batch_size": 8,
        "dataset_size": 10,
    }
    args.update(kwargs)
    seed = args.pop("seed", 0)
    with pytest.raises(ConfigError, match=match):
        sample_indices(**args, seed=seed)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        global_indices(-1, 4, 10)


# ----------------------------------------------------------------------------- collate, loader


def test_collate_stacks_each_key() -> None:
    samples = [{"a": torch.tensor([i, i]), "b": torch.tensor(float(i))} for i in range(3)]
    batch = collate(samples)
    assert batch["a"].tolist() == [[0, 0], [1, 1], [2, 2]]
    assert batch["b"].shape == (3,)


def test_collate_errors() -> None:
    with pytest.raises(ConfigError, match=r"at least one sample"):
        collate([])
    with pytest.raises(ConfigError, match=r"sample 0 has \['a'\], sample 1 has \['b'\]"):
        collate([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])


class _Indexed(torch.utils.data.Dataset):
    """Sample i is {"x": tensor([i, i])}: shows which indices a batch holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([i, i])}


def test_replica_loader_batches_follow_sample_indices() -> None:
    ds = _Indexed(23)
    loaders = [ReplicaLoader(ds, global_batch_size=8, replica=r, data_parallel=4, seed=5) for r in range(4)]
    assert loaders[1].local_batch_size == 2
    for step in (0, 3, 9):
        parts = [ld.batch(step)["x"] for ld in loaders]
        assert all(p.shape == (2, 2) for p in parts)
        assert parts[2][:, 0].tolist() == sample_indices(step, 2, 4, 8, 23, seed=5)
        whole = loaders[0].global_batch(step)["x"]
        assert whole.shape == (8, 2)
        assert torch.equal(torch.cat(parts), whole)
    assert "replica=1/4" in repr(loaders[1])


def test_replica_loader_validates_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size must be divisible by data_parallel"):
        ReplicaLoader(_Indexed(10), global_batch_size=6, replica=0, data_parallel=4)
    with pytest.raises(ConfigError, match=r"non-empty dataset"):
        ReplicaLoader(_Indexed(0), global_batch_size=4, replica=0, data_parallel=1)


def test_datasets_that_are_not_map_style_dicts_are_named() -> None:
    from torch.utils.data import IterableDataset, TensorDataset

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield {"x": torch.zeros(1)}

    with pytest.raises(ConfigError, match=r"map-style.*got a Stream: an IterableDataset has no index"):
        ReplicaLoader(Stream(), global_batch_size=4, replica=0, data_parallel=1)
    with pytest.raises(ConfigError, match=r"got a Tensor: a tensor is not a dataset of dicts; wrap it"):
        ReplicaLoader(torch.zeros(8, 2), global_batch_size=4, replica=0, data_parallel=1)  # type: ignore[arg-type]
    loader = ReplicaLoader(TensorDataset(torch.zeros(8, 2)), global_batch_size=4, replica=0, data_parallel=1)
    with pytest.raises(
        ConfigError, match=r"a sample must be a dict of tensors.*gave a tuple \(a TensorDataset"
    ):
        loader.batch(0)


def test_replica_loader_on_synthetic_lm_shapes() -> None:
    ds = SyntheticLM(64, 16, 100)
    batch = ReplicaLoader(ds, global_batch_size=8, replica=1, data_parallel=2).batch(3)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert batch["input_ids"].dtype == torch.long


# --------------------------------------------------------------------------------- SyntheticLM


def test_synthetic_lm_sample_is_pure_function_of_seed_and_index() -> None:
    a, b = SyntheticLM(64, 16, 50, seed=1), SyntheticLM(64, 16, 50, seed=1)
    torch.manual_seed(123)  # the global RNG plays no part
    for i in (0, 7, 49):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
    assert torch.equal(a[7]["input_ids"], a[7]["input_ids"])
    assert not torch.equal(a[7]["input_ids"], a[8]["input_ids"])
    assert not torch.equal(a[7]["input_ids"], SyntheticLM(64, 16, 50, seed=2)[7]["input_ids"])
    assert torch.equal(a[-1]["input_ids"], a[49]["input_ids"])
    with pytest.raises(IndexError):
        a[50]


def test_synthetic_lm_labels_are_next_tokens() -> None:
    ds = SyntheticLM(64, 16, 10)
    s = ds[3]
    assert s["input_ids"].shape == s["labels"].shape == (16,)
    assert s["input_ids"].dtype == s["labels"].dtype == torch.long
    assert torch.equal(s["input_ids"][1:], s["labels"][:-1])
    assert 0 <= int(s["input_ids"].min()) and int(s["labels"].max()) < 64


def test_synthetic_lm_is_a_sparse_bigram_chain() -> None:
    """Each token is followed by at most 4 distinct successors: far below ln(vocab) of entropy."""
    ds = SyntheticLM(32, 32, 200)
    successors: dict[int, set[int]] = {}
    for i in range(len(ds)):
        s = ds[i]
        for a, b in zip(s["input_ids"].tolist(), s["labels"].tolist(), strict=True):
            successors.setdefault(a, set()).add(b)
    assert max(len(v) for v in successors.values()) <= 4
    assert len(successors) > 16  # the walk visits much of the vocabulary


def test_synthetic_lm_errors() -> None:
    with pytest.raises(ConfigError, match=r"vocab_size must be >= 2 \(got 1\)"):
        SyntheticLM(1, 16, 10)
    with pytest.raises(ConfigError, match=r"size must be >= 1 \(got 0\)"):
        SyntheticLM(64, 16, 0)


# -------------------------------------------------------------------------------- SyntheticMLM


def test_synthetic_mlm_exact_mask_count_and_layout() -> None:
    ds = SyntheticMLM(64, 16, 200, mask_per_sample=3, pad_id=0, mask_id=1, seed=4)
    padded = 0
    for i in range(len(ds)):
        s = ds[i]
        assert set(s) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
        assert all(v.shape == (16,) and v.dtype == torch.long for v in s.values())
        real = s["attention_mask"].bool()
        n_real = int(real.sum())
        assert real[:n_real].all() and not real[n_real:].any()  # padding is trailing
        padded += n_real < 16
        assert (s["input_ids"][~real] == 0).all()
        labelled = s["labels"] != -100
        assert int(labelled.sum()) == 3
        assert real[labelled].all()  # masks fall on real tokens only
        assert (s["input_ids"][labelled] == 1).all()
        assert ((s["labels"][labelled] != 0) & (s["labels"][labelled] != 1)).all()
        assert (s["input_ids"][real & ~labelled] > 1).all()  # no stray pad/mask ids
        types = s["token_type_ids"]
        assert set(types[real].tolist()) == {0, 1}
        assert types[0] == 0 and (types[~real] == 0).all()
        assert (types[real].diff() >= 0).all()  # segment 0 then segment 1
    assert 40 < padded < 160


def test_synthetic_mlm_batch_mean_equals_mean_of_micro_batch_means() -> None:
    """Equal label counts per sample make the batch loss decompose over equal micro-batches."""
    ds = SyntheticMLM(64, 16, 40, mask_per_sample=2)
    batch = ReplicaLoader(ds, global_batch_size=8, replica=0, data_parallel=1).batch(0)
    logits = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(0))

    def loss(lo: torch.Tensor, la: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(lo.flatten(0, 1), la.flatten(), ignore_index=-100)

    whole = loss(logits, batch["labels"])
    micro = [loss(logits[i : i + 2], batch["labels"][i : i + 2]) for i in range(0, 8, 2)]
    torch.testing.assert_close(whole, torch.stack(micro).mean())


def test_synthetic_mlm_deterministic() -> None:
    a, b = SyntheticMLM(64, 16, 10, seed=3), SyntheticMLM(64, 16, 10, seed=3)
    for key in ("input_ids", "labels", "attention_mask", "token_type_ids"):
        assert torch.equal(a[5][key], b[5][key])
    assert not torch.equal(a[5]["input_ids"], SyntheticMLM(64, 16, 10, seed=4)[5]["input_ids"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask_per_sample": 17}, r"mask_per_sample must be <= seq_len \(mask_per_sample: 17, seq_len: 16\)"),
        ({"mask_per_sample": 0}, r"mask_per_sample must be >= 1"),
        ({"pad_id": 1, "mask_id": 1}, r"pad_id and mask_id must differ"),
        ({"mask_id": 64}, r"mask_id must be in \[0, vocab_size\) = \[0, 64\) \(got 64\)"),
    ],
)
def test_synthetic_mlm_errors(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SyntheticMLM(64, 16, 10, **kwargs)


def test_synthetic_lm_is_learnable_by_a_tiny_gpt() -> None:
    from varuna.models import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ReplicaLoader(SyntheticLM(64, 16, 1024), global_batch_size=16, replica=0, data_parallel=1)
    losses = []
    for step in range(30):
        loss = model(**loader.batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(64) - 0.2
    assert sum(losses[-5:]) / 5 < math.log(64) - 0.8


# ------------------------------------------------------------------ collate_fn and typed errors


def _unstackable(column: str, holds: str) -> str:
    return (
        rf"collate cannot stack column '{column}' into a batch: it holds {holds}; "
        r"pass collate_fn=\.\.\. to engine\.batch .* \(e\.g\. a padding collator, see docs/data\.md\), "
        r"or remove the column from the dataset"
    )


def test_collate_makes_tensors_of_numbers_and_equal_lists() -> None:
    batch = collate([{"n": 1, "f": 0.5, "ids": [1, 2]}, {"n": 3, "f": 1.5, "ids": [3, 4]}])
    assert batch["n"].tolist() == [1, 3] and batch["n"].dtype == torch.long
    assert batch["f"].tolist() == [0.5, 1.5] and batch["f"].dtype == torch.float32
    assert batch["ids"].tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("values", "holds"),
    [
        (["a cat", "a dog"], r"str values \(e\.g\. 'a cat'\), which make no tensor"),
        ([torch.zeros(3), torch.zeros(5)], r"tensors of different shapes \(\(3,\), \(5,\)\)"),
        ([[1, 2], [1, 2, 3]], r"list values of different shapes \(\(2,\), \(3,\)\)"),
        ([torch.zeros(2), [0, 0]], r"values of different types \(Tensor, list\)"),
        ([None, None], r"NoneType values that make no tensor \(Could not infer dtype of NoneType\)"),
    ],
)
def test_collate_names_a_column_it_cannot_stack(values: list[Any], holds: str) -> None:
    samples = [{"ok": torch.zeros(2), "bad": v} for v in values]
    with pytest.raises(ConfigError, match=_unstackable("bad", holds)):
        collate(samples)


def _pad(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pads "x" (ragged lists) with -1 to the longest in the batch; drops "text"."""
    width = max(len(s["x"]) for s in samples)
    return {"x": torch.tensor([s["x"] + [-1] * (width - len(s["x"])) for s in samples])}


class _Ragged(torch.utils.data.Dataset):
    """Sample i is {"x": [i] * (i % 3 + 1), "text": "row i"}: ragged, with a string column."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": [i] * (i % 3 + 1), "text": f"row {i}"}


def test_replica_loader_uses_collate_fn_and_names_the_string_column_without_one() -> None:
    seen: list[list[dict[str, Any]]] = []

    def spy(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seen.append(samples)
        return _pad(samples)

    loader = ReplicaLoader(
        _Ragged(), global_batch_size=4, replica=0, data_parallel=1, shuffle=False, collate_fn=spy
    )
    assert loader.batch(0)["x"].tolist() == [[0, -1, -1], [1, 1, -1], [2, 2, 2], [3, -1, -1]]
    assert [s["text"] for s in seen[0]] == ["row 0", "row 1", "row 2", "row 3"]
    plain = ReplicaLoader(_Ragged(), global_batch_size=4, replica=0, data_parallel=1, shuffle=False)
    with pytest.raises(
        ConfigError, match=_unstackable("x", r"list values of different shapes \(\(1,\), \(2,\), \(3,\)\)")
    ):
        plain.batch(0)


class _Batched(torch.utils.data.Dataset):
    """Counts its reads: one __getitems__ call per batch is the point."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.getitems_calls: list[list[int]] = []
        self.getitem_calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.getitem_calls += 1
        return {"x": torch.tensor(i)}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        self.getitems_calls.append(list(indices))
        return [{"x": torch.tensor(i)} for i in indices]


def test_getitems_reads_a_batch_in_one_call() -> None:
    ds = _Batched(20)
    loader = ReplicaLoader(ds, global_batch_size=8, replica=1, data_parallel=2, seed=3)
    for step in range(3):
        assert loader.batch(step)["x"].tolist() == loader.indices(step)
    assert ds.getitems_calls == [loader.indices(step) for step in range(3)]
    assert ds.getitem_calls == 0


def test_getitems_that_loses_samples_is_named() -> None:
    class Short(_Batched):
        def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
            return super().__getitems__(indices)[:-1]

    loader = ReplicaLoader(Short(10), global_batch_size=4, replica=0, data_parallel=1)
    with pytest.raises(
        ConfigError, match=r"Short\.__getitems__ gave 3 samples for 4 indices; it must return one"
    ):
        loader.batch(0)


# --------------------------------------------------------------------- Hugging Face datasets


@pytest.fixture()
def hf_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The keys of every `datasets.Dataset.__getitem__` call."""
    datasets = pytest.importorskip("datasets")
    calls: list[Any] = []
    original = datasets.Dataset.__getitem__

    def spy(self: Any, key: Any) -> Any:
        calls.append(key)
        return original(self, key)

    monkeypatch.setattr(datasets.Dataset, "__getitem__", spy)
    return calls


def _hf_rows(n: int) -> dict[str, list[Any]]:
    return {
        "ids": [[i, i + 1, i + 2] for i in range(n)],
        "label": list(range(n)),
        "score": [i / 4 for i in range(n)],
    }


@pytest.mark.parametrize("fmt", [None, "torch"])
def test_a_datasets_dataset_is_read_with_one_batch_call(hf_calls: list[Any], fmt: str | None) -> None:
    import datasets

    ds = datasets.Dataset.from_dict(_hf_rows(30)).with_format(fmt)
    loader = ReplicaLoader(ds, global_batch_size=8, replica=1, data_parallel=2, seed=1)
    hf_calls.clear()
    batch = loader.batch(4)
    idx = loader.indices(4)
    assert hf_calls == [idx]
    assert batch["ids"].tolist() == [[i, i + 1, i + 2] for i in idx]
    assert batch["label"].tolist() == idx and batch["label"].dtype == torch.long
    assert batch["score"].tolist() == [i / 4 for i in idx]


def test_a_datasets_dataset_with_text_needs_a_collate_fn(hf_calls: list[Any]) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"text": [f"line {i}" for i in range(10)], "n": list(range(10))})
    loader = ReplicaLoader(ds, global_batch_size=4, replica=0, data_parallel=1, shuffle=False)
    with pytest.raises(
        ConfigError, match=_unstackable("text", r"str values \(e\.g\. 'line 0'\), which make no tensor")
    ):
        loader.batch(0)

    def lengths(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {
            "length": torch.tensor([len(r["text"]) for r in rows]),
            "n": torch.tensor([r["n"] for r in rows]),
        }

    hf_calls.clear()
    rows = ReplicaLoader(
        ds, global_batch_size=4, replica=0, data_parallel=1, shuffle=False, collate_fn=lengths
    )
    assert rows.batch(2)["n"].tolist() == [8, 9, 0, 1]
    assert len(hf_calls) == 1


def test_datasets_is_never_imported_by_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # an `import datasets` would raise ImportError now
    loader = ReplicaLoader(_Indexed(10), global_batch_size=4, replica=0, data_parallel=1)
    assert loader.batch(0)["x"].shape == (4, 2)
    assert is_stream(iter([])) and not is_stream(_Indexed(3))


# ------------------------------------------------------------------------------------ prefetch


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "varuna-prefetch"]


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetch_yields_the_loaders_batches_and_leaves_no_thread(depth: int) -> None:
    ds = SyntheticLM(64, 8, 50)
    loader = ReplicaLoader(ds, global_batch_size=8, replica=1, data_parallel=2, seed=4)
    got = list(prefetched(loader, 0, 7, depth=depth))
    assert len(got) == 7
    for step, batch in enumerate(got):
        want = loader.batch(step)
        assert all(torch.equal(batch[k], want[k]) for k in want)
    assert _prefetch_threads() == []


def test_prefetch_reads_at_most_depth_batches_ahead() -> None:
    ds = _Batched(100)
    loader = ReplicaLoader(ds, global_batch_size=4, replica=0, data_parallel=1)
    it = prefetched(loader, 2, depth=2)
    for taken in range(1, 6):
        next(it)
        assert taken <= len(ds.getitems_calls) <= taken + 2
    assert ds.getitems_calls[0] == loader.indices(2)


def test_closing_or_dropping_the_prefetch_iterator_stops_its_thread() -> None:
    loader = ReplicaLoader(SyntheticLM(64, 8, 50), global_batch_size=4, replica=0, data_parallel=1)
    it = prefetched(loader, 0, depth=1)  # endless: only closing ends it
    next(it)
    assert len(_prefetch_threads()) == 1
    it.close()
    assert _prefetch_threads() == []
    it = prefetched(loader, 0, depth=2)
    next(it)
    del it
    gc.collect()
    assert _prefetch_threads() == []


class _FailsAt(torch.utils.data.Dataset):
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.bad:
            raise KeyError(f"sample {i} is corrupt")
        return {"x": torch.tensor(i)}


def test_an_exception_in_the_prefetch_thread_surfaces_at_its_step() -> None:
    loader = ReplicaLoader(_FailsAt(13), global_batch_size=4, replica=0, data_parallel=1, shuffle=False)
    it = prefetched(loader, 0, depth=2)
    assert [next(it)["x"].tolist() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(KeyError, match=r"sample 13 is corrupt") as info:
        next(it)
    assert "raised reading step 3's batch in varuna's prefetch thread" in str(info.value.__notes__)
    assert _prefetch_threads() == []


def test_prefetch_settings_are_checked() -> None:
    loader = ReplicaLoader(_Indexed(10), global_batch_size=4, replica=0, data_parallel=1)
    with pytest.raises(ConfigError, match=r"prefetch must be >= 0 \(got -1\)"):
        prefetched(loader, 0, depth=-1)
    with pytest.raises(ConfigError, match=r"stop must be >= 3 \(got 2\)"):
        prefetched(loader, 3, 2)


# ------------------------------------------------------------------------- iterable datasets


class _Stream(torch.utils.data.IterableDataset):
    """Samples {"id": i} for i < n; counts how often it is started."""

    def __init__(self, n: int = 1000) -> None:
        self.n = n
        self.starts = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.starts += 1
        for i in range(self.n):
            yield {"id": torch.tensor(i)}


class _Skippable(_Stream):
    """A stream with a `skip(n)` hook, as `datasets.IterableDataset` has."""

    def __init__(self, n: int = 1000) -> None:
        super().__init__(n)
        self.skips: list[int] = []

    def skip(self, n: int) -> Iterator[dict[str, torch.Tensor]]:
        self.skips.append(n)
        return ({"id": torch.tensor(i)} for i in range(n, self.n))


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["id"].tolist()


@pytest.mark.parametrize("D", [1, 2, 4])
def test_a_streams_step_is_the_same_global_batch_at_any_d(D: int) -> None:
    G = 8
    loaders = [StreamLoader(_Stream(), global_batch_size=G, replica=r, data_parallel=D) for r in range(D)]
    for step in range(6):
        parts = [_ids(ld.batch(step)) for ld in loaders]
        assert all(len(p) == G // D for p in parts)
        assert sum(parts, []) == list(range(step * G, (step + 1) * G))
        assert parts[D - 1] == list(loaders[D - 1].positions(step))
    assert _ids(loaders[0].global_batch(6)) == list(range(48, 56))


@pytest.mark.parametrize("stream", [_Stream, _Skippable])
def test_resuming_a_stream_at_step_k_gives_the_batches_of_continuing(stream: type[_Stream]) -> None:
    """Replica 1 of 2 trains steps 0..8 in one go; a job resumed at step k at D = 4 (a morph) gives
    the same samples to replicas 2 and 3, and reads its stream once (through skip() if it has one)."""
    continuing = StreamLoader(stream(), global_batch_size=8, replica=1, data_parallel=2)
    ahead = [_ids(continuing.batch(step)) for step in range(9)]
    for k in (0, 3, 5):
        sources = [stream(), stream()]
        resumed = [
            StreamLoader(ds, global_batch_size=8, replica=r, data_parallel=4)
            for ds, r in zip(sources, (2, 3))
        ]
        after = [_ids(resumed[0].batch(step)) + _ids(resumed[1].batch(step)) for step in range(k, 9)]
        assert after == ahead[k:]
        if isinstance(sources[0], _Skippable) and k > 0:  # straight to the position, no pass from 0
            assert [(ds.starts, ds.skips) for ds in sources] == [(0, [k * 8])] * 2
        else:
            assert [ds.starts for ds in sources] == [1, 1]


def test_a_stream_restarts_for_an_earlier_step_only() -> None:
    ds = _Stream()
    loader = StreamLoader(ds, global_batch_size=4, replica=0, data_parallel=1)
    assert [_ids(loader.batch(s))[0] for s in (0, 1, 2, 5)] == [0, 4, 8, 20]
    assert ds.starts == 1
    assert _ids(loader.batch(1)) == [4, 5, 6, 7]
    assert ds.starts == 2


def test_a_one_shot_iterator_reads_forward_and_names_the_fix_to_go_back() -> None:
    gen = ({"id": torch.tensor(i)} for i in range(100))
    loader = StreamLoader(gen, global_batch_size=4, replica=0, data_parallel=1)
    assert _ids(loader.batch(2)) == [8, 9, 10, 11]
    assert _ids(loader.batch(3)) == [12, 13, 14, 15]
    with pytest.raises(
        ConfigError,
        match=r"one-shot iterator \(generator\), read up to sample 16, and cannot go back to sample 4",
    ):
        loader.batch(1)


def test_the_end_of_a_stream_drops_the_partial_batch() -> None:
    loader = StreamLoader(_Stream(10), global_batch_size=4, replica=0, data_parallel=2)
    assert [_ids(b) for b in prefetched(loader, 0)] == [[0, 1], [4, 5]]
    assert _prefetch_threads() == []
    with pytest.raises(
        ConfigError,
        match=r"the stream ended after 10 samples, before step 2's global batch \(samples \[8, 12\)\); "
        r"it holds 2 full global batches of 4 \(a partial last one is dropped\)",
    ):
        loader.batch(2)


def test_stream_settings_are_checked() -> None:
    with pytest.raises(
        ConfigError, match=r"shuffle=True needs a map-style dataset; a _Stream is read as one stream"
    ):
        open_loader(_Stream(), global_batch_size=4, replica=0, data_parallel=1, shuffle=True)
    with pytest.raises(ConfigError, match=r"global_batch_size must be divisible by data_parallel"):
        StreamLoader(_Stream(), global_batch_size=6, replica=0, data_parallel=4)
    with pytest.raises(ConfigError, match=r"StreamLoader reads an iterable of samples; got a int"):
        StreamLoader(3, global_batch_size=4, replica=0, data_parallel=1)  # type: ignore[arg-type]

    class BadSkip(_Stream):
        def skip(self, n: int) -> None:
            pass

    with pytest.raises(
        ConfigError, match=r"BadSkip\.skip\(8\) gave NoneType; .* return an iterable that starts at sample n"
    ):
        StreamLoader(BadSkip(), global_batch_size=4, replica=0, data_parallel=1).batch(2)


def test_loaders_keep_one_stream_position_per_dataset() -> None:
    a, b = _Stream(), _Stream()
    loaders = Loaders(global_batch_size=4, replica=1, data_parallel=2)
    for step in range(5):
        assert _ids(loaders.get(a).batch(step)) == [4 * step + 2, 4 * step + 3]
        assert _ids(loaders.get(b, collate_fn=collate).batch(step)) == [4 * step + 2, 4 * step + 3]
    assert a.starts == b.starts == 1
    assert isinstance(loaders.get(_Indexed(8)), ReplicaLoader)


def test_a_datasets_iterable_dataset_resumes_through_skip() -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(num_shards=2)
    assert is_stream(ds)
    loader = StreamLoader(ds, global_batch_size=4, replica=1, data_parallel=2)
    assert _ids(loader.batch(3)) == [14, 15]
    assert _ids(loader.batch(4)) == [18, 19]


# ------------------------------------------------------------------- engine.batch / batches


@pytest.fixture()
def engine() -> Iterator[Any]:
    from varuna import Varuna
    from varuna.models import GPT, gpt_tiny

    torch.manual_seed(0)
    eng = Varuna(GPT(gpt_tiny()), global_batch_size=8, micro_batch_size=2)
    yield eng
    eng.close()


def test_engine_batches_are_engine_batch_for_each_step(engine: Any) -> None:
    ds = SyntheticLM(64, 16, 40)
    got = list(engine.batches(ds, stop=6))
    for step, batch in enumerate(got):
        assert torch.equal(batch["input_ids"], engine.batch(ds, step)["input_ids"])
    engine.step_count = 4  # as after a resume: batches() starts where training continues
    resumed = next(iter(engine.batches(ds, prefetch=0)))
    assert torch.equal(resumed["input_ids"], got[4]["input_ids"])
    assert _prefetch_threads() == []


def test_engine_batch_keeps_a_streams_iterator(engine: Any) -> None:
    ds = _Stream()
    assert [_ids(engine.batch(ds, step))[0] for step in range(4)] == [0, 8, 16, 24]
    assert ds.starts == 1
    assert [_ids(b)[0] for b in engine.batches(ds, 2, 5)] == [16, 24, 32]
    assert ds.starts == 2  # batches() reads through a loader of its own
    with pytest.raises(ConfigError, match=r"shuffle=True needs a map-style dataset"):
        engine.batch(ds, 4, shuffle=True)
    ragged = _Ragged()
    assert engine.batch(ragged, 0, collate_fn=_pad)["x"].shape[0] == 8
