"""headgate: flow-controlled ingestion into Spark.

The version is the installed distribution's, so that it has one home
(pyproject.toml); a source tree that was never installed says so instead of
guessing. It is looked up when asked for, not at import: ``importlib.metadata``
(and the email parser it pulls in) costs a gateway's start-up tens of
milliseconds, more on a busy machine, and ``headgate serve`` never needs it.
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    if name != "__version__":
        raise AttributeError(f"module 'headgate' has no attribute {name!r}")
    import importlib.metadata

    try:
        return importlib.metadata.version("headgate")
    except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
        return "0+unknown"
