"""Tests of the reference models: the contract the engine relies on, tying, masks, presets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from varuna.cut.cutpoint import CutPoint, handling
from varuna.cut.partition import trace_model
from varuna.cut.standin import StandIn, origin_of, stand_in_context
from varuna.errors import ConfigError, PartitionError
from varuna.models import (
    GPT,
    BertConfig,
    BertMLM,
    GPTConfig,
    bert_tiny,
    count_parameters,
    gpt_bench,
    gpt_demo,
    gpt_tiny,
)

torch.set_num_threads(1)


def gpt_batch(cfg: GPTConfig, batch: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def bert_batch(cfg: BertConfig, batch: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = cfg.seq_len
    ids = torch.randint(2, cfg.vocab_size, (batch, T), generator=g)
    attention_mask = torch.ones(batch, T, dtype=torch.long)
    attention_mask[0, T - 4 :] = 0  # sample 0 has 4 padded positions
    ids[0, T - 4 :] = 0
    token_type_ids = torch.zeros(batch, T, dtype=torch.long)
    token_type_ids[:, T // 2 :] = 1
    labels = torch.full((batch, T), -100)
    labels[:, 2] = ids[:, 2]
    labels[:, 5] = ids[:, 5]
    ids[:, 2] = 1
    ids[:, 5] = 1
    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "labels": labels,
    }


def tiny_gpt(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(gpt_tiny(), **overrides))


def tiny_bert() -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(bert_tiny())


class _Replace:
    """Cut handler: at cut `target` return `value`, elsewhere the identity; records calls."""

    def __init__(self, target: CutPoint | None = None, value: object = None) -> None:
        self.target = target
        self.value = value
        self.seen: list[CutPoint] = []

    def on_cut(self, cut: CutPoint, value: object) -> object:
        self.seen.append(cut)
        return self.value if cut is self.target else value


# ------------------------------------------------------------------------------------------ GPT


def test_presets() -> None:
    tiny = gpt_tiny()
    assert (tiny.vocab_size, tiny.seq_len, tiny.d_model, tiny.n_layer, tiny.n_head) == (64, 16, 32, 4, 2)
    bench = gpt_bench()
    assert (bench.vocab_size, bench.seq_len, bench.d_model, bench.n_layer, bench.n_head) == (
        4096,
        128,
        256,
        8,
        8,
    )
    b = bert_tiny()
    assert (b.vocab_size, b.seq_len, b.d_model, b.n_layer, b.n_head, b.type_vocab_size) == (
        64,
        16,
        32,
        4,
        2,
        2,
    )


def test_gpt_forward_is_finite_scalar_near_uniform() -> None:
    model = tiny_gpt()
    loss = model(**gpt_batch(model.config))
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Small init: the prediction starts close to uniform.
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 0.2
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpt_loss_is_mean_over_tokens() -> None:
    """The mean over a batch equals the mean of the equal-sized halves: micro-batching is exact."""
    model = tiny_gpt()
    batch = gpt_batch(model.config, batch=4)
    whole = model(**batch)
    halves = [model(**{k: v[i : i + 2] for k, v in batch.items()}) for i in (0, 2)]
    torch.testing.assert_close(whole, (halves[0] + halves[1]) / 2)


def test_gpt_tied_embeddings_share_one_parameter() -> None:
    model = tiny_gpt()
    assert model.lm_head is None
    params = list(model.parameters())
    assert sum(p is model.wte.weight for p in params) == 1
    # The head reads wte.weight: its gradient carries the output-layer contribution.
    model(**gpt_batch(model.config)).backward()
    assert model.wte.weight.grad is not None
    assert int((model.wte.weight.grad.abs().sum(dim=1) > 0).sum()) == model.config.vocab_size


def test_gpt_untied_has_separate_head() -> None:
    tied, untied = tiny_gpt(), tiny_gpt(tie_embeddings=False)
    assert isinstance(untied.lm_head, nn.Linear) and untied.lm_head.bias is None
    assert untied.lm_head.weight is not untied.wte.weight
    cfg = gpt_tiny()
    assert count_parameters(untied) - count_parameters(tied) == cfg.vocab_size * cfg.d_model
    assert torch.isfinite(untied(**gpt_batch(cfg)))


def test_count_parameters_counts_tied_once() -> None:
    model = tiny_gpt()
    cfg = model.config
    per_block = 2 * 2 * cfg.d_model + (cfg.d_model * 3 * cfg.d_model + 3 * cfg.d_model)
    per_block += cfg.d_model * cfg.d_model + cfg.d_model
    per_block += 2 * 4 * cfg.d_model * cfg.d_model + 4 * cfg.d_model + cfg.d_model
    expected = (cfg.vocab_size + cfg.seq_len) * cfg.d_model + cfg.n_layer * per_block + 2 * cfg.d_model
    assert count_parameters(model) == expected == 53440


def test_gpt_demo_is_about_ten_million_parameters() -> None:
    n = count_parameters(GPT(gpt_demo()))
    assert 8_000_000 <= n <= 12_000_000


@pytest.mark.parametrize("make", [tiny_gpt, tiny_bert])
def test_cutpoints_n_layer_minus_one_each_called_once_in_order(make: object) -> None:
    model = make()  # type: ignore[operator]
    cuts = [m for m in model.modules() if isinstance(m, CutPoint)]
    assert len(cuts) == len(model.cuts) == model.config.n_layer - 1
    calls: list[int] = []
    for i, cut in enumerate(cuts):
        cut.register_forward_hook(lambda mod, inp, out, i=i: calls.append(i))
    batch = gpt_batch(model.config) if isinstance(model, GPT) else bert_batch(model.config)
    model(**batch)
    assert calls == list(range(len(cuts)))


@pytest.mark.parametrize("make", [tiny_gpt, tiny_bert])
@pytest.mark.parametrize("cut", [0, 1, 2])
def test_the_model_runs_on_a_stand_in_and_the_loss_says_where_it_came_from(make: object, cut: int) -> None:
    """A value another stage computes is a stand-in (shape, dtype, device): the rest of the model
    runs on it without data, and the loss it reaches is a stand-in naming its origin."""
    model = make()  # type: ignore[operator]
    batch = gpt_batch(model.config) if isinstance(model, GPT) else bert_batch(model.config)
    captured: list[torch.Tensor] = []
    model.cuts[cut].register_forward_hook(lambda mod, inp, out: captured.append(out))
    model(**batch)
    stand_in = StandIn(captured[0].to("meta"), captured[0].device, f"blocks.{cut}")
    handler = _Replace(model.cuts[cut], stand_in)
    names = {id(p): n for n, p in model.named_parameters()}
    # A stand-in reaching a module whose parameters this stage trains is an error, naming both.
    with handling(handler), stand_in_context(1, f"cuts.{cut}", names):
        with pytest.raises(
            PartitionError,
            match=rf"on stage 1, \w+ with parameter 'blocks\.{cut + 1}\..*"
            rf"uses the output of module 'blocks\.{cut}'.*CutPoint 'cuts\.{cut}'",
        ):
            model(**batch)
    # Frozen (as on a stage that holds none of them), the model runs on it without data.
    model.requires_grad_(False)
    handler.seen.clear()
    with handling(handler):
        out = model(**batch)
    assert isinstance(out, StandIn) and out.shape == () and out.device == captured[0].device
    assert origin_of(out) == f"blocks.{cut}"
    assert handler.seen == list(model.cuts)


@pytest.mark.parametrize("make", [tiny_gpt, tiny_bert])
def test_only_the_activation_crosses_a_cut(make: object) -> None:
    """Swapping in the activation captured at a cut (as a receiving stage does) gives the same loss."""
    model = make()  # type: ignore[operator]
    batch = gpt_batch(model.config) if isinstance(model, GPT) else bert_batch(model.config)
    captured: list[torch.Tensor] = []
    model.cuts[1].register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    reference = model(**batch)
    received = captured[0].requires_grad_()
    with handling(_Replace(model.cuts[1], received)):
        loss = model(**batch)
    torch.testing.assert_close(loss, reference)
    loss.backward()
    assert received.grad is not None and received.grad.abs().sum() > 0


def test_init_is_deterministic_under_seed_and_gpt2_style() -> None:
    a, b = tiny_gpt(), tiny_gpt()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    torch.manual_seed(1)
    c = GPT(gpt_tiny())
    assert not torch.equal(a.wte.weight, c.wte.weight)
    qkv = a.blocks[0].attn.qkv
    assert torch.count_nonzero(qkv.bias) == 0
    assert 0.015 < float(qkv.weight.detach().std()) < 0.025
    assert torch.equal(a.ln_f.weight, torch.ones_like(a.ln_f.weight))


def test_gpt_is_causal() -> None:
    """Changing a later token leaves the logits of earlier positions, hence their loss, unchanged."""
    model = tiny_gpt()
    batch = gpt_batch(model.config, batch=1)
    ids = batch["input_ids"].clone()
    labels = batch["labels"].clone()
    labels[:, 8:] = -100  # cross_entropy ignores -100 by default: score positions 0..7 only
    before = model(input_ids=ids, labels=labels)
    ids[:, 12] = (ids[:, 12] + 1) % model.config.vocab_size
    torch.testing.assert_close(model(input_ids=ids, labels=labels), before)
    ids[:, 3] = (ids[:, 3] + 1) % model.config.vocab_size
    assert not torch.allclose(model(input_ids=ids, labels=labels), before)


def test_gpt_rejects_sequence_longer_than_config() -> None:
    model = tiny_gpt()
    ids = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"17 positions but GPTConfig.seq_len is 16"):
        model(input_ids=ids, labels=ids)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 30, "n_head": 4}, r"d_model must be divisible by n_head \(d_model: 30, n_head: 4\)"),
        ({"n_layer": 0}, r"GPTConfig.n_layer must be a positive integer \(got 0\)"),
        ({"vocab_size": -1}, r"GPTConfig.vocab_size must be a positive integer"),
        ({"seq_len": 2.5}, r"GPTConfig.seq_len must be a positive integer \(got 2.5\)"),
        ({"dropout": 1.0}, r"GPTConfig.dropout must be in \[0, 1\)"),
    ],
)
def test_gpt_config_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_config_error_suggests_a_divisor() -> None:
    with pytest.raises(ConfigError, match=r"change n_head to a divisor of d_model, e\.g\. 3"):
        GPTConfig(d_model=30, n_head=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 32, "n_head": 3}, r"BertConfig.d_model must be divisible by n_head"),
        ({"type_vocab_size": 0}, r"BertConfig.type_vocab_size must be >= 1 \(got 0\)"),
        ({"layer_norm_eps": 0.0}, r"BertConfig.layer_norm_eps must be > 0"),
    ],
)
def test_bert_config_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BertConfig(**kwargs)  # type: ignore[arg-type]


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        GPTConfig(64)  # type: ignore[misc]


# ----------------------------------------------------------------------------------------- BERT


def test_bert_forward_is_finite_scalar_and_backprops() -> None:
    model = tiny_bert()
    loss = model(**bert_batch(model.config))
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 0.5
    loss.backward()
    assert model.decoder_bias.grad is not None
    assert model.token_type_embeddings.weight.grad is not None


def test_bert_decoder_tied_to_word_embeddings() -> None:
    model = tiny_bert()
    assert sum(p is model.word_embeddings.weight for p in model.parameters()) == 1
    assert model.decoder_bias.shape == (model.config.vocab_size,)


def test_bert_loss_is_mean_over_labelled_positions() -> None:
    """Positions labelled -100 are ignored; the loss averages over the labelled ones."""
    model = tiny_bert()
    batch = bert_batch(model.config)  # labels at positions 2 and 5 of every sample
    only = []
    for keep in (2, 5):
        one = {k: v.clone() for k, v in batch.items()}
        one["labels"][:, 7 - keep] = -100
        only.append(model(**one))
    torch.testing.assert_close(model(**batch), (only[0] + only[1]) / 2)


def test_bert_padding_is_masked_out() -> None:
    """Padded tokens don't reach the loss when masked, and do when the mask is dropped."""
    model = tiny_bert()
    batch = bert_batch(model.config)
    before = model(**batch)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, -4:] = 7  # the padded positions of sample 0
    assert torch.equal(model(**changed), before)

    unmasked = {k: v.clone() for k, v in batch.items()}
    unmasked["attention_mask"].fill_(1)
    unmasked_changed = {k: v.clone() for k, v in unmasked.items()}
    unmasked_changed["input_ids"][0, -4:] = 7
    assert not torch.equal(model(**unmasked), model(**unmasked_changed))


