"""Tests of varuna/profile.py, varuna/_netprofile.py and varuna/_profile_main.py (`varuna profile`).

In one process: a tiny GPT's segment costs (counts, bytes, times), a deliberately slow segment,
the JSON round trip, capturing a script's model; then one 2-rank `varuna profile` job.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import SCRIPTS
from torch import nn

import varuna
from varuna import cli
from varuna.comm.rendezvous import init_distributed
from varuna.cut.autocut import auto_cut
from varuna.cut.cutpoint import CutPoint
from varuna.errors import ConfigError
from varuna.models import GPT, count_parameters, gpt_tiny
from varuna.planner.costs import CostTable, NetworkCost
from varuna.profile.job import _capture, launch_profile, parse_sizes
from varuna.profile.measure import (
    cached_profile,
    model_signature,
    profile_model,
    profile_network,
    profile_table,
)

NETWORK = NetworkCost(p2p_latency_s=1e-4, p2p_bandwidth_Bps=1e9, allreduce={2: [(1024, 1e-4), (2**20, 1e-3)]})
SCRIPT = str(SCRIPTS / "profile_gpt.py")


def _batch(rows: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


@pytest.fixture(scope="module")
def gpt_table() -> tuple[GPT, CostTable]:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    # Two rows: micro-batch size 4 repeats them, which must not matter to the costs.
    table = profile_table(model, _batch(2), network=NETWORK, micro_batch_sizes=(1, 2, 4), progress=False)
    return model, table


def test_gpt_segments_times_and_bytes(gpt_table: tuple[GPT, CostTable]) -> None:
    model, table = gpt_table
    cfg = model.config
    assert table.num_segments == cfg.n_layer  # n_layer - 1 cuts
    assert table.micro_batch_sizes == [1, 2, 4]
    for j, seg in enumerate(table.segments):
        for m in (1, 2, 4):
            assert seg.forward_s[m] > 0 and seg.backward_s[m] > 0 and seg.recompute_at(m) > 0, (j, m)
            expected = m * cfg.seq_len * cfg.d_model * 4 if j < cfg.n_layer - 1 else 0
            assert seg.activation_bytes[m] == expected, (j, m)
            assert seg.activation_memory_bytes[m] > 0
        assert seg.activation_memory_bytes[4] > 3 * seg.activation_memory_bytes[1]
        assert seg.grad_bytes == seg.param_bytes and seg.optimizer_bytes == 2 * seg.param_bytes
        assert seg.update_s > 0, j  # every segment holds parameters: a norm and an AdamW step
    assert sum(s.param_bytes for s in table.segments) == 4 * count_parameters(model)  # tied wte once
    assert table.tied_bytes == 4 * model.wte.weight.numel()
    assert table.segments[0].param_bytes > table.segments[1].param_bytes  # wte lives in segment 0
    assert table.model_signature == model_signature(model) and table.device == "cpu"


def test_cost_table_json_round_trip(gpt_table: tuple[GPT, CostTable], tmp_path: Path) -> None:
    model, table = gpt_table
    path = table.save(tmp_path / "profile.json")
    assert CostTable.load(path) == table
    assert json.loads(path.read_text())["segments"][0]["activation_bytes"]["4"] == 4 * 16 * 32 * 4
    assert cached_profile(tmp_path, model) == table
    assert cached_profile(tmp_path, GPT(dataclasses.replace(gpt_tiny(), n_layer=2))) is None
    assert cached_profile(tmp_path / "nowhere", model) is None


class _Sleep(torch.autograd.Function):
    """Identity that sleeps in forward and in backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return grad


