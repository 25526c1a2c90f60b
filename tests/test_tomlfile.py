"""The four hand-written TOML files say the same mistake the same way (headgate.tomlfile)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from headgate.cluster import ClusterError, load_cluster
from headgate.config import ConfigError, load_gateway_config
from headgate.gateway.auth import load_tokens
from headgate.spark.pipeline import load_pipeline_config

LOADERS: list[tuple[str, Callable[[Path], object]]] = [
    ("config", load_gateway_config),
    ("tokens", load_tokens),
    ("cluster", load_cluster),
    ("pipeline", load_pipeline_config),
]


def refusal(load: Callable[[Path], object], path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("kind", "load"), LOADERS)
def test_every_file_reads_and_parses_with_the_same_errors(
    tmp_path: Path, kind: str, load: Callable[[Path], object]
) -> None:
    missing = tmp_path / "nope.toml"
    assert refusal(load, missing) == f"{kind} file {missing} does not exist"
    assert refusal(load, tmp_path) == f"{tmp_path} is a directory, not a {kind} file"
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert refusal(load, binary).startswith(f"cannot read {kind} file {binary}: ")
    broken = tmp_path / "broken.toml"
    broken.write_text("[table\n")
    assert refusal(load, broken).startswith(f"{broken}: not valid TOML: ")


@pytest.mark.parametrize(("kind", "load"), LOADERS)
def test_an_unknown_top_level_name_is_refused_with_the_known_ones(
    tmp_path: Path, kind: str, load: Callable[[Path], object]
) -> None:
    path = tmp_path / f"{kind}.toml"
    path.write_text("bogus = 1\n")
    message = refusal(load, path)
    assert message.startswith(f"{path}: unknown ")
    assert "(s) bogus (known: " in message


def test_the_cluster_file_keeps_its_own_error_class(tmp_path: Path) -> None:
    with pytest.raises(ClusterError):
        load_cluster(tmp_path / "nope.toml")


def test_a_long_list_of_known_keys_gives_the_nearest_instead(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("[gateway]\nlisen = 1\n")
    message = refusal(load_gateway_config, path)
    assert message == f"{path}: gateway: unknown key(s) lisen (did you mean listen?)"
    path.write_text("[gateway]\nzzzz = 1\n")
    assert refusal(load_gateway_config, path) == f"{path}: gateway: unknown key(s) zzzz"
