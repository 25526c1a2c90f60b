"""``headgate query SQL``: SQL over the pipeline's Parquet output, one table per stream.

A mistyped query is the common case here, so its error is one line: Spark's
own message, without the JSON log record (with the JVM's stack trace) that
PySpark logs for every analysis error before it raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headgate.spark.errors import error_text, quiet_spark_errors

__all__ = ["QueryError", "parquet_tables", "run_query"]


class QueryError(Exception):
    """The query could not run; the message is one line that says why."""


def parquet_tables(data_dir: Path) -> list[Path]:
    """The datasets under ``<data_dir>/parquet``, one per stream; QueryError if none."""
    root = data_dir / "parquet"
    tables = (
        sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
        if root.is_dir()
        else []
    )
    if not tables:
        raise QueryError(f"no Parquet datasets under {root}; run the pipeline first")
    return tables


def run_query(spark: Any, sql: str, data_dir: Path, *, rows: int = 50) -> None:
    """Show the first ``rows`` rows of ``sql``; each stream's dataset is a table of its name.

    Raises :class:`QueryError` with Spark's one-line reason when the query
    does not parse, does not resolve, or fails while it runs.
    """
    from pyspark.errors import PySparkException

    tables = parquet_tables(data_dir)
    restore = quiet_spark_errors()
    try:
        for table in tables:
            spark.read.parquet(str(table)).createOrReplaceTempView(table.name)
        spark.sql(sql).show(rows, truncate=False)
    except PySparkException as exc:  # Spark's errors, JVM ones included
        raise QueryError(error_text(exc)) from None
    finally:
        restore()
