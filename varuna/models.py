"""Small reference models, annotated with CutPoints, for tests, the demo, benchmarks and notebooks.

They follow the contract the engine relies on:

- `model(**batch)` returns a scalar loss: the mean over the tokens that count;
- every CutPoint is called exactly once per forward, in order;
- values computed from the batch alone (position ids, BERT's extended attention mask) are computed at
  the top of `forward` and never pass through a CutPoint, so every stage can recompute them;
- on a rank that does not compute a part of the model its activations are stand-ins (shape, dtype and
  device, no data; `varuna.cut.standin`), so the glue between modules may read shapes but not values.

    cfg = gpt_tiny()
    model = GPT(cfg)
    batch = {"input_ids": ids, "labels": next_ids}          # LongTensor[B, T] each
    loss = model(**batch)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from varuna.cut.cutpoint import CutPoint
from varuna.errors import ConfigError, check_int

__all__ = [
    "GPTConfig",
    "GPT",
    "gpt_tiny",
    "gpt_demo",
    "gpt_bench",
    "BertConfig",
    "BertMLM",
    "bert_tiny",
    "count_parameters",
]


def _check_shape_fields(
    name: str, *, vocab_size: int, seq_len: int, d_model: int, n_layer: int, n_head: int, dropout: float
) -> None:
    """Validate the fields GPTConfig and BertConfig share; raise ConfigError naming the field."""
    for field, value in (
        ("vocab_size", vocab_size),
        ("seq_len", seq_len),
        ("d_model", d_model),
        ("n_layer", n_layer),
        ("n_head", n_head),
    ):
        check_int(value, field, message=f"{name}.{field} must be a positive integer (got {value!r})")
    if d_model % n_head != 0:
        raise ConfigError(
            f"{name}.d_model must be divisible by n_head (d_model: {d_model}, n_head: {n_head}); "
            f"change n_head to a divisor of d_model, e.g. {_nearest_divisor(d_model, n_head)}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{name}.dropout must be in [0, 1) (got {dropout!r})")


def _nearest_divisor(n: int, k: int) -> int:
    """The divisor of `n` closest to `k` (ties go to the smaller one)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))


def _init_gpt_style(module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights for Linear and Embedding, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class _SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection, via `F.scaled_dot_product_attention`.

    Shapes are taken from the module's own settings, never from the input in Python, so the
    module runs on the stand-ins of stages that skip it.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float, *, causal: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.causal = causal
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """Attend over the sequence of `x` [B, T, C]; `attn_mask` is additive, [B, 1, 1, T]."""
        # [B, T, 3C] -> [B, 3, H, T, hd]
        qkv = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2)
        if attn_mask is not None:
            attn_mask = attn_mask.to(q.dtype)  # autocast may run attention in bf16/fp16
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal,
        )
        return self.proj(y.transpose(1, 2).flatten(-2))


class _MLP(nn.Module):
    """Position-wise feed-forward: Linear(d, 4d), GELU, Linear(4d, d)."""

    def __init__(self, d_model: int, *, approximate: str) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU(approximate=approximate)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to each position of `x`."""
        return self.proj(self.act(self.fc(x)))


# --------------------------------------------------------------------------------------------- GPT


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of a GPT-2 style decoder; see `gpt_tiny`, `gpt_demo` and `gpt_bench` for presets."""

    vocab_size: int = 256
    """Number of token ids; inputs and labels lie in [0, vocab_size)."""
    seq_len: int = 64
    """Longest sequence the learned position embedding covers."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layer: int = 4
    """Number of transformer blocks; the model has n_layer - 1 CutPoints, one after each but the last."""
    cut_inside_blocks: bool = False
    """Also a CutPoint inside every block, between its attention and its MLP (2 n_layer - 1 in all):
    finer candidate boundaries, so the partitioner can balance stages whose ends (embedding, LM head)
    weigh a fraction of a block. The parameters and their names are the same either way."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (0 keeps runs bit-reproducible)."""
    tie_embeddings: bool = True
    """Compute logits with the token embedding matrix instead of a separate `lm_head`."""

    def __post_init__(self) -> None:
        _check_shape_fields(
            "GPTConfig",
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_head=self.n_head,
            dropout=self.dropout,
        )


