"""PySpark discovers data sources in top-level ``pyspark_<name>`` modules.

Defining ``DefaultSource`` here is what makes ``format("headgate")`` work
without a register call.
"""

from headgate.spark.source import HeadgateDataSource as DefaultSource

__all__ = ["DefaultSource"]
