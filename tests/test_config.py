"""The gateway's configuration: defaults work, files and flags override, bad input is named."""

from __future__ import annotations

import re
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.config import (
    DEFAULT_PORT,
    ConfigError,
    GatewayConfig,
    format_size,
    load_gateway_config,
    parse_address,
    parse_size,
)
from headgate.gateway.auth import load_tokens


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


# -- the examples people copy -----------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
#: A ```toml block of README.md; its tag says what reads it.
_TOML_BLOCK = re.compile(r"^```toml(?P<tag>[^\n]*)\n(?P<text>.*?)^```$", re.MULTILINE | re.DOTALL)
#: The README elides the digest of its tokens-file example.
_ELIDED_DIGEST = '"5d1c...64 hex"'


def readme_toml_blocks() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return [(m["tag"].strip(), m["text"]) for m in _TOML_BLOCK.finditer(text)]


def load_example(tag: str, text: str, path: Path) -> object:
    """Read ``text`` as the file that ``tag`` names, with the loader headgate uses for it."""
    from headgate.gateway.auth import hash_token
    from headgate.spark.pipeline import load_pipeline_config

    if tag == "tokens":
        # The one thing the example leaves out; everything else as written.
        assert text.count(_ELIDED_DIGEST) == 1
        text = text.replace(_ELIDED_DIGEST, f'"{hash_token(b"a token")}"')
    path.write_text(text, encoding="utf-8")
    if tag == "gateway":
        return load_gateway_config(path)
    if tag == "pipeline":
        return load_pipeline_config(path)
    if tag == "tokens":
        return load_tokens(path)
    if tag == "cluster":
        from headgate.cluster import load_cluster

        return load_cluster(path)
    raise AssertionError(f"a ```toml block of README.md says it is {tag!r}")


def test_every_toml_block_of_the_readme_says_what_reads_it() -> None:
    blocks = readme_toml_blocks()
    assert len(blocks) >= 3
    assert {tag for tag, _ in blocks} <= {"gateway", "pipeline", "tokens", "cluster"}, [
        t for t, _ in blocks
    ]


@pytest.mark.parametrize(("tag", "text"), readme_toml_blocks())
def test_each_toml_block_of_the_readme_is_accepted_as_written(
    tag: str, text: str, tmp_path: Path
) -> None:
    # Issue 14: the README's flow-control example was refused by the gateway.
    load_example(tag, text, tmp_path / f"{tag}.toml")


def test_the_example_in_the_config_modules_docstring_is_accepted(tmp_path: Path) -> None:
    import headgate.config

    doc = headgate.config.__doc__ or ""
    example = doc.split("Example ``headgate.toml``::\n", 1)[1].split("\n\n``headgate serve``")[0]
    assert "[gateway]" in example and "[streams.ticks]" in example
    config = load_example("gateway", textwrap.dedent(example), tmp_path / "headgate.toml")
    assert isinstance(config, GatewayConfig)
    assert config.streams["ticks"].capacity == 32 * 1024**2


def test_a_capacity_below_two_terms_names_the_file_and_both_fixes(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text('[streams.ticks]\ncapacity = "8MiB"\n')
    with pytest.raises(ConfigError) as refused:
        load_gateway_config(path)
    assert str(refused.value) == (
        f"{path}: streams.ticks.capacity (8MiB) must be at least two terms of term_length "
        "16MiB: raise it to at least 32MiB, or lower term_length to 4MiB or less"
    )
    # Both fixes work.
    path.write_text('[streams.ticks]\ncapacity = "32MiB"\n')
    assert load_gateway_config(path).streams["ticks"].capacity == 32 * 1024**2
    path.write_text('[gateway]\nterm_length = "4MiB"\n[streams.ticks]\ncapacity = "8MiB"\n')
    assert load_gateway_config(path).term_length == 4 * 1024**2


def test_sizes_in_errors_read_back_as_the_same_size() -> None:
    for size in (4096, 8191, 3 * 1024**2, 16 * 1024**2, 5 * 1024**3, 1000):
        assert parse_size(format_size(size), what="x") == size
    assert format_size(16 * 1024**2) == "16MiB"


def test_other_limits_name_their_fixes(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\nmax_message_size = "12MiB"\n')
    with pytest.raises(ConfigError) as too_large:
        load_gateway_config(path)
    assert str(too_large.value) == (
        f"{path}: max_message_size (12MiB) must be at most half of term_length (16MiB): "
        "lower it to 8MiB, or raise term_length to 32MiB or more"
    )
    with pytest.raises(ConfigError) as refused:
        load_gateway_config(None, stream_capacity=3 * 1024**2)
    assert str(refused.value) == (
        "stream_capacity (3MiB) must be at least two terms of term_length 16MiB: "
        "raise it to at least 32MiB, or lower term_length to 1MiB or less"
    )


def test_the_readme_names_every_config_key() -> None:
    import dataclasses

    from headgate.config import StreamSettings

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    keys = [f.name for f in dataclasses.fields(GatewayConfig) if f.name != "streams"]
    keys += [f.name for f in dataclasses.fields(StreamSettings)]
    assert [key for key in keys if f"`{key}`" not in readme] == []


def test_max_stream_credit_is_a_size_and_at_least_two_messages(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\nmax_stream_credit = "8MiB"\n')
    assert load_gateway_config(path).max_stream_credit == 8 * 1024**2
    path.write_text("[gateway]\nmax_stream_credit = 0\n")
    assert load_gateway_config(path).max_stream_credit == 0, "0: no cap"
    path.write_text('[gateway]\nmax_stream_credit = "1MiB"\nmax_message_size = "1MiB"\n')
    with pytest.raises(ConfigError, match="max_stream_credit"):
        load_gateway_config(path)
