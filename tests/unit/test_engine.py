"""The engine in one process (world size 1): configuration errors and the plain 1x1 path."""

from __future__ import annotations

import pytest
import torch

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.engine.config import VarunaConfig
from varuna.errors import ConfigError
from varuna.models import GPT, gpt_tiny


@pytest.fixture()
def gpt() -> tuple[GPT, SyntheticLM]:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    return GPT(cfg), SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)


def test_global_batch_not_divisible_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"global_batch_size=10 is not divisible by data x micro_batch_size = 2 x 4 = 8"
    ):
        VarunaConfig(pipeline=1, data=2, global_batch_size=10, micro_batch_size=4)


def test_world_size_must_equal_pipeline_times_data(gpt) -> None:
    model, data = gpt
    with pytest.raises(
        ConfigError,
        match=r"1 processes but pipeline x data = 2 x 2 = 4; launch with `varuna run --pipeline 2 --data 2",
    ):
        Varuna(model, pipeline=2, data=2, global_batch_size=8, micro_batch_size=2)


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"schedule='zb' is not one of"):
        VarunaConfig(pipeline=1, data=1, global_batch_size=8, micro_batch_size=2, schedule="zb")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"micro_batch_size must be a positive integer, got 0"):
        VarunaConfig(pipeline=1, data=1, global_batch_size=8, micro_batch_size=0)
    for name, bad, message in (
        ("checkpoint_keep", "2", "a positive integer, got '2'"),
        ("profile_repeats", 0, "a positive integer, got 0"),
        ("bucket_mb", -1, "a number > 0, got -1"),
    ):
        with pytest.raises(ConfigError, match=rf"{name} must be {message}"):
            VarunaConfig(pipeline=1, data=1, global_batch_size=8, micro_batch_size=2, **{name: bad})
    with pytest.raises(ConfigError, match=r"precision='fp8' is not one of"):
        VarunaConfig(pipeline=1, data=1, global_batch_size=8, micro_batch_size=2, precision="fp8")  # type: ignore[arg-type]


def test_a_misspelt_option_names_the_valid_ones(gpt) -> None:
    model, _ = gpt
    with pytest.raises(
        ConfigError,
        match=r"unknown option 'checkpoint_kep'; did you mean 'checkpoint_keep' or 'checkpoint_every'\? "
        r"the options are: allow_batch_change, allreduce_dtype, bucket_mb, checkpoint_every, checkpoint_keep",
    ):
        Varuna(model, global_batch_size=8, micro_batch_size=2, checkpoint_kep=2)
    with pytest.raises(ConfigError, match=r"unknown option 'pipline'; did you mean 'pipeline'\?"):
        Varuna(model, global_batch_size=8, pipeline="auto", pipline=2)


def test_wrong_batch_size_for_step(gpt) -> None:
    model, data = gpt
    engine = Varuna(model, global_batch_size=8, micro_batch_size=2)
    with pytest.raises(
        ConfigError, match=r"step\(\) got a batch of 4 samples but this replica's share .* = 8"
    ):
        engine.step(collate([data[i] for i in range(4)]))
    with pytest.raises(ConfigError, match=r"step\(\) takes one batch dict, .* \(got a list\)"):
        engine.step([engine.batch(data, 0)])  # type: ignore[arg-type]
    engine.close()


def test_single_process_matches_plain_training_with_clipping(gpt) -> None:
    model, data = gpt
    torch.manual_seed(0)
    plain = GPT(gpt_tiny())
    plain.load_state_dict(model.state_dict())
    engine = Varuna(model, global_batch_size=8, micro_batch_size=2, clip_grad_norm=0.5)
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for k in range(3):
        batch = engine.batch(data, k)
        loss = engine.step(batch)
        ref = plain(**batch)
        opt.zero_grad()
        ref.backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt.step()
        assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
        assert engine.last_grad_norm == pytest.approx(float(norm), rel=1e-4)
    for name, p in engine.named_parameters():
        torch.testing.assert_close(p, dict(plain.named_parameters())[name], rtol=1e-5, atol=1e-7)
    assert engine.history[-1]["step"] == 3
    engine.close()