def test_bert_is_bidirectional_and_uses_token_types() -> None:
    model = tiny_bert()
    batch = bert_batch(model.config, batch=1)
    before = model(**batch)
    later = {k: v.clone() for k, v in batch.items()}
    later["input_ids"][0, 10] = (later["input_ids"][0, 10] + 1) % model.config.vocab_size
    assert not torch.allclose(model(**later), before)  # position 10 informs the mask at position 2
    types = {k: v.clone() for k, v in batch.items()}
    types["token_type_ids"].zero_()
    assert not torch.allclose(model(**types), before)


def test_extended_attention_mask() -> None:
    mask = torch.tensor([[1, 1, 0]])
    ext = BertMLM.extended_attention_mask(mask)
    assert ext.shape == (1, 1, 1, 3) and ext.dtype == torch.float32
    assert ext[0, 0, 0, :2].eq(0).all() and ext[0, 0, 0, 2] < -1e30


def test_bert_under_bf16_autocast() -> None:
    model = tiny_bert()
    batch = bert_batch(model.config)
    reference = model(**batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch)
    assert torch.isfinite(loss)
    assert abs(loss.item() - reference.item()) < 0.05


def test_gpt_cut_inside_blocks_is_the_same_model_with_finer_cuts() -> None:
    plain, fine = tiny_gpt(), tiny_gpt(cut_inside_blocks=True)
    assert fine.state_dict().keys() == plain.state_dict().keys()
    batch = gpt_batch(plain.config)
    torch.testing.assert_close(fine(**batch), plain(**batch))
    # the cuts in call order: inside block 0, after block 0, inside block 1, ...; none after the last
    n = plain.config.n_layer
    expected = [name for i in range(n) for name in (f"blocks.{i}.mid", f"cuts.{i}")][:-1]
    assert trace_model(fine, batch).cut_names == expected
    assert gpt_bench().cut_inside_blocks and not gpt_tiny().cut_inside_blocks
