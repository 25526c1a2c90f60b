"""Spark's side of headgate: the ``headgate`` data source over the stream logs.

:mod:`headgate.spark.source` holds the PySpark classes and options,
:mod:`headgate.spark.planning` what the driver decides (offsets, admission,
partitions) and :mod:`headgate.spark.decode` what executors do (frames to
Arrow batches). The pipeline that runs queries over it is
:mod:`headgate.spark.pipeline` (its file in ``pipeline_config``, each batch's
work in ``transform``, its checkpoints in ``checkpoints``, its gateway
consumers in ``releases``).
"""

from headgate.spark.decode import SourceError
from headgate.spark.source import SCHEMA, HeadgateDataSource

__all__ = ["SCHEMA", "HeadgateDataSource", "SourceError"]
