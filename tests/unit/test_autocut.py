"""Tests of varuna/autocut.py: CutPoints inserted between repeated blocks, without the model's help.

The models here have no CutPoints: our GPT with its cut list emptied, small look-alikes with
the attribute structure of the transformers library's GPT-2 (`transformer.h`, blocks returning
tuples) and BERT (`bert.encoder.layer`), and the transformers library's own GPT-2 and BERT built
from a config (a dev dependency). These tests check structure and that auto_cut changes no numbers;
the real engine trains cut models at P x D > 1 in tests/multirank/test_transformers.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from varuna import auto_cut
from varuna.cut.autocut import find_blocks
from varuna.cut.cutpoint import CutPoint, handling
from varuna.cut.partition import make_partition, trace_model
from varuna.errors import PartitionError
from varuna.models import GPT, gpt_tiny


def _uncut_gpt() -> GPT:
    model = GPT(gpt_tiny())
    model.cuts = nn.ModuleList()  # forward calls `self.cuts[i]` only for i < len(self.cuts)
    return model


def _gpt_batch(n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


# --- look-alikes of the transformers library's models (structure only) --------------------------


class _HFAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class _GPT2Block(nn.Module):
    """Returns (hidden_states, present) as transformers' GPT2Block does with use_cache=True."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), _HFAttention(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = hidden_states + self.attn(self.ln_1(hidden_states))
        h = h + self.mlp(self.ln_2(h))
        return h, h.detach().sum(-1)  # a stand-in for the key/value cache


