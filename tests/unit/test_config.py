"""The job's settings: one flat set of keywords, each owned and validated by its component."""

from __future__ import annotations

import json

import pytest

from varuna.checkpoint.config import CheckpointConfig
from varuna.elastic.config import ElasticConfig
from varuna.engine.config import OPTIONS, EngineConfig, VarunaConfig
from varuna.errors import ConfigError
from varuna.planner.config import PlannerConfig

BASE = dict(pipeline=2, data=1, global_batch_size=8, micro_batch_size=2)


def test_each_keyword_lands_in_the_component_that_owns_it() -> None:
    cfg = VarunaConfig(
        **BASE, schedule="varuna", checkpoint_keep=5, memory_limit="2GiB", on_stop="flag", run_dir="/tmp/r"
    )
    assert isinstance(cfg.engine, EngineConfig) and cfg.engine.schedule == "varuna"
    assert isinstance(cfg.checkpoint, CheckpointConfig) and cfg.checkpoint.checkpoint_keep == 5
    assert isinstance(cfg.planner, PlannerConfig) and cfg.planner.memory_limit == "2GiB"
    assert isinstance(cfg.elastic, ElasticConfig) and cfg.elastic.on_stop == "flag"
    assert str(cfg.run_dir) == "/tmp/r"
    # Read flat, as scripts and notebooks do; derived values come from the engine's config.
    assert (cfg.pipeline, cfg.checkpoint_keep, cfg.on_stop) == (2, 5, "flag")
    assert cfg.num_microbatches == 4 and cfg.uses_recompute is True
    with pytest.raises(AttributeError, match="no option 'pipelines'"):
        _ = cfg.pipelines


def test_the_flat_form_round_trips_through_json() -> None:
    cfg = VarunaConfig(**BASE, shared_weights=[["a", "b"]], partition=[3], resume="latest", run_dir="/tmp/r")
    flat = json.loads(json.dumps(cfg.options()))
    assert set(flat) == set(OPTIONS)
    assert VarunaConfig(**flat) == cfg
    assert VarunaConfig(**{**flat, "checkpoint_keep": 9}) != cfg


def test_each_component_validates_its_own_fields() -> None:
    with pytest.raises(ConfigError, match=r"on_stop='later': use 'exit' or 'flag'"):
        ElasticConfig(on_stop="later")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"checkpoint_keep must be a positive integer, got 0"):
        CheckpointConfig(checkpoint_keep=0)
    with pytest.raises(ConfigError, match=r"allow_batch_change must be True or False, got 'yes'"):
        VarunaConfig(**BASE, allow_batch_change="yes")
    with pytest.raises(ConfigError, match=r"memory_limit"):
        PlannerConfig(memory_limit="lots")
    with pytest.raises(ConfigError, match=r"needs global_batch_size, micro_batch_size"):
        VarunaConfig(pipeline=1, data=1)
    with pytest.raises(ConfigError, match=r"partition='quickest': use 'balanced', 'fastest', 'uniform'"):
        VarunaConfig(**BASE, partition="quickest")
    assert VarunaConfig(**BASE, partition="fastest").engine.partition == "fastest"
