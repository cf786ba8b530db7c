"""A stage's backward split into its input half and its weight half (varuna/_backward.py) computes
exactly what one backward() computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from varuna.engine.backward import input_grads_first


class _Stage(nn.Module):
    """A middle stage: LayerNorm, an MLP with biases, a weight used twice, an unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.gate = nn.Parameter(torch.randn(16))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + h * self.gate + torch.tanh(h * self.gate)  # gate used twice


def _run(model: nn.Module, x0: torch.Tensor, g: torch.Tensor, split: bool, hook: bool = False):
    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=x0.dtype == torch.bfloat16):
        out = model(x.float() if x0.dtype == torch.bfloat16 else x)
    if hook:  # a user hook on an intermediate of the input path: it must act once
        out.register_hook(lambda grad: grad * 3)
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    if not split:
        out.backward(g)
        return x.grad, [p.grad for p in params]
    result = input_grads_first([out], [g], [x], params)
    assert result is not None
    (dx,), weights = result
    assert all(p.grad is None for p in params)  # the input half leaves the weights alone
    weights.run()
    return dx, [p.grad for p in params]


@pytest.mark.parametrize("hook", [False, True])
def test_the_two_halves_equal_one_backward(hook: bool) -> None:
    torch.manual_seed(0)
    model = _Stage()
    x0, g = torch.randn(4, 5, 16), torch.randn(4, 5, 16)
    dx, grads = _run(model, x0, g, split=False, hook=hook)
    sx, split = _run(model, x0, g, split=True, hook=hook)
    torch.testing.assert_close(sx, dx, rtol=0, atol=0)
    for name, a, b in zip([n for n, _ in model.named_parameters()], grads, split):
        if a is None:  # the unused parameter gets no gradient either way
            assert b is None, name
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_under_bf16_autocast() -> None:
    torch.manual_seed(1)
    model = _Stage()
    x0, g = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    dx, grads = _run(model, x0.bfloat16(), g, split=False)
    sx, split = _run(model, x0.bfloat16(), g, split=True)
    torch.testing.assert_close(sx, dx, rtol=0, atol=0)
    for a, b in zip(grads, split):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_weight_half_adds_into_existing_gradients_in_place() -> None:
    torch.manual_seed(2)
    model = _Stage()
    buffer = torch.ones(16 * 32 + 32)  # the engine's gradient buckets: .grad is a view of them
    model.up.weight.grad = buffer[: 16 * 32].view(32, 16)
    model.up.bias.grad = buffer[16 * 32 :]
    x = torch.randn(2, 16, requires_grad=True)
    out = model(x)
    result = input_grads_first([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert result is not None
    result[1].run()
    assert model.up.weight.grad.data_ptr() == buffer.data_ptr()  # still the view
    reference = _Stage()
    reference.load_state_dict(model.state_dict())
    reference(x.detach().requires_grad_()).backward(torch.ones_like(out))
    torch.testing.assert_close(buffer[: 16 * 32].view(32, 16), reference.up.weight.grad + 1)


def test_an_output_independent_of_the_input_does_not_split() -> None:
    model = _Stage()
    x = torch.randn(2, 16, requires_grad=True)
    side = model.gate * 2  # a stage output that only the parameters make
    assert (
        input_grads_first(
            [model(x), side], [torch.ones(2, 16), torch.ones(16)], [x], list(model.parameters())
        )
        is None
    )
    assert all(p.grad is None for p in model.parameters())  # nothing was computed


def test_a_weight_shared_by_two_layers_off_the_input_path() -> None:
    """DeBERTa's relative-position embeddings feed every layer's attention: the two layers' weight
    halves are one group, whose pass crosses the input path between them (it must not free what the
    next group needs)."""
    torch.manual_seed(0)
    rel = nn.Parameter(torch.randn(4, 8))
    q1, q2, p1, p2 = (nn.Linear(8, 8) for _ in range(4))
    params = [rel, *q1.parameters(), *q2.parameters(), *p1.parameters(), *p2.parameters()]

    def stage(x: torch.Tensor) -> torch.Tensor:
        h = x + (q1(x) @ p1(rel).T) @ p1(rel)
        return h + (q2(h) @ p2(rel).T) @ p2(rel)

    x = torch.randn(3, 8, requires_grad=True)
    out = stage(x)
    g = torch.randn_like(out)
    out.backward(g)
    want = [p.grad.clone() for p in params]
    want_x = x.grad.clone()
    for p in params:
        p.grad = None
    split = input_grads_first([stage(x)], [g], [x], params)
    assert split is not None
    found, weights = split
    torch.testing.assert_close(found[0], want_x)
    weights.run()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
