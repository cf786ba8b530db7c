"""The one option check (`varuna.errors.check_int` / `check_number`) and the link and observer
contracts every implementation keeps."""

from __future__ import annotations

import inspect

import pytest
import torch

from varuna.comm.links import Link
from varuna.comm.local import LocalLink
from varuna.comm.p2p import P2P
from varuna.comm.serial import SerialLink
from varuna.engine.observer import Observer, Unobserved
from varuna.errors import ConfigError, PlanError, check_duration, check_int, check_number, is_int
from varuna.telemetry.recorder import Telemetry


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_check_int_returns_a_good_value(value: int) -> None:
    assert check_int(value, "n") == value


@pytest.mark.parametrize(
    ("value", "kwargs", "expected"),
    [
        (0, {}, "n must be a positive integer, got 0"),
        (True, {}, "n must be a positive integer, got True"),
        ("4", {}, "n must be a positive integer, got '4'"),
        (4.0, {}, "n must be a positive integer, got 4.0"),
        (-1, {"minimum": 0}, "n must be an integer >= 0, got -1"),
        (6, {"minimum": 1, "maximum": 5}, "n must be an integer from 1 to 5, got 6"),
    ],
)
def test_check_int_names_the_option_the_range_and_the_value(
    value: object, kwargs: dict, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_int(value, "n", **kwargs)
    assert str(info.value) == expected


def test_check_int_raises_the_given_error_with_the_given_message() -> None:
    with pytest.raises(PlanError, match="^give at least 2 ranks$"):
        check_int(1, "--gpus", minimum=2, error=PlanError, message="give at least 2 ranks")


def test_check_number() -> None:
    assert check_number(3, "x") == 3.0 and isinstance(check_number(3, "x"), float)
    assert check_number(1.5, "ratio", above=1.0) == 1.5
    for bad in (0, -2.0, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ConfigError, match=r"^x must be a number > 0, got "):
            check_number(bad, "x")
    with pytest.raises(ConfigError, match=r"ratio must be a number > 1, got 1.0"):
        check_number(1.0, "ratio", above=1.0)
    assert check_number(0, "settle_s", inclusive=True) == 0.0  # an inclusive bound takes the bound
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"^settle_s must be a number >= 0, got "):
            check_number(bad, "settle_s", inclusive=True)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("90", 90.0), (90, 90.0), ("90s", 90.0), ("2 min", 120.0), ("1m", 60.0), ("0", 0.0)],
)
def test_check_duration_reads_seconds_with_or_without_a_unit(value: object, seconds: float) -> None:
    assert check_duration(value, message="m") == seconds


def test_check_duration_bounds_and_required_units_raise_the_given_message() -> None:
    assert check_duration("1.5h", message="m", unit_required=True, positive=True) == 5400.0
    for bad, kw in [
        ("90", {"unit_required": True}),  # a bare number is something else there (steps)
        (90, {"unit_required": True}),
        ("0s", {"positive": True}),
        ("-5s", {}),
        ("2 days", {}),
        (True, {}),
        (None, {}),
    ]:
        with pytest.raises(ConfigError, match=r"^give a duration$"):
            check_duration(bad, message="give a duration", **kw)


def test_is_int() -> None:
    assert is_int(3) and is_int(0) and not is_int(True) and not is_int(3.0) and not is_int("3")


def test_engine_options_use_the_check() -> None:
    from varuna.engine.config import VarunaConfig

    with pytest.raises(ConfigError, match="^refit_after must be a positive number of steps"):
        VarunaConfig(pipeline=1, data=1, global_batch_size=4, micro_batch_size=1, refit_after=0)
    with pytest.raises(ConfigError, match="^bucket_mb must be a number > 0, got True$"):
        VarunaConfig(pipeline=1, data=1, global_batch_size=4, micro_batch_size=1, bucket_mb=True)


def _members(protocol: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(protocol).items()
        if callable(member) and not name.startswith("_")
    }


@pytest.mark.parametrize("link", [P2P, SerialLink, LocalLink])
def test_every_link_has_the_contracts_methods_with_its_signatures(link: type) -> None:
    """mypy checks the same statically (`varuna.comm.links`); this catches a link that is only
    ever built where mypy does not look."""
    for name, signature in _members(Link).items():
        assert hasattr(link, name), f"{link.__name__} lacks {name}"
        assert inspect.signature(getattr(link, name)).parameters.keys() == signature.parameters.keys(), name


def test_every_link_counts_idle_comm_and_bytes() -> None:
    for link in (LocalLink(1), P2P(None, None, torch.device("cpu"))):
        assert (link.idle_s, link.comm_s, link.bytes_sent) == (0.0, 0.0, 0)
        link.close()


def test_p2p_refuses_a_probe_it_never_lists() -> None:
    p2p = P2P(None, None, torch.device("cpu"))
    assert p2p.shape_probe() == []
    with pytest.raises(RuntimeError, match="needs no probe"):
        p2p.probe_recv(0)


@pytest.mark.parametrize("observer", [Unobserved, Telemetry])
def test_observers_keep_the_contract(observer: type) -> None:
    for name, signature in _members(Observer).items():
        assert inspect.signature(getattr(observer, name)).parameters.keys() == signature.parameters.keys(), (
            name
        )


def test_the_unobserved_rank_wants_nothing() -> None:
    quiet = Unobserved()
    with quiet.step():
        quiet.on_send("SEND_F", 0, 10)
    assert quiet.poll() is False
