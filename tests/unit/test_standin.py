"""Tests of varuna/_standin.py: what a stage's glue code sees in place of another stage's values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from varuna.cut import standin as _standin
from varuna.cut.standin import SkippedForward, StandIn, contains_stand_in, origin_of, stand_in_context
from varuna.errors import PartitionError


def _stand_in(*shape: int, dtype: torch.dtype = torch.float32, origin: str = "blocks.0") -> StandIn:
    return StandIn(torch.empty(shape, dtype=dtype, device="meta"), torch.device("cpu"), origin)


def test_glue_code_of_real_models_runs_on_a_stand_in() -> None:
    x = _stand_in(4, 16, 32)
    assert x.shape == (4, 16, 32) and x.dtype == torch.float32 and x.device == torch.device("cpu")
    output_shape = (-1,) + x.size()[1:-1] + (x.size(-1),)  # GPT-2's output_shape
    assert torch.Size(output_shape) == (-1, 16, 32)
    positions = torch.arange(x.shape[1], device=x.device)  # Llama's cache_position: a real tensor
    assert positions.tolist() == list(range(16))
    mask = torch.ones(4, 16).to(dtype=x.dtype, device=x.device)  # BERT's mask, cast to the embedding's dtype
    assert mask.dtype == torch.float32 and not isinstance(mask, StandIn)
    half = x.to(x.device, torch.float16)
    assert isinstance(half, StandIn) and half.dtype == torch.float16 and half.device == x.device
    y = (x + positions[None, :, None]).view(4, -1).transpose(0, 1)[:, :2]
    assert isinstance(y, StandIn) and y.shape == (512, 2) and origin_of(y) == "blocks.0"
    a, b = x.chunk(2, dim=-1)
    assert isinstance(a, StandIn) and a.shape == (4, 16, 16)
    assert isinstance(torch.nn.functional.dropout(x, 0.5, training=True), StandIn)


def test_a_stand_in_carries_no_autograd_and_repeats_cost_a_lookup() -> None:
    x = _stand_in(2, 3)
    w = torch.randn(2, 3, requires_grad=True)  # a real tensor that requires grad, not a parameter
    y = x * w
    assert isinstance(y, StandIn) and not y.requires_grad and y.grad_fn is None
    _standin._op_cache.clear()
    x + 1
    cached = len(_standin._op_cache)
    x + 1
    _stand_in(2, 3) + 1  # another stand-in of the same shape: the same entry
    assert cached >= 1 and len(_standin._op_cache) == cached


def test_leaves_are_pytrees_leaves_in_its_order() -> None:
    from collections import OrderedDict, namedtuple

    from torch.utils._pytree import tree_flatten

    Pair = namedtuple("Pair", "a b")
    x, w = _stand_in(2, 3), nn.Parameter(torch.ones(2))
    for args, kwargs in [
        ((x, 1, None), {}),
        ((x, [w, (2.0, torch.float16)]), {"dim": -1, "out": None}),
        ((Pair(x, w), OrderedDict(k=w)), {"nested": {"t": (x,)}}),  # pytree's own containers
        ((torch.Size([2, 3]), torch.device("cpu"), "s"), {}),
    ]:
        got = _standin._leaves(args, kwargs)
        want = tree_flatten((args, kwargs))[0]
        assert len(got) == len(want) and all(a is b or a == b for a, b in zip(got, want))


def test_values_of_a_stand_in_cannot_be_read() -> None:
    x = _stand_in(3, origin="transformer.h.2")
    with stand_in_context(1, "transformer.varuna_cuts.3", {}):
        with pytest.raises(
            PartitionError,
            match=r"on stage 1, .*item.*uses the output of module 'transformer\.h\.2'"
            r".*CutPoint 'transformer\.varuna_cuts\.3' \(where stage 1 starts\)",
        ):
            x.sum().item()
        with pytest.raises(PartitionError, match="needs the values and not only the shape"):
            bool(x.any())


def test_a_stand_in_into_a_trained_parameter_or_a_real_tensor_in_place_is_an_error() -> None:
    layer = nn.Linear(3, 3)
    names = {id(p): f"head.{n}" for n, p in layer.named_parameters()}
    x = _stand_in(2, 3, origin="encoder.layer.1")
    with stand_in_context(2, "encoder.varuna_cuts.1", names):
        with pytest.raises(
            PartitionError,
            match=r"linear with parameter 'head\.weight' uses the output of module "
            r"'encoder\.layer\.1'",
        ):
            layer(x)
        real = torch.zeros(2, 3)
        with pytest.raises(PartitionError, match=r"in-place add_ into a tensor of this stage"):
            real.add_(x)
    layer.requires_grad_(False)  # frozen (or meta) parameters are not this stage's training
    assert isinstance(layer(x), StandIn)


def test_contains_and_origin_look_inside_containers() -> None:
    x = _stand_in(1, origin="h.0")
    assert contains_stand_in({"a": (torch.zeros(1), [x])}) and origin_of([torch.zeros(1), (x,)]) == "h.0"
    assert not contains_stand_in((torch.zeros(1), {"b": 3}))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, use_cache: bool = False) -> tuple:
        self.calls += 1
        return self.fc(x), (x.sum(-1) if use_cache else None)


def test_skipped_forward_infers_on_meta_once_per_input_signature() -> None:
    block = _Block().to("meta")
    skipped = SkippedForward(block, "h.3", torch.device("cpu"))
    real = torch.randn(2, 5, 8)
    out, cache = skipped(real, None)
    assert isinstance(out, StandIn) and out.shape == (2, 5, 16) and out.origin == "h.3" and cache is None
    skipped(_stand_in(2, 5, 8), None)  # a stand-in of the same shape: the cached result
    assert block.calls == 1
    out, cache = skipped(real[:1], torch.ones(1, 5), use_cache=True)  # another signature: inferred again
    assert (
        block.calls == 2 and out.shape == (1, 5, 16) and isinstance(cache, StandIn) and cache.shape == (1, 5)
    )


def test_the_traces_shapes_serve_where_the_meta_device_cannot() -> None:
    """Routing on data (a mixture of experts) has no meta kernel; the start-up trace saw the real
    output, and the skipped module returns stand-ins of that; unseen shapes are a PartitionError."""

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            picked = (self.fc(x).sum(-1) > 0).nonzero()  # data-dependent
            return self.fc(x) + picked.shape[0]

    model = nn.Sequential(Router(), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    with _standin.record_outputs(model) as seen:
        model(x)
    assert set(seen) == {"0", "0.fc", "1"}  # every module with parameters, not containers
    router = model[0].to("meta")
    skipped = SkippedForward(router, "0", torch.device("cpu"), seen["0"])
    out = skipped(x)
    assert isinstance(out, StandIn) and out.shape == (3, 8) and out.origin == "0"
    with stand_in_context(1, "cuts.0", {}):
        with pytest.raises(
            PartitionError,
            match=r"stage 1 skips module '0' .*the start-up trace saw no call "
            r"with these input shapes, and running it on the meta device failed",
        ):
            skipped(torch.randn(5, 8))


def test_strip_skips_the_blocks_of_a_list_another_stage_holds_not_the_list() -> None:
    """A ModuleList is never called (the model loops over it): its blocks must be the skipped ones."""
    from varuna.engine.stage import strip

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h).sum()

    net = Net()
    strip(net, {"head.weight", "head.bias"}, torch.device("cpu"))
    assert isinstance(net.blocks[0].forward, SkippedForward) and isinstance(net.embed.forward, SkippedForward)
    assert not isinstance(net.blocks.forward, SkippedForward)
    net.head.requires_grad_(False)  # a stand-in reaching a trained head is an error (tested above)
    out = net(torch.randn(2, 4))
    assert isinstance(out, StandIn) and out.origin == "blocks.1"
