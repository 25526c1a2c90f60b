"""Which optional parts of headgate are installed, and what to install when one is not.

``pip install headgate`` brings the producer, the gateway and the command
line; Spark (pyspark, and pandas for its Arrow path) is the ``spark`` extra,
because a producer-only user should not download half a gigabyte of Spark.
The commands that need Spark ask :func:`require_spark` before they import
anything of it, so that a missing extra is one line that names the fix,
not a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib

#: The extra that brings Spark; ``pyproject.toml``'s ``[project.optional-dependencies]``.
SPARK_EXTRA = "spark"

#: The modules that extra brings (tests/test_packaging.py checks them against pyproject.toml).
SPARK_MODULES = ("pyspark", "pandas")


class MissingExtra(Exception):
    """An optional part of headgate is not installed; the message says how to install it."""


def install_hint(extra: str) -> str:
    """The pip command that adds ``extra``, quoted for a shell (brackets are globs)."""
    return f"pip install 'headgate[{extra}]'"


def require_spark() -> None:
    """Raise :class:`MissingExtra` unless Spark's modules import.

    Importing (not just finding) them also catches a half-installed Spark,
    such as pyspark without its py4j. The commands that call this import
    pyspark right after, so the import costs nothing extra.
    """
    for module in SPARK_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing = exc.name or module
            raise MissingExtra(
                f"this needs Spark, which is not installed ({missing} cannot be imported); "
                f"install it with: {install_hint(SPARK_EXTRA)}"
            ) from None
