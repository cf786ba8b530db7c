"""Which samples a training step sees, as a pure function of (step, replica, data-parallel degree).

The global batch of step k is fixed by the step alone; the data-parallel degree D only decides how
it is split among replicas. So a job resized from D=4 to D=2 mid-training (a morph) trains on
exactly the samples the D=4 job would have, and the plain single-process reference sees them too.

    stream:  | epoch 0 (a permutation of range(N)) | epoch 1 (another permutation) | ...
    step k:  stream positions [k*B, (k+1)*B)        (may straddle two epochs)
    replica r of D:  the contiguous slice [r*B/D, (r+1)*B/D) of step k's batch

    sample_indices(step=3, replica=1, data_parallel=2, global_batch_size=8, dataset_size=100)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import Dataset

from varuna.errors import ConfigError

__all__ = [
    "sample_indices",
    "global_indices",
    "collate",
    "MapDataset",
    "ReplicaLoader",
    "SyntheticLM",
    "SyntheticMLM",
]

_MASK64 = (1 << 64) - 1


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers, well spread even for neighbouring inputs (splitmix64 rounds)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def _generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from `parts`."""
    return torch.Generator().manual_seed(_mix(*parts))


def _check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """`value` as an int, or ConfigError naming the setting when it is not an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer (got {value!r} of type {type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum} (got {value})")
    return value


def _check_split(global_batch_size: int, data_parallel: int) -> None:
    """Validate the batch size and the data-parallel degree, and that one divides the other."""
    _check_int("global_batch_size", global_batch_size, minimum=1)
    _check_int("data_parallel", data_parallel, minimum=1)
    if global_batch_size % data_parallel != 0:
        fits = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
        raise ConfigError(
            f"global_batch_size must be divisible by data_parallel "
            f"(global_batch_size: {global_batch_size}, data_parallel: {data_parallel}); "
            f"change data_parallel to one of {fits} or global_batch_size to a multiple of {data_parallel}"
        )


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, dataset_size: int, shuffle: bool) -> Tensor:
    """The order of epoch `epoch`: a permutation of range(dataset_size) (cached; never handed out)."""
    if not shuffle:
        return torch.arange(dataset_size)
    return torch.randperm(dataset_size, generator=_generator(seed, epoch))


def _stream(start: int, stop: int, dataset_size: int, seed: int, shuffle: bool) -> list[int]:
    """Sample ids at stream positions [start, stop) of the endless sequence of epochs."""
    out: list[int] = []
    pos = start
    while pos < stop:
        epoch, offset = divmod(pos, dataset_size)
        take = min(stop - pos, dataset_size - offset)
        out.extend(_epoch_order(seed, epoch, dataset_size, shuffle)[offset : offset + take].tolist())
        pos += take
    return out


def sample_indices(
    step: int,
    replica: int,
    data_parallel: int,
    global_batch_size: int,
    dataset_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
) -> list[int]:
    """The dataset indices replica `replica` of `data_parallel` trains on at step `step`.

    >>> sample_indices(2, 1, 2, 4, 10, shuffle=False)    # positions 8..11, replica 1 gets 10, 11
    [0, 1]
    """
    _check_int("step", step, minimum=0)
    _check_split(global_batch_size, data_parallel)
    _check_int("dataset_size", dataset_size, minimum=1)
    _check_int("seed", seed)
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < data_parallel:
        raise ConfigError(
            f"replica must be in [0, data_parallel) = [0, {data_parallel}) (got {replica!r}); "
            "pass this rank's replica index, or raise data_parallel"
        )
    local = global_batch_size // data_parallel
    start = step * global_batch_size + replica * local
    return _stream(start, start + local, dataset_size, seed, bool(shuffle))


def global_indices(
    step: int, global_batch_size: int, dataset_size: int, *, seed: int = 0, shuffle: bool = True
) -> list[int]:
    """All indices of step `step`'s global batch: the concatenation over replicas, for any D."""
    return sample_indices(step, 0, 1, global_batch_size, dataset_size, seed=seed, shuffle=shuffle)


