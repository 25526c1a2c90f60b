"""TLS for the gateway's listener, from the standard :mod:`ssl` module.

The gateway upgrades each accepted TCP connection itself (``loop.start_tls``)
rather than handing the context to ``create_server``, so that a failed
handshake (a client without the required certificate, a plain-TCP client, a
slowloris TLS opening) is logged once with the peer's address and reason;
asyncio would otherwise swallow it.
"""

from __future__ import annotations

import ssl

from headgate.config import ConfigError, GatewayConfig

__all__ = ["server_context"]


def server_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """The listener's TLS context, or None when ``tls_cert`` is not set.

    TLS 1.2 is the floor. With ``tls_client_ca`` set, clients must present a
    certificate that chains to it (mutual TLS).
    """
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the TLS certificate {config.tls_cert} and key {config.tls_key}: {exc}"
        ) from None
    if config.tls_client_ca is not None:
        try:
            context.load_verify_locations(cafile=str(config.tls_client_ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load tls_client_ca {config.tls_client_ca}: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
