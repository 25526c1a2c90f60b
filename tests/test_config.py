"""The gateway's configuration: defaults work, files and flags override, bad input is named."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.config import (
    DEFAULT_PORT,
    ConfigError,
    GatewayConfig,
    load_gateway_config,
    parse_address,
    parse_size,
)


def test_embedded_defaults_are_valid() -> None:
    config = load_gateway_config()
    assert config == GatewayConfig().validate()
    assert config.listen == ("127.0.0.1", DEFAULT_PORT)
    assert config.data_dir == Path("headgate-data")


@pytest.mark.parametrize(
    ("text", "expected"),
    [(4096, 4096), ("4096", 4096), ("64MiB", 64 * 1024**2), ("1 GB", 10**9), ("8k", 8192)],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text, what="x") == expected


@pytest.mark.parametrize("bad", ["", "MiB", "-1", "1.5MiB", "12 parsecs", True, None, 1.5, -3])
def test_bad_sizes_are_named(bad: object) -> None:
    with pytest.raises(ConfigError, match="stream_capacity"):
        parse_size(bad, what="stream_capacity")


def test_addresses() -> None:
    assert parse_address("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert parse_address("[::1]:7000") == ("::1", 7000)
    assert parse_address("localhost") == ("localhost", DEFAULT_PORT)
    with pytest.raises(ConfigError, match="port"):
        parse_address("host:99999")
    with pytest.raises(ConfigError, match="port"):
        parse_address("host:http")


def test_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text(
        '[gateway]\nlisten = "127.0.0.1:0"\nstream_capacity = "8MiB"\nterm_length = "1MiB"\n'
        'max_message_size = "256KiB"\n[streams.slow]\ncapacity = "2MiB"\n'
    )
    config = load_gateway_config(path, data_dir=tmp_path / "d", term_length=None)
    assert config.listen == ("127.0.0.1", 0)
    assert config.term_length == 1024**2, "a flag that was not given must not mask the file"
    assert config.data_dir == tmp_path / "d"
    assert config.stream_capacity_for("slow") == 2 * 1024**2
    assert config.stream_capacity_for("other") == 8 * 1024**2


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("[gateway\n", "not valid TOML"),
        ("[gatewy]\n", "unknown section"),
        ("[gateway]\nlisen = 1\n", "unknown key"),
        ('[gateway]\nterm_length = "3000"\n', "power of two"),
        ('[gateway]\nmax_message_size = "64MiB"\n', "half of term_length"),
        ("[gateway]\nlisten = 7\n", "host:port"),
        ('[gateway]\ngroup_commit_interval_ms = "fast"\n', "milliseconds"),
        ("[streams]\nx = 3\n", "streams.x"),
        ("gateway = 3\n", "must be a table"),
    ],
)
def test_bad_files_are_clear_errors(tmp_path: Path, body: str, fragment: str) -> None:
    path = tmp_path / "gw.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=fragment):
        load_gateway_config(path)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_gateway_config(tmp_path / "nope.toml")
    path = tmp_path / "bin.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError):
        load_gateway_config(path)


@given(st.binary(max_size=200))
def test_arbitrary_file_contents_give_a_config_or_a_config_error(content: bytes) -> None:
    """Whatever bytes the file holds, the outcome is a valid config or a ConfigError."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "gw.toml"
        path.write_bytes(content)
        try:
            config = load_gateway_config(path)
        except ConfigError as exc:
            assert str(exc), "a refusal must say why"
        else:
            assert config.validate() is config
