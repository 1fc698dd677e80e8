"""services.common.config: flags with GPUPLANE_* environment defaults."""
from __future__ import annotations

import argparse

import pytest

from services.common.config import bounded_number, env_flag, parse_bytes


def _parser(monkeypatch, env_value: str | None) -> argparse.ArgumentParser:
    if env_value is None:
        monkeypatch.delenv("GPUPLANE_TEST_LISTEN", raising=False)
    else:
        monkeypatch.setenv("GPUPLANE_TEST_LISTEN", env_value)
    parser = argparse.ArgumentParser()
    env_flag(parser, "--listen", "GPUPLANE_TEST_LISTEN", "127.0.0.1:1", "where to listen")
    return parser


def test_a_flag_beats_the_environment_which_beats_the_default(monkeypatch):
    assert _parser(monkeypatch, None).parse_args([]).listen == "127.0.0.1:1"
    assert _parser(monkeypatch, "0.0.0.0:2").parse_args([]).listen == "0.0.0.0:2"
    assert _parser(monkeypatch, "0.0.0.0:2").parse_args(["--listen", "h:3"]).listen == "h:3"


@pytest.mark.parametrize(
    "text,expected",
    [("0", 0), ("1048576", 1 << 20), ("256MiB", 256 << 20), ("2GiB", 2 << 30), ("1.5 KiB", 1536)],
)
def test_byte_sizes_parse_with_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["-1", "lots", "12XB"])
def test_malformed_byte_sizes_are_refused_with_a_hint(text):
    with pytest.raises(argparse.ArgumentTypeError, match="byte size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["inf", "nan", "infGiB", "1e300GiB", "2EiB", str(1 << 61)])
def test_a_byte_size_that_is_not_finite_or_past_1_eib_is_a_usage_error_not_a_traceback(text):
    with pytest.raises(argparse.ArgumentTypeError, match="byte size"):
        parse_bytes(text)


def test_a_malformed_environment_default_exits_with_a_usage_error_naming_the_variable(
        monkeypatch, capsys):
    monkeypatch.setenv("GPUPLANE_TEST_SIZE", "infGiB")
    parser = argparse.ArgumentParser()
    with pytest.raises(SystemExit) as info:
        env_flag(parser, "--size", "GPUPLANE_TEST_SIZE", 0, "a size", type=parse_bytes)
    assert info.value.code == 2
    assert "GPUPLANE_TEST_SIZE='infGiB'" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e300", "0", "11"])
def test_a_bounded_number_refuses_what_is_not_finite_and_inside_its_bounds(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"finite number in \(0, 10\]"):
        bounded_number(0, 10, "--x")(text)
    assert bounded_number(0, 10, "--x")("10") == 10.0, "negative control: the bound itself"
