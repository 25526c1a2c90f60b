"""The pipeline file's token and TLS keys: checked without Spark, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from headgate.client.security import ClientSecurity
from headgate.config import ConfigError
from headgate.spark.pipeline import pipeline_config_from_dict

STREAMS: dict[str, Any] = {"streams": {"s": {}}}


def test_the_token_source_and_tls_keys_make_the_security_settings() -> None:
    config = pipeline_config_from_dict(
        {"gateway": "127.0.0.1:7878", "token_env": "HEADGATE_TOKEN", "tls": True, **STREAMS}
    )
    assert config.security == ClientSecurity(token_env="HEADGATE_TOKEN", tls=True)
    assert pipeline_config_from_dict(STREAMS).security == ClientSecurity()


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [
        ({"token_env": "HEADGATE_TOKEN"}, r"token_env need\(s\) a gateway address"),
        ({"gateway": "h:1", "tls": "yes"}, "tls must be true or false"),
        ({"gateway": "h:1", "token_env": "NOT A NAME"}, "must name an environment variable"),
        ({"gateway": "h:1", "token_file": ""}, "token_file must be non-empty text"),
        ({"gateway": "h:1", "token_env": "A", "token_file": "f"}, "token_env or token_file"),
        ({"gateway": "h:1", "tls_key_file": "k.pem"}, r"needs its certificate .tls_cert_file."),
        ({"gateway": "h:1", "tls_ca_file": "/no/such/ca.pem"}, "cannot load CA file"),
        ({"gateway": "h:1", "token": "secret"}, r"unknown key.* token"),
        ({"gateway": "unix:/tmp/gw.sock", "tls": True}, r"Unix socket .* does not speak TLS"),
    ],
)
def test_bad_security_keys_are_named(keys: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        pipeline_config_from_dict({**keys, **STREAMS}, where="p.toml")


def test_headgate_pipeline_says_when_the_token_variable_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from headgate.spark.command import run_pipeline_file

    monkeypatch.delenv("HG_UNSET_TOKEN", raising=False)
    path = tmp_path / "p.toml"
    path.write_text('gateway = "127.0.0.1:1"\ntoken_env = "HG_UNSET_TOKEN"\n[streams.s]\n')
    with pytest.raises(ConfigError, match=r"HG_UNSET_TOKEN .*is not set"):
        run_pipeline_file(path, available_now=True, echo=print)
