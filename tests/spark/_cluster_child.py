"""Child process: read through a gateway with Spark's ``local-cluster`` master.

Run by ``test_gateway_source.py`` (a JVM hosts one SparkContext, and the test
session already has a local one). Executors are separate JVMs with their own
Python workers, so they can only reach the data through the gateway.

    python _cluster_child.py GATEWAY OUTPUT_JSON

Writes ``{"rows": [[stream, position, producer, sequence, value_hex], ...],
"executor_pids": [...]}`` to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def local_cluster_session(name: str) -> Any:
    """A SparkSession on ``local-cluster[2,1,1024]``: two executors, each a JVM of its own."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName(name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.executor.memory", "512m")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def executor_pids(spark: Any) -> list[int]:
    """The process ids of the Python workers the executors run (one per executor here)."""

    def worker_pid(_: object) -> list[int]:
        return [os.getpid()]

    pids = spark.sparkContext.parallelize(range(8), 8).mapPartitions(worker_pid).collect()
    return sorted(set(pids))


def main() -> None:
    gateway, output = sys.argv[1], sys.argv[2]
    spark = local_cluster_session("headgate-local-cluster")
    try:
        frame = (
            spark.read.format("headgate")
            .option("gateway", gateway)
            # Small partitions, so that both executors read some of the data.
            .option("bytesPerPartition", 16 * 1024)
            .load()
        )
        rows = [
            [r.stream, r.position, r.producer, r.sequence, r.value.hex()]
            for r in frame.select("stream", "position", "producer", "sequence", "value").collect()
        ]
        from pyspark.sql.functions import spark_partition_id

        partitions = frame.select(spark_partition_id().alias("p")).distinct().count()

        pids = executor_pids(spark)
        with open(output, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "partitions": partitions,
                    "executor_pids": pids,
                    "driver_pid": os.getpid(),
                },
                f,
            )
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
