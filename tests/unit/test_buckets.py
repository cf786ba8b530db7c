"""The data-parallel gradient buckets' layout (`varuna.comm.buckets.GradBuckets`): filled from the
last parameter back, the bucket all-reduced first small, as DDP's."""

from __future__ import annotations

import torch

from varuna.comm.buckets import GradBuckets


def _params(*numels: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n)) for n in numels]


def test_the_first_bucket_all_reduced_is_the_last_parameters_and_small() -> None:
    mib = 2**20 // 4  # float32 elements in a MiB
    params = _params(mib, mib, mib, mib // 4, mib // 4, mib // 2)
    buckets = GradBuckets(params, bucket_bytes=3 * 2**20, first_bucket_bytes=3 * 2**18)
    sizes = [[p.numel() for p in members] for members in buckets.members]
    # the last bucket starts first: the model's last parameters, at most 0.75 MiB; the others 3 MiB
    assert sizes == [[mib], [mib, mib, mib // 4], [mib // 4, mib // 2]]
    # every parameter once, in the parameters' order, its gradient a view of its bucket's buffer
    assert [p for members in buckets.members for p in members] == params
    buckets.zero_and_attach()
    for members, flat in zip(buckets.members, buckets.buffers, strict=True):
        assert flat.numel() == sum(p.numel() for p in members)
        assert all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            for p in members
        )


def test_a_parameter_larger_than_its_cap_gets_a_bucket_of_its_own() -> None:
    mib = 2**20 // 4
    params = _params(mib, 3 * mib, mib)
    buckets = GradBuckets(params, bucket_bytes=2 * 2**20, first_bucket_bytes=2**20)
    assert [[p.numel() for p in m] for m in buckets.members] == [[mib], [3 * mib], [mib]]
