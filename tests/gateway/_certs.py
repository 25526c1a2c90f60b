"""Throwaway certificates made with the ``openssl`` command, at test time.

Nothing here is committed but this code: every key lives in a temporary
directory of the test run.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Authority:
    """A CA and what it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_authority(directory: Path, name: str) -> Authority:
    """A CA called ``name``, a server certificate for 127.0.0.1 and localhost, a client one."""
    directory.mkdir(parents=True, exist_ok=True)
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", f"/CN={name} test CA", cwd=directory,
    )  # fmt: skip
    for who, extension in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (directory / f"{who}.ext").write_text(extension + "\n")
        _openssl(
            "req", *curve, "-keyout", f"{who}.key", "-out", f"{who}.csr",
            "-subj", f"/CN={name} {who}", cwd=directory,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext",
            cwd=directory,
        )  # fmt: skip
    return Authority(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
