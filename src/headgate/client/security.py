"""How a client proves who it is to a gateway and protects the connection.

Every client (the producer, the reader, the release client, ``headgate send``
and ``headgate tail``, the Spark source, ``headgate pipeline``) takes one
:class:`ClientSecurity`: a token for the gateway's tokens file and, for a TLS
listener, how to verify the gateway (and, for mutual TLS, which certificate
to show). It is the only way to give a client a token or TLS settings.

TLS is set up either from files (``ca_file``, ``cert_file``, ``key_file``),
which the object can carry anywhere, pickled into a Spark plan included, or
from an :class:`ssl.SSLContext` the application built itself
(``tls_context``), for what files cannot say (a trust store in memory, a
pinned cipher list); such an object stays in the process that made it.

The token can be given as such, or by where to find it: ``token_env`` (an
environment variable) or ``token_file`` (a file holding it). Those two are
read only when a connection is made, by the process that makes it, which is
what the Spark source needs: its options travel in query plans that Spark
shows in its UI and logs, so a token written there is readable by everyone
who can see the UI, while the *name* of a variable or file is not a secret.
The token never appears in this object's ``repr``.
"""

from __future__ import annotations

import os
import socket
import ssl as ssl_module
from dataclasses import dataclass, field
from pathlib import Path

from headgate.client.address import GatewayAddress
from headgate.client.tls import client_context
from headgate.protocol.messages import MAX_TOKEN_BYTES

__all__ = ["ClientSecurity", "SecurityError", "describe_tls_failure"]


class SecurityError(ValueError):
    """The security settings cannot be used; the message says why (never the token)."""


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """A client's token and TLS settings. The default is plain TCP without a token.

    Only one of ``token``, ``token_env`` and ``token_file`` may be set, and
    only one of ``tls_context`` and the files (``ca_file``, ``cert_file``).
    ``ca_file``, ``cert_file``, ``tls_context`` and ``server_name`` imply TLS.

    Example::

        ClientSecurity(token=os.environ["HEADGATE_TOKEN"], ca_file="ca.pem")
        ClientSecurity(token_env="HEADGATE_TOKEN", tls_context=my_context, server_name="gw")
    """

    #: The token itself, bytes or text (text is kept UTF-8 encoded; out of ``repr``).
    token: bytes | str | None = field(default=None, repr=False)
    #: The environment variable holding the token, read at connection time.
    token_env: str | None = None
    #: A file holding the token (surrounding whitespace ignored), read at connection time.
    token_file: str | None = None
    #: Speak TLS, verifying the gateway with the system's trust store unless ``ca_file``.
    tls: bool = False
    #: PEM bundle the gateway's certificate must chain to.
    ca_file: str | None = None
    #: Our certificate chain, for gateways that require client certificates.
    cert_file: str | None = None
    #: The key of ``cert_file`` (None if it is inside ``cert_file``).
    key_file: str | None = None
    #: The name the gateway's certificate must carry (default: the address's host).
    server_name: str | None = None
    #: A TLS context built by the application, used as it is instead of the
    #: files above (see :func:`headgate.client.tls.client_context`, which
    #: verifies the gateway). It cannot be pickled.
    tls_context: ssl_module.SSLContext | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.token, str):
            # Frozen: the one place the token is normalised, so equal tokens compare equal.
            object.__setattr__(self, "token", self.token.encode())
        given = [
            n for n in ("token", "token_env", "token_file") if getattr(self, n) not in (None, b"")
        ]
        if len(given) > 1:
            raise SecurityError(f"give the token one way only, not {' and '.join(given)}")
        if self.token is not None and len(self.token) > MAX_TOKEN_BYTES:
            raise SecurityError(f"a token is at most {MAX_TOKEN_BYTES} bytes")
        if self.tls_context is not None:
            if not isinstance(self.tls_context, ssl_module.SSLContext):
                raise SecurityError("tls_context must be an ssl.SSLContext")
            files = [n for n in ("ca_file", "cert_file", "key_file") if getattr(self, n)]
            if files:
                raise SecurityError(
                    f"give the TLS settings one way only, not tls_context and {' and '.join(files)}"
                )
        if self.key_file is not None and self.cert_file is None:
            raise SecurityError("a client key needs its certificate (cert_file)")
        for name in ("token_env", "token_file", "ca_file", "cert_file", "key_file"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise SecurityError(f"{name} must be a non-empty string")

    @property
    def uses_tls(self) -> bool:
        """Whether connections speak TLS."""
        return bool(
            self.tls
            or self.ca_file is not None
            or self.cert_file is not None
            or self.server_name is not None
            or self.tls_context is not None
        )

    def token_bytes(self) -> bytes:
        """The token to send in Hello (empty for none), read from its source now.

        Raises:
            SecurityError: the variable is unset or the file unreadable.
        """
        if self.token is not None:
            return self.token.encode() if isinstance(self.token, str) else self.token
        if self.token_env is not None:
            value = os.environ.get(self.token_env)
            if not value:
                raise SecurityError(
                    f"the environment variable {self.token_env} that should hold "
                    "the token is not set"
                )
            token = value.strip().encode()
        elif self.token_file is not None:
            try:
                token = Path(self.token_file).read_bytes().strip()
            except OSError as exc:
                raise SecurityError(
                    f"cannot read the token file {self.token_file}: {exc.strerror or exc}"
                ) from None
            if not token:
                raise SecurityError(f"the token file {self.token_file} is empty")
        else:
            return b""
        if len(token) > MAX_TOKEN_BYTES:
            raise SecurityError(f"a token is at most {MAX_TOKEN_BYTES} bytes")
        return token

    def ssl_context(self) -> ssl_module.SSLContext | None:
        """``tls_context``, else a context that verifies the gateway, or None for plain TCP.

        Raises:
            SecurityError: a certificate or key file cannot be loaded.
        """
        if self.tls_context is not None:
            return self.tls_context
        if not self.uses_tls:
            return None
        try:
            return client_context(
                ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file
            )
        except ValueError as exc:
            raise SecurityError(str(exc)) from None

    def check_address(self, address: GatewayAddress) -> None:
        """Refuse TLS to a Unix socket: the gateway speaks TLS on TCP only."""
        if address.is_unix and self.uses_tls:
            raise SecurityError(
                f"the gateway's Unix socket ({address}) does not speak TLS; "
                "drop the TLS settings (the socket's file permissions protect it) or use TCP"
            )

    def wrap_socket(self, sock: socket.socket, host: str | None) -> socket.socket:
        """``sock`` itself for plain TCP, else a TLS socket after the handshake.

        Blocking clients use this; the handshake honours ``sock``'s timeout.
        """
        context = self.ssl_context()
        if context is None:
            return sock
        try:
            return context.wrap_socket(sock, server_hostname=self.server_name or host)
        except BaseException:
            sock.close()
            raise


def describe_tls_failure(exc: BaseException) -> str | None:
    """A plain reason for a failed TLS verification, or None if ``exc`` is not one."""
    if isinstance(exc, ssl_module.SSLCertVerificationError):
        return f"TLS verification of the gateway failed: {exc.verify_message}"
    if isinstance(exc, ssl_module.SSLError):
        return f"TLS handshake with the gateway failed: {exc.reason or exc}"
    return None