def gpt_tiny() -> GPTConfig:
    """A GPT for unit tests: vocab 64, seq 16, d_model 32, 4 layers, 2 heads (~53K parameters)."""
    return GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=4, n_head=2)


def gpt_demo() -> GPTConfig:
    """The demo's GPT: vocab 8192, seq 64, d_model 256, 10 layers, 8 heads (~10.0M parameters)."""
    return GPTConfig(vocab_size=8192, seq_len=64, d_model=256, n_layer=10, n_head=8)


def gpt_bench() -> GPTConfig:
    """The benchmark GPT: vocab 4096, seq 128, d_model 256, 8 layers, 8 heads (~7.4M parameters),
    with a CutPoint inside every block too (the LM head weighs about a block: with whole blocks only,
    two stages cannot be balanced better than 4 blocks against 3 blocks + head)."""
    return GPTConfig(vocab_size=4096, seq_len=128, d_model=256, n_layer=8, n_head=8, cut_inside_blocks=True)


class _GPTBlock(nn.Module):
    """Pre-LN decoder block: x + attn(ln(x)), then x + mlp(ln(x)); with `cfg.cut_inside_blocks`, a
    CutPoint (`mid`) between the two, so a stage boundary may fall inside the block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = _SelfAttention(cfg.d_model, cfg.n_head, cfg.dropout, causal=True)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = _MLP(cfg.d_model, approximate="tanh")
        self.drop = nn.Dropout(cfg.dropout)
        self.mid = CutPoint() if cfg.cut_inside_blocks else None

    def attend(self, x: Tensor) -> Tensor:
        """The block's first half: x + attn(ln_1(x))."""
        return x + self.drop(self.attn(self.ln_1(x)))

    def feed(self, x: Tensor) -> Tensor:
        """The block's second half: x + mlp(ln_2(x))."""
        return x + self.drop(self.mlp(self.ln_2(x)))

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to `x` [B, T, C]."""
        x = self.attend(x)
        if self.mid is not None:
            x = self.mid(x)
        return self.feed(x)


class GPT(nn.Module):
    """A GPT-2 style language model with a CutPoint after every block but the last (and inside every
    block with `GPTConfig.cut_inside_blocks`).

    model = GPT(gpt_tiny())
    loss = model(input_ids=ids, labels=next_ids)   # mean cross-entropy over all positions
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = config if config is not None else GPTConfig()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_GPTBlock(cfg) for _ in range(cfg.n_layer))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(cfg.n_layer - 1))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self.apply(_init_gpt_style)

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise one module's own weights (`varuna.init_weights` and a model built on the meta
        device call it module by module, as transformers models' `_init_weights`)."""
        _init_gpt_style(module)

    @classmethod
    def from_config(cls, config: GPTConfig) -> GPT:
        """Build the model a config describes (same as `GPT(config)`)."""
        return cls(config)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token cross-entropy of `input_ids` [B, T] against `labels` [B, T]."""
        seq = input_ids.shape[1]
        if seq > self.config.seq_len:
            raise ConfigError(
                f"input_ids has {seq} positions but GPTConfig.seq_len is {self.config.seq_len}; "
                "raise seq_len or shorten the samples"
            )
        pos = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight) if self.lm_head is None else self.lm_head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# -------------------------------------------------------------------------------------------- BERT


@dataclass(kw_only=True, slots=True)
class BertConfig:
    """Shape of a BERT encoder with a masked-language-model head; see `bert_tiny`."""

    vocab_size: int = 256
    """Number of token ids, including the pad and mask ids."""
    seq_len: int = 64
    """Longest sequence the learned position embedding covers."""
    d_model: int = 64
    """Hidden size."""
    n_layer: int = 4
    """Number of encoder blocks; the model has n_layer - 1 CutPoints, one between each pair."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    type_vocab_size: int = 2
    """Number of segment ids (token_type_ids lie in [0, type_vocab_size))."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches."""
    layer_norm_eps: float = 1e-12
    """Epsilon of every LayerNorm (BERT's value)."""

    def __post_init__(self) -> None:
        _check_shape_fields(
            "BertConfig",
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_head=self.n_head,
            dropout=self.dropout,
        )
        if self.type_vocab_size < 1:
            raise ConfigError(f"BertConfig.type_vocab_size must be >= 1 (got {self.type_vocab_size})")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"BertConfig.layer_norm_eps must be > 0 (got {self.layer_norm_eps})")


