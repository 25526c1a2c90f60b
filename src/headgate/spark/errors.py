"""Spark's errors as one line a person can read, without JVM or Python traces.

Used wherever headgate runs Spark for someone: the pipeline's checks and
micro-batches (:mod:`headgate.spark.transform`, :mod:`headgate.spark.pipeline`)
and ``headgate query`` (:mod:`headgate.spark.query`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

__all__ = ["BatchError", "error_text", "quiet_spark_errors", "short_jvm_errors"]


_PYTHON_ERROR = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): (.+)$")


def error_text(exc: BaseException) -> str:
    """One line that says what went wrong in an error from Spark, without its traces.

    An error raised by Python code that Spark ran (a data source) arrives as
    Spark's message around that code's traceback: its last line is the one
    that matters.
    """
    text = str(getattr(exc, "desc", None) or exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in text:
        raised = [m.group(1) for line in lines if (m := _PYTHON_ERROR.match(line))]
        if raised:
            return raised[-1].split(" SQLSTATE:")[0]
    first = lines[0] if lines else type(exc).__name__
    return first.split(" SQLSTATE:")[0]


class BatchError(Exception):
    """A micro-batch's JVM call failed; the message is the Java error's first line."""


@contextlib.contextmanager
def short_jvm_errors() -> Iterator[None]:
    """Re-raise a JVM error inside ``foreachBatch`` with its first lines only.

    Spark decides whether a failed Python batch was interrupted by its own
    ``stop()`` by matching the error's text against a regular expression
    (``StreamExecution.isInterruptionException``) that recurses once per
    character: on a Java stack trace of a few hundred lines it throws
    StackOverflowError in the stream thread, which prints its own trace. The
    short message keeps what the expression looks for (the Py4J line and the
    Java exception) and what a person needs.
    """
    from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]

    try:
        yield
    except Py4JJavaError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
        called = lines[0].rstrip(".") if lines else "An error occurred while calling the JVM"
        java = lines[1].lstrip(": ") if len(lines) > 1 else type(exc).__name__
        raise BatchError(f"py4j.protocol.Py4JJavaError: {called}: {java}") from None


def quiet_spark_errors() -> Callable[[], None]:
    """Silence the loggers with which PySpark prints each analysis error and its JVM trace.

    The pipeline turns those errors into one plain message; return a function
    that restores the loggers.
    """
    from pyspark.logger import PySparkLogger

    # Created through PySpark, whose calls pass keywords only its class takes.
    loggers = [
        PySparkLogger.getLogger(name)
        for name in ("DataFrameQueryContextLogger", "SQLQueryContextLogger")
    ]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True

    def restore() -> None:
        for logger, disabled in zip(loggers, before, strict=True):
            logger.disabled = disabled

    return restore