def collate(samples: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack a list of samples (dicts of equally shaped tensors) into a batch with a leading dimension."""
    if len(samples) == 0:
        raise ConfigError("collate needs at least one sample (got an empty list)")
    if not isinstance(samples[0], dict):
        raise ConfigError(
            f"a sample must be a dict of tensors, like {{'input_ids': ..., 'labels': ...}}; the dataset gave a "
            f"{type(samples[0]).__name__} (a TensorDataset gives tuples): make __getitem__ return a dict, "
            "e.g. [{'x': x, 'y': y} for x, y in TensorDataset(...)]"
        )
    keys = list(samples[0])
    for i, sample in enumerate(samples):
        if list(sample) != keys:
            raise ConfigError(
                f"every sample must have the same keys; sample 0 has {keys}, sample {i} has "
                f"{list(sample)}: make the dataset's __getitem__ return the same keys for every index"
            )
    return {key: torch.stack([s[key] for s in samples]) for key in keys}


class MapDataset(Protocol):
    """What `ReplicaLoader` needs of a dataset: a length and samples that are dicts of tensors."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Tensor]: ...


def _check_map_style(dataset: Any) -> None:
    """ConfigError unless `dataset` is map-style: `len(ds)` and `ds[i]`, as a step asks for its samples."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        why = (
            "an IterableDataset has no index, so a step cannot ask for its own samples; give a map-style one"
        )
    elif isinstance(dataset, torch.Tensor):
        why = "a tensor is not a dataset of dicts; wrap it, e.g. [{'x': row} for row in tensor]"
    elif not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        why = "it needs len(ds) and ds[i]"
    else:
        return
    raise ConfigError(
        f"the dataset must be map-style, len(ds) and ds[i] giving a dict of tensors; got a "
        f"{type(dataset).__name__}: {why}"
    )


class ReplicaLoader:
    """One replica's batches of a map-style dataset, by step: `loader.batch(step)`.

        loader = ReplicaLoader(ds, global_batch_size=32, replica=1, data_parallel=4)
        batch = loader.batch(step)            # 8 samples: the second quarter of step's global batch

    Stateless: any step can be asked for in any order, which is what an exact resume needs.
    """

    def __init__(
        self,
        dataset: MapDataset,
        *,
        global_batch_size: int,
        replica: int,
        data_parallel: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_map_style(dataset)
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.replica = replica
        self.data_parallel = data_parallel
        self.seed = seed
        self.shuffle = shuffle
        self.dataset_size = len(dataset)
        if self.dataset_size < 1:
            raise ConfigError("ReplicaLoader needs a non-empty dataset (len(dataset) is 0)")
        # Validate every setting now rather than at the first step.
        sample_indices(
            0, replica, data_parallel, global_batch_size, self.dataset_size, seed=seed, shuffle=shuffle
        )

    @property
    def local_batch_size(self) -> int:
        """Samples this replica gets per step: global_batch_size // data_parallel."""
        return self.global_batch_size // self.data_parallel

    def indices(self, step: int) -> list[int]:
        """The dataset indices of this replica's share of step `step`."""
        return sample_indices(
            step,
            self.replica,
            self.data_parallel,
            self.global_batch_size,
            self.dataset_size,
            seed=self.seed,
            shuffle=self.shuffle,
        )

    def batch(self, step: int) -> dict[str, Tensor]:
        """This replica's share of step `step`'s global batch, collated."""
        return collate([self.dataset[i] for i in self.indices(step)])

    def global_batch(self, step: int) -> dict[str, Tensor]:
        """The whole global batch of step `step` (all replicas' shares, in replica order)."""
        idx = global_indices(
            step, self.global_batch_size, self.dataset_size, seed=self.seed, shuffle=self.shuffle
        )
        return collate([self.dataset[i] for i in idx])

    def __repr__(self) -> str:
        return (
            f"ReplicaLoader(replica={self.replica}/{self.data_parallel}, "
            f"global_batch_size={self.global_batch_size}, dataset_size={self.dataset_size}, "
            f"seed={self.seed}, shuffle={self.shuffle})"
        )


# ---------------------------------------------------------------------------- synthetic datasets

_CHAIN_TAG = 0xC4A1
_SAMPLE_TAG = 0x5A3B
_SUCCESSOR_PROBS = torch.tensor([0.55, 0.25, 0.12, 0.08])


def _bigram_chain(vocab_size: int, seed: int) -> list[list[int]]:
    """For each state, its 4 likely successor states, drawn once from `seed`."""
    g = _generator(seed, _CHAIN_TAG)
    return torch.randint(vocab_size, (vocab_size, len(_SUCCESSOR_PROBS)), generator=g).tolist()


def _walk(chain: list[list[int]], length: int, g: torch.Generator) -> list[int]:
    """A random walk of `length` states on `chain`, starting from a uniformly drawn state."""
    state = int(torch.randint(len(chain), (1,), generator=g))
    choices = torch.multinomial(_SUCCESSOR_PROBS, max(length - 1, 1), replacement=True, generator=g)
    out = [state]
    for c in choices.tolist()[: length - 1]:
        state = chain[state][c]
        out.append(state)
    return out


def _check_index(index: int, size: int) -> int:
    """`index` normalised to [0, size), or IndexError (so plain iteration stops)."""
    i = int(index)
    if i < 0:
        i += size
    if not 0 <= i < size:
        raise IndexError(f"index {index} out of range for a dataset of size {size}")
    return i


class SyntheticLM(Dataset[dict[str, Tensor]]):
    """Next-token samples from a fixed random sparse bigram chain: learnable in a few dozen steps.

    Each token has 4 likely successors (probabilities .55/.25/.12/.08, ~1.1 nats of entropy against
    ln(vocab_size) for a uniform guess). Sample i is a pure function of (seed, i); nothing but the
    vocab_size x 4 successor table is stored.

        ds = SyntheticLM(64, 16, 1000)
        ds[3]["input_ids"].shape   # torch.Size([16]); labels = input_ids shifted left by one
    """

    def __init__(self, vocab_size: int, seq_len: int, size: int, *, seed: int = 0) -> None:
        self.vocab_size = _check_int("vocab_size", vocab_size, minimum=2)
        self.seq_len = _check_int("seq_len", seq_len, minimum=1)
        self.size = _check_int("size", size, minimum=1)
        self.seed = seed
        self._chain = _bigram_chain(vocab_size, seed)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        i = _check_index(index, self.size)
        tokens = torch.tensor(_walk(self._chain, self.seq_len + 1, _generator(self.seed, _SAMPLE_TAG, i)))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class SyntheticMLM(Dataset[dict[str, Tensor]]):
    """Masked-LM samples: two segments, trailing padding on some, exactly `mask_per_sample` masks each.

    Because every sample has the same number of labelled positions, the loss over a batch (the mean
    over labelled tokens) equals the mean of its equal-sized micro-batches' losses, so pipelined and
    plain training can be compared exactly. Masked positions always hold `mask_id` (no 80/10/10).

    Keys: input_ids, attention_mask (1 real, 0 pad), token_type_ids (0 first segment, 1 second,
    0 on padding), labels (the original token at masked positions, -100 elsewhere).
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        size: int,
        *,
        mask_per_sample: int = 3,
        pad_id: int = 0,
        mask_id: int = 1,
        seed: int = 0,
    ) -> None:
        self.vocab_size = _check_int("vocab_size", vocab_size, minimum=4)
        self.seq_len = _check_int("seq_len", seq_len, minimum=2)
        self.size = _check_int("size", size, minimum=1)
        self.mask_per_sample = _check_int("mask_per_sample", mask_per_sample, minimum=1)
        if mask_per_sample > seq_len:
            raise ConfigError(
                f"mask_per_sample must be <= seq_len (mask_per_sample: {mask_per_sample}, "
                f"seq_len: {seq_len}); lower mask_per_sample or raise seq_len"
            )
        for name, value in (("pad_id", pad_id), ("mask_id", mask_id)):
            if not 0 <= value < vocab_size:
                raise ConfigError(f"{name} must be in [0, vocab_size) = [0, {vocab_size}) (got {value})")
        if pad_id == mask_id:
            raise ConfigError(f"pad_id and mask_id must differ (both are {pad_id})")
        self.pad_id = pad_id
        self.mask_id = mask_id
        self.seed = seed
        # Ordinary tokens: every id except pad and mask; the chain walks over their positions.
        self._tokens = [t for t in range(vocab_size) if t not in (pad_id, mask_id)]
        self._chain = _bigram_chain(len(self._tokens), seed)
        self._min_len = max(mask_per_sample, 2, seq_len // 2)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        i = _check_index(index, self.size)
        g = _generator(self.seed, _SAMPLE_TAG, i)
        padded = bool(torch.rand((), generator=g) < 0.5) and self._min_len < self.seq_len
        length = int(torch.randint(self._min_len, self.seq_len, (), generator=g)) if padded else self.seq_len
        split = int(torch.randint(1, length, (), generator=g))
        masked = torch.randperm(length, generator=g)[: self.mask_per_sample]

        tokens = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        tokens[:length] = torch.tensor([self._tokens[s] for s in _walk(self._chain, length, g)])
        attention_mask = torch.zeros(self.seq_len, dtype=torch.long)
        attention_mask[:length] = 1
        token_type_ids = torch.zeros(self.seq_len, dtype=torch.long)
        token_type_ids[split:length] = 1
        labels = torch.full((self.seq_len,), -100, dtype=torch.long)
        labels[masked] = tokens[masked]
        input_ids = tokens.clone()
        input_ids[masked] = self.mask_id
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_type_ids": token_type_ids,
            "labels": labels,
        }


def slice_batch(
    batch: Mapping[str, Any], start: int, stop: int, device: torch.device | None = None
) -> dict[str, Any]:
    """Rows `start:stop` of every tensor in `batch` (other values as they are), moved to `device`."""
    return {
        k: (v[start:stop] if device is None else v[start:stop].to(device, non_blocking=True))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }


def batch_len(batch: Mapping[str, Any]) -> int:
    """The batch dimension shared by `batch`'s tensors; ConfigError if there is none or they disagree."""
    lengths = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not lengths:
        raise ConfigError("a batch must be a dict holding at least one tensor with a batch dimension")
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"the batch's tensors disagree on the batch dimension: {lengths}")
    return next(iter(lengths.values()))
