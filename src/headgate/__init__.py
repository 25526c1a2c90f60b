"""headgate: flow-controlled ingestion into Spark.

The version is the installed distribution's, so that it has one home
(pyproject.toml); a source tree that was never installed says so instead of
guessing.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__: str = version("headgate")
except PackageNotFoundError:  # run from a source tree, not installed
    __version__ = "0+unknown"
