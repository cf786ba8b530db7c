"""Tests of the data sampler (a pure function of step, replica and D) and the synthetic datasets."""

from __future__ import annotations

import math

import pytest
import torch

from varuna.data import (
    ReplicaLoader,
    SyntheticLM,
    SyntheticMLM,
    collate,
    global_indices,
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