class _Chain(nn.Module):
    """Three linear blocks with a CutPoint between each; the middle one is slow."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            x = _Sleep.apply(x) if i == 1 else x
            x = self.cuts[i](x) if i < 2 else x
        return F.mse_loss(x, y)


def test_slow_segment_is_measured_slower() -> None:
    model = _Chain()
    sentinel = torch.ones(8, 8)
    model.blocks[0].weight.grad = sentinel
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}
    rng = torch.get_rng_state()
    segs = profile_model(
        model,
        batch,
        micro_batch_sizes=(1, 2),
        repeats=5,  # the median of 5 passes: one descheduled pass (seen: 6 ms on a 0.1 ms segment) is skipped
        progress=False,
    )
    for m in (1, 2):
        for kind in ("forward_s", "backward_s", "recompute_s", "nograd_forward_s"):
            times = [getattr(s, kind)[m] for s in segs]
            assert times[1] >= 0.009 and times[1] > 5 * max(times[0], times[2]), (kind, m, times)
    assert model.blocks[0].weight.grad is sentinel and model.blocks[1].weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_leaves_the_weights_as_they_were(gpt_table: tuple[GPT, CostTable]) -> None:
    torch.manual_seed(0)
    fresh = GPT(gpt_tiny())  # the fixture's model was profiled (an AdamW step per segment, undone)
    model, _ = gpt_table
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def test_auto_cut_model_has_the_manual_model_signature() -> None:
    manual = GPT(gpt_tiny())
    auto = GPT(gpt_tiny())
    auto.cuts = nn.ModuleList()
    auto_cut(auto)
    assert model_signature(auto) == model_signature(manual)
    assert model_signature(GPT(dataclasses.replace(gpt_tiny(), n_layer=3))) != model_signature(manual)


def test_bad_settings_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = _Chain(), {"x": torch.randn(2, 8), "y": torch.randn(2, 8)}
    with pytest.raises(ConfigError, match=r"micro_batch_sizes = \[2, 0\]; give distinct positive integers"):
        profile_model(model, batch, micro_batch_sizes=(2, 0))
    with pytest.raises(ConfigError, match=r"repeats = 0; profile at least once"):
        profile_model(model, batch, repeats=0)
    with pytest.raises(ConfigError, match=r"precision='fp8' is not one of"):
        profile_model(model, batch, precision="fp8")
    with pytest.raises(ConfigError, match=r"sharing the batch dimension"):
        profile_model(model, {"x": torch.randn(2, 8), "y": torch.randn(3, 8)})
    with pytest.raises(ConfigError, match=r"--micro-batch-sizes '1,x': give comma-separated positive"):
        parse_sizes("1,x")
    with pytest.raises(ConfigError, match=r"--gpus 1: profiling the network needs at least 2 ranks"):
        launch_profile([SCRIPT], gpus=1)
    with pytest.raises(ConfigError, match=r"script not found: nope.py"):
        launch_profile(["nope.py"])
    init_distributed()  # a one-rank group (idempotent)
    with pytest.raises(ConfigError, match=r"needs >= 2 ranks, the job has 1"):
        profile_network()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"profile_network\(\) is collective"):
        profile_network()


def test_cli_reports_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["profile", "--gpus", "1", SCRIPT]) == 2
    assert "--gpus 1: profiling the network needs at least 2 ranks" in capsys.readouterr().err


def test_capture_stops_the_script_at_varuna(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = varuna.Varuna
    model, options = _capture([SCRIPT, "--layers", "2"])
    assert isinstance(model, GPT) and model.config.n_layer == 2
    assert options["micro_batch_size"] == 2 and options["example_batch"]["input_ids"].shape == (4, 16)
    assert varuna.Varuna is before  # put back
    plain = tmp_path / "plain.py"
    plain.write_text("print('no engine here')\n")
    with pytest.raises(ConfigError, match=r"plain.py finished without constructing varuna.Varuna"):
        _capture([str(plain)])


def test_slowdown_is_never_below_time_sharing_on_one_host() -> None:
    from varuna.profile.slowdown import at_least_time_sharing

    measured = {1: 1.0, 2: 1.05, 3: 1.42, 4: 1.9}
    one_host = [("a", 2)] * 4
    floored = at_least_time_sharing(measured, one_host)
    # 3 and 4 ranks on 2 cores: at least 3/2 and 4/2 times the 2-rank factor
    assert floored == {1: 1.0, 2: 1.05, 3: pytest.approx(1.575), 4: pytest.approx(2.1)}
    assert at_least_time_sharing({1: 1.0, 2: 1.05, 3: 1.8}, [("a", 2)] * 3)[3] == 1.8  # above: kept
    # ranks on other hosts, or enough cores: measured as is
    assert at_least_time_sharing(measured, [("a", 2), ("a", 2), ("b", 2), ("b", 2)]) == measured
    assert at_least_time_sharing(measured, [("a", 8)] * 4) == measured