class _GPT2Model(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(_GPT2Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for block in self.h:
            outputs = block(hidden_states)
            hidden_states = outputs[0]
        return self.ln_f(hidden_states)


class _GPT2LMHeadModel(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 3) -> None:
        super().__init__()
        self.transformer = _GPT2Model(vocab, d, n_layer)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.transformer(input_ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _BertLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attention, self.ln = _HFAttention(d), nn.LayerNorm(d)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.ln(hidden_states + self.attention(hidden_states, mask)),)


class _BertEncoder(nn.Module):
    def __init__(self, d: int, n_layer: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_BertLayer(d) for _ in range(n_layer))

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, mask)[0]
        return hidden_states


class _BertModel(nn.Module):
    def __init__(self, d: int, n_layer: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(64, d)
        self.encoder = _BertEncoder(d, n_layer)


class _BertForMaskedLM(nn.Module):
    def __init__(self, d: int = 32, n_layer: int = 4) -> None:
        super().__init__()
        self.bert = _BertModel(d, n_layer)
        self.cls = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        mask = (1.0 - attention_mask[:, None, :].float()) * -1e9
        h = self.bert.encoder(self.bert.embeddings(input_ids), mask)
        logits = F.linear(self.cls(h), self.bert.embeddings.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# --- helpers ------------------------------------------------------------------------------------------


def _plain_loss_and_grads(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(**batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


# --- tests -------------------------------------------------------------------------------------------


def test_gpt_without_cuts_trains_like_the_annotated_gpt() -> None:
    torch.manual_seed(0)
    manual = GPT(gpt_tiny())
    auto = _uncut_gpt()
    auto.load_state_dict(manual.state_dict())  # auto_cut leaves the state_dict keys alone
    names = auto_cut(auto)
    assert names == [f"varuna_cuts.{i}" for i in range(gpt_tiny().n_layer - 1)]
    assert auto.state_dict().keys() == manual.state_dict().keys()
    batch = _gpt_batch()
    assert trace_model(auto, batch).cut_names == names
    losses = {}
    for label, model in (("manual", manual), ("auto", auto)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[label] = []
        for _ in range(3):
            loss = model(**batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[label].append(loss.item())
    assert losses["auto"] == losses["manual"]
    partition = make_partition(trace_model(auto, batch), 2)
    assert partition.stage_params == make_partition(trace_model(manual, batch), 2).stage_params


def test_gpt2_look_alike_with_tuple_outputs() -> None:
    torch.manual_seed(0)
    model = _GPT2LMHeadModel(n_layer=3)
    uncut = copy.deepcopy(model)
    assert find_blocks(model) == ("transformer.h", ["transformer.h.0", "transformer.h.1", "transformer.h.2"])
    names = auto_cut(model)
    assert names == ["transformer.varuna_cuts.0", "transformer.varuna_cuts.1"]
    batch = _gpt_batch()
    out = model.transformer.h[0](torch.zeros(1, 16, 32))
    assert isinstance(out, tuple) and len(out) == 2  # the rest of the tuple is kept
    assert trace_model(model, batch).cut_names == names
    torch.testing.assert_close(_plain_loss_and_grads(model, batch), _plain_loss_and_grads(uncut, batch))


def test_a_tuple_block_gives_the_spliced_value_at_index_zero() -> None:
    """At a stage's input cut, the block's hidden states are replaced and the rest of its tuple kept."""
    model = _GPT2LMHeadModel(n_layer=2)
    auto_cut(model)
    received = torch.randn(4, 16, 32)

    class Splice:
        def on_cut(self, cut: CutPoint, value: Any) -> Any:
            return received

    with handling(Splice()):
        out = model.transformer.h[0](torch.zeros(4, 16, 32))
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0] is received and out[1].shape == (4, 16)


def test_bert_look_alike_and_deepcopy() -> None:
    torch.manual_seed(0)
    model = _BertForMaskedLM(n_layer=4)
    names = auto_cut(model)
    assert names == [f"bert.encoder.varuna_cuts.{i}" for i in range(3)]
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long), "labels": ids}
    clone = copy.deepcopy(model)  # the copy's hooks must call the copy's CutPoints
    assert trace_model(clone, batch).cut_names == names
    calls: list[str] = []
    for name, cut in clone.named_modules():
        if isinstance(cut, CutPoint):
            cut.register_forward_hook(lambda *_, name=name: calls.append(name))
    torch.testing.assert_close(_plain_loss_and_grads(clone, batch), _plain_loss_and_grads(model, batch))
    assert calls == names


def test_no_repeated_blocks_is_an_error() -> None:
    flat = nn.Module()
    flat.embed, flat.body = nn.Embedding(8, 4), nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8))
    flat.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # repeated, but nothing to balance
    with pytest.raises(
        PartitionError,
        match=r"no repeated blocks in Module: .*containers seen: body \(Sequential of LayerNorm, Linear, ReLU\); acts",
    ):
        auto_cut(flat)
    wrapped = nn.Module()
    wrapped.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # two blocks of one class: fine
    assert auto_cut(wrapped) == ["varuna_cuts.0"]


def test_a_model_that_is_its_own_block_list_is_an_error() -> None:
    with pytest.raises(PartitionError, match="the model is itself an Sequential"):
        auto_cut(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def test_model_with_cutpoints_is_an_error() -> None:
    with pytest.raises(PartitionError, match=r"already has CutPoints \(\['cuts.0'"):
        auto_cut(GPT(gpt_tiny()))


def test_explicit_blocks_argument() -> None:
    model = _uncut_gpt()
    assert auto_cut(model, blocks="blocks") == [f"varuna_cuts.{i}" for i in range(3)]
    with pytest.raises(PartitionError, match=r"auto_cut\(blocks='ln_f'\) names a LayerNorm"):
        auto_cut(_uncut_gpt(), blocks="ln_f")
    with pytest.raises(PartitionError, match=r"auto_cut\(blocks='nope'\): no such submodule"):
        auto_cut(_uncut_gpt(), blocks="nope")


class _LossOf(nn.Module):
    """What a user writes around a transformers model: forward(**batch) returns the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.model(**batch).loss


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_transformers_models_built_from_a_config(arch: str) -> None:
    """Structure only: the blocks found, the names, the state_dict keys, the trace. The real
    engine trains these models at P x D > 1 in tests/multirank/test_transformers.py."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = {"vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    batch = _gpt_batch()
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=3,
            n_embd=32,
            n_head=2,
            n_positions=32,
            use_cache=False,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            **small,
        )
        model, container = _LossOf(transformers.GPT2LMHeadModel(config)), "model.transformer"
        batch["labels"] = batch["input_ids"]  # the model shifts them itself
    else:
        config = transformers.BertConfig(
            num_hidden_layers=3,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **small,
        )
        model, container = _LossOf(transformers.BertForMaskedLM(config)), "model.bert.encoder"
        mask = torch.ones_like(batch["input_ids"])
        mask[:, 12:] = 0  # padding: every stage needs the mask, computed from the batch
        batch["attention_mask"] = mask
    keys = model.state_dict().keys()
    blocks = find_blocks(model)[1]
    assert len(blocks) == 3 and all(b.startswith(container) for b in blocks)
    assert auto_cut(model) == [f"{container}.varuna_cuts.{i}" for i in range(2)]
    assert model.state_dict().keys() == keys  # pretrained weights load as before
    assert trace_model(model, batch).cut_names == [f"{container}.varuna_cuts.{i}" for i in range(2)]


def test_an_encoder_decoder_model_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_heads=2,
        vocab_size=64,
        decoder_start_token_id=0,
    )
    with pytest.raises(
        PartitionError,
        match=r"cannot cut the encoder-decoder T5ForConditionalGeneration: every "
        r"decoder block also reads the encoder's output",
    ):
        auto_cut(_LossOf(transformers.T5ForConditionalGeneration(config)))


def test_a_block_that_runs_twice_per_forward_is_named() -> None:
    """ALBERT reuses a layer group's weights for several layers: its CutPoint would fire twice."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.groups = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(4):
                x = self.groups[i // 2](x)
            return x.sum()

    model = Shared()
    auto_cut(model)
    with pytest.raises(
        PartitionError,
        match=r"block 'groups\.0' ran twice in one forward pass .*reuses one "
        r"block's weights",
    ):
        trace_model(model, {"x": torch.randn(2, 4)})
