"""One local SparkSession for every Spark test (starting one costs seconds).

The session never registers a data source: ``format("headgate")`` must work
through the ``pyspark_headgate`` module alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from headgate.spark.pipeline import spark_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    # Python workers must run this interpreter (the project's virtualenv),
    # not whatever ``python3`` is first on the PATH; tests insist on it.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = spark_session("headgate-tests")
    yield session
    session.stop()
