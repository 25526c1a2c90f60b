"""``headgate serve`` with TLS and tokens, and ``headgate send`` with both, as processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from headgate.gateway.auth import hash_token
from tests.gateway._certs import Authority, make_authority

HEADGATE = [sys.executable, "-m", "headgate.cli"]
TOKEN = "cli-" + "t" * 40

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[str, Path, Authority]]:
    pki = make_authority(tmp_path / "pki", "cli")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[token]]\nname = "cli"\nsha256 = "{hash_token(TOKEN.encode())}"\nwrite = ["ok"]\n'
    )
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [
            *HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data),
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--auth-file", str(tokens), "--idle-timeout-ms", "5000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line + (proc.stderr.read() if proc.stderr else "")
        yield line.split()[-1], data, pki
    finally:
        proc.terminate()
        proc.wait(20)


def send(address: str, stream: str, source: Path, *extra: str, token: str | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin"}
    if token is not None:
        env["HEADGATE_TOKEN"] = token
    result = subprocess.run(
        [*HEADGATE, "send", stream, str(source), "--gateway", address, "--timeout", "3", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    return f"{result.returncode}\n{result.stdout}\n{result.stderr}"


def test_send_with_a_token_over_verified_tls(
    secured: tuple[str, Path, Authority], tmp_path: Path
) -> None:
    address, data, pki = secured
    source = tmp_path / "in.txt"
    source.write_text("".join(f"line {i}\n" for i in range(100)))
    ok = send(address, "ok", source, "--ca-file", str(pki.ca), token=TOKEN)
    assert ok.startswith("0\n") and "100 records" in ok, ok
    # The token in the environment, not on the command line; wrong or missing: refused.
    wrong = send(address, "ok", source, "--ca-file", str(pki.ca), token="not-it")
    assert wrong.startswith("1\n") and "UNAUTHENTICATED" in wrong, wrong
    forbidden = send(address, "secret", source, "--ca-file", str(pki.ca), token=TOKEN)
    assert forbidden.startswith("1\n") and "FORBIDDEN" in forbidden, forbidden
    # Without the CA the gateway's certificate cannot be verified.
    unverified = send(address, "ok", source, "--tls", token=TOKEN)
    assert unverified.startswith("1\n") and "TLS verification" in unverified, unverified
    assert not (data / "streams" / "secret").exists()
    assert "Traceback" not in wrong + forbidden + unverified


def test_serve_refuses_a_broken_tokens_file_and_tls_half_set(tmp_path: Path) -> None:
    bad = tmp_path / "tokens.toml"
    bad.write_text('[[token]]\nsha256 = "my-secret-token"\n')
    result = subprocess.run(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
         "--auth-file", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "64 hex digits" in result.stderr
    assert "Traceback" not in result.stderr
    result = subprocess.run(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--tls-cert", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "tls_key" in result.stderr
