"""Where a gateway listens: a TCP address or a Unix socket.

Every client (``Producer``, ``SyncProducer``, ``headgate send``, the
pipeline's release client) takes the gateway's address as one string:

``host:port``
    TCP. IPv6 hosts go in brackets (``[::1]:7878``); a bare host gets the
    default port 7878.
``unix:PATH``
    A Unix domain socket, the one ``headgate serve --unix-socket PATH``
    listens on (``unix:/run/headgate.sock``, or a relative
    ``unix:headgate.sock``). On one machine it skips the TCP stack.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl as ssl_module
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from headgate.config import DEFAULT_PORT, ConfigError, parse_address

__all__ = ["UNIX_PREFIX", "GatewayAddress"]

UNIX_PREFIX = "unix:"

# sockaddr_un.sun_path is 108 bytes on Linux, one of them the final NUL.
_MAX_UNIX_PATH = 107

P = TypeVar("P", bound=asyncio.BaseProtocol)


@dataclass(frozen=True, slots=True)
class GatewayAddress:
    """A gateway's address: ``path`` for a Unix socket, else ``host`` and ``port``."""

    #: TCP host name or IP address (unused for a Unix socket).
    host: str = "127.0.0.1"
    #: TCP port (unused for a Unix socket).
    port: int = DEFAULT_PORT
    #: The Unix socket's path, or None for TCP.
    path: str | None = None

    @classmethod
    def parse(
        cls, value: str | tuple[str, int] | GatewayAddress, *, what: str = "gateway address"
    ) -> GatewayAddress:
        """Read ``host:port``, ``unix:PATH``, a ``(host, port)`` tuple, or an address.

        Raises:
            ConfigError: the text is not an address; the message says why.
        """
        if isinstance(value, GatewayAddress):
            return value
        if isinstance(value, tuple):
            host, port = value
            return cls(host=str(host), port=int(port))
        if not isinstance(value, str):
            raise ConfigError(f"{what}: expected host:port or unix:PATH, got {value!r}")
        text = value.strip()
        if text.startswith(UNIX_PREFIX):
            path = text[len(UNIX_PREFIX) :]
            if not path:
                raise ConfigError(f"{what}: {value!r} names no socket path (unix:/path/to.sock)")
            if "\0" in path:
                raise ConfigError(f"{what}: a socket path cannot contain NUL")
            if len(os.fsencode(path)) > _MAX_UNIX_PATH:
                raise ConfigError(
                    f"{what}: the Unix socket path is {len(os.fsencode(path))} bytes long; "
                    f"the system allows at most {_MAX_UNIX_PATH}"
                )
            return cls(path=path)
        host, port = parse_address(text, what=what)
        return cls(host=host, port=port)

    @property
    def is_unix(self) -> bool:
        """Whether this is a Unix socket."""
        return self.path is not None

    def __str__(self) -> str:
        if self.path is not None:
            return UNIX_PREFIX + self.path
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    async def connect(
        self,
        factory: Callable[[], P],
        *,
        ssl: ssl_module.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> tuple[asyncio.Transport, P]:
        """Open an asyncio connection to the gateway with ``factory``'s protocol.

        With ``ssl`` the connection speaks TLS and checks the gateway's
        certificate against ``server_hostname`` (by default the host).
        """
        loop = asyncio.get_running_loop()
        if self.path is not None:
            transport, protocol = await loop.create_unix_connection(
                factory, self.path, ssl=ssl, server_hostname=server_hostname
            )
        else:
            transport, protocol = await loop.create_connection(
                factory,
                self.host,
                self.port,
                ssl=ssl,
                server_hostname=None if ssl is None else server_hostname or self.host,
            )
        assert isinstance(transport, asyncio.Transport)
        return transport, protocol

    def connect_socket(self, timeout: float) -> socket.socket:
        """Open a blocking socket to the gateway (for clients without an event loop)."""
        if self.path is None:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        return sock
