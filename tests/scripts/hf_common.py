"""transformers models for the real-model tests: built from a config, trained unchanged.

GPT-2 (tied embeddings), BERT masked-LM (tied decoder, a padding mask on part of the batch) and
Llama (tied embeddings, grouped-query attention), each small, with dropout 0 unless asked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from varuna.data import collate, global_indices

STEPS = 5
GLOBAL_BATCH = 8
MICRO_BATCH = 2
SEQ = 16
VOCAB = 96
MODELS = ("gpt2", "bert", "llama")
MORE_MODELS = ("deberta", "mixtral")  # trained at 2x1 only


def build(kind: str, *, dropout: float = 0.0, seed: int = 1234) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    small = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=4,
            n_embd=32,
            n_head=2,
            n_positions=SEQ,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **small,
        )
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=4,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            **small,
        )
        model = transformers.BertForMaskedLM(config)
    elif kind == "deberta":  # relative-position embeddings shared by every layer, off the input path
        config = transformers.DebertaV2Config(
            num_hidden_layers=4,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_buckets=8,
            max_relative_positions=SEQ,
            **small,
        )
        model = transformers.DebertaV2ForMaskedLM(config)
    elif kind == "mixtral":  # mixture of experts: routing that the meta device cannot run
        config = transformers.MixtralConfig(
            num_hidden_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            attention_dropout=dropout,
            **small,
        )
        model = transformers.MixtralForCausalLM(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            tie_word_embeddings=True,
            attention_dropout=dropout,
            **small,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(kind)
    model.train()
    return model


class Data:
    """A map-style dataset of token rows; BERT's rows have padding and 3 masked positions each."""

    def __init__(self, kind: str, n: int = 64, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        self.kind = kind
        self.lengths = torch.where(torch.arange(n) % 3 == 0, SEQ - 5, SEQ)  # every third row padded
        self.masked = torch.stack([torch.randperm(SEQ - 5, generator=g)[:3] for _ in range(n)])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        if self.kind not in ("bert", "deberta"):
            return {"input_ids": ids, "labels": ids}
        mask = (torch.arange(SEQ) < self.lengths[i]).long()
        labels = torch.full((SEQ,), -100)
        labels[self.masked[i]] = ids[self.masked[i]]
        inputs = ids.clone()
        inputs[self.masked[i]] = 4  # the [MASK] token
        inputs[mask == 0] = 0
        return {"input_ids": inputs, "attention_mask": mask, "labels": labels}


def optimizer(params: Any) -> torch.optim.Optimizer:
    # eps 1e-5, not 1e-8: a weight whose true gradient is zero (the attention key bias) would take
    # Adam steps the size of the learning rate from rounding noise in the order of summation, and so
    # would a tied weight whose two stages' gradients nearly cancel (each stage sums its own part
    # over the micro-batches, one process sums both per micro-batch): at 1e-6, one of GPT-2's 3072
    # embedding entries ended 1.3e-6 from plain training (a gradient about the size of eps).
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-5)


def reference(
    kind: str, steps: int = STEPS, model: nn.Module | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain training on the same global batches: the mean of the micro-batches' losses (the
    transformers loss is a mean per forward; every micro-batch counts the same number of tokens)."""
    model = build(kind) if model is None else model
    data = Data(kind)
    opt = optimizer(model.parameters())
    losses = []
    for k in range(steps):
        batch = collate([data[i] for i in global_indices(k, GLOBAL_BATCH, len(data))])
        n = GLOBAL_BATCH // MICRO_BATCH
        total = 0.0
        opt.zero_grad()
        for j in range(n):
            micro = {key: v[j * MICRO_BATCH : (j + 1) * MICRO_BATCH] for key, v in batch.items()}
            loss = model(**micro).loss / n
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "varuna", "zb-h1")
# Two chunks per rank (4 virtual stages from the 4 blocks), each model once at 2x1.
CHUNK_RUNS = (("gpt2", "zb-v"), ("bert", "interleaved-1f1b"), ("llama", "zb-v"))
# world size -> the P x D shapes its job trains; model i at shape j uses schedule (i + j) % 5, so
# every schedule trains some model at some shape (each model three of them).
CONFIGS: dict[int, list[tuple[int, int]]] = {2: [(2, 1)], 4: [(2, 2), (4, 1)]}
SHAPES = [shape for world in sorted(CONFIGS) for shape in CONFIGS[world]]


def schedule_for(kind: str, shape: tuple[int, int]) -> str:
    return SCHEDULES[(MODELS.index(kind) + SHAPES.index(shape)) % len(SCHEDULES)]
