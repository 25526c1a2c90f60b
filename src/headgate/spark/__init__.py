"""Spark's side of headgate: the ``headgate`` data source over the stream logs.

:mod:`headgate.spark.source` holds the PySpark classes and options,
:mod:`headgate.spark.planning` what the driver decides (offsets, admission,
partitions) and :mod:`headgate.spark.decode` what executors do (frames to
Arrow batches).
"""

from headgate.spark.decode import SourceError
from headgate.spark.source import SCHEMA, HeadgateDataSource

__all__ = ["SCHEMA", "HeadgateDataSource", "SourceError"]