def bert_tiny() -> BertConfig:
    """A BERT for unit tests: vocab 64, seq 16, d_model 32, 4 layers, 2 heads, 2 segment types."""
    return BertConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=4, n_head=2, type_vocab_size=2)


class _BertBlock(nn.Module):
    """Post-LN encoder block: ln(x + attn(x)), then ln(x + mlp(x)); attention is bidirectional."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = _SelfAttention(cfg.d_model, cfg.n_head, cfg.dropout, causal=False)
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = _MLP(cfg.d_model, approximate="none")
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:
        """Apply the block to `x` [B, T, C] under the additive mask [B, 1, 1, T]."""
        x = self.ln_1(x + self.drop(self.attn(x, attn_mask)))
        return self.ln_2(x + self.drop(self.mlp(x)))


class BertMLM(nn.Module):
    """BERT with a masked-LM head tied to the word embeddings, and a CutPoint between blocks.

        model = BertMLM(bert_tiny())
        loss = model(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)

    `labels` is -100 except at masked positions; the loss is the mean over those positions.
    """

    def __init__(self, config: BertConfig | None = None) -> None:
        super().__init__()
        cfg = config if config is not None else BertConfig()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embeddings = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.embed_ln = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_BertBlock(cfg) for _ in range(cfg.n_layer))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(cfg.n_layer - 1))
        self.head_dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.head_act = nn.GELU()
        self.head_ln = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.decoder_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.apply(_init_gpt_style)

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise one module's own weights (see `GPT._init_weights`)."""
        _init_gpt_style(module)
        if module is self:
            nn.init.zeros_(self.decoder_bias)

    @classmethod
    def from_config(cls, config: BertConfig) -> BertMLM:
        """Build the model a config describes (same as `BertMLM(config)`)."""
        return cls(config)

    @staticmethod
    def extended_attention_mask(attention_mask: Tensor) -> Tensor:
        """Turn a [B, T] mask of 1 (attend) / 0 (padding) into an additive [B, 1, 1, T] float mask."""
        keep = attention_mask[:, None, None, :].to(torch.float32)
        return (1.0 - keep) * torch.finfo(torch.float32).min

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor, labels: Tensor
    ) -> Tensor:
        """Mean cross-entropy at the positions where `labels` is not -100."""
        seq = input_ids.shape[1]
        if seq > self.config.seq_len:
            raise ConfigError(
                f"input_ids has {seq} positions but BertConfig.seq_len is {self.config.seq_len}; "
                "raise seq_len or shorten the samples"
            )
        # Computed from the batch on every stage; never crosses a CutPoint.
        ext_mask = self.extended_attention_mask(attention_mask)
        pos = torch.arange(seq, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        x = self.drop(self.embed_ln(x + self.token_type_embeddings(token_type_ids)))
        for i, block in enumerate(self.blocks):
            x = block(x, ext_mask)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        h = self.head_ln(self.head_act(self.head_dense(x)))
        logits = F.linear(h, self.word_embeddings.weight, self.decoder_bias)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of `model`, counting a shared (tied) Parameter once."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())
