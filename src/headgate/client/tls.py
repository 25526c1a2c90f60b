"""TLS for producers: verify the gateway by default, optionally present a certificate."""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["client_context"]


def client_context(
    *,
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> ssl.SSLContext:
    """A client context that verifies the gateway's certificate and host name.

    Args:
        ca_file: PEM bundle the gateway's certificate must chain to; the
            system's trust store when None.
        cert_file: our certificate chain, for gateways that require client
            certificates (mutual TLS).
        key_file: the key of ``cert_file`` (None if it is inside ``cert_file``).

    Raises:
        ValueError: a file cannot be loaded; the message says which.
    """
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=None if ca_file is None else str(ca_file)
        )
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load CA file {ca_file}: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        try:
            context.load_cert_chain(str(cert_file), None if key_file is None else str(key_file))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load client certificate {cert_file}: {exc}") from None
    elif key_file is not None:
        raise ValueError("a client key needs its certificate (cert_file)")
    return context
