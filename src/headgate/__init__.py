"""headgate: flow-controlled ingestion into Spark.

The public API, re-exported here by name: the producers (:class:`Producer`,
:class:`SyncProducer`), the readers (:class:`Reader`, :class:`SyncReader`,
:class:`StartAt`), the release client (:class:`ReleaseClient`), and their
addresses, security settings and errors. Every name in ``__all__`` is the
same object as in :mod:`headgate.client`, its one home.

They are loaded when first asked for, not at import: ``headgate serve``
imports this package on its way to the gateway, and must not pay for the
clients' modules. The version is the installed distribution's, so that it
has one home (pyproject.toml); a source tree that was never installed says
so instead of guessing. ``importlib.metadata`` (and the email parser it pulls
in) costs a gateway's start-up tens of milliseconds, so it too is imported
only when ``__version__`` is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as mypy and editors see them; loaded lazily below
    from headgate.client import (
        BatchResult,
        ClientSecurity,
        GatewayAddress,
        Producer,
        ProducerError,
        ProducerGaveUp,
        Reader,
        ReaderError,
        ReleaseClient,
        SessionRefused,
        StartAt,
        StreamRefused,
        SyncProducer,
        SyncReader,
    )

__all__ = [
    "BatchResult",
    "ClientSecurity",
    "GatewayAddress",
    "Producer",
    "ProducerError",
    "ProducerGaveUp",
    "Reader",
    "ReaderError",
    "ReleaseClient",
    "SessionRefused",
    "StartAt",
    "StreamRefused",
    "SyncProducer",
    "SyncReader",
    "__version__",
]

#: The names re-exported from :mod:`headgate.client`: all but the version.
_CLIENT_NAMES = frozenset(__all__) - {"__version__"}


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        import headgate.client

        value = getattr(headgate.client, name)
        globals()[name] = value  # asked once
        return value
    if name != "__version__":
        raise AttributeError(f"module 'headgate' has no attribute {name!r}")
    import importlib.metadata

    try:
        return importlib.metadata.version("headgate")
    except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
        return "0+unknown"


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
