"""Child process: one batch query over a fleet with Spark's ``local-cluster`` master.

Run by ``test_fleet_source.py`` (a JVM hosts one SparkContext, and the test
session already has a local one). Executors are separate JVMs with their own
Python workers, so they can reach each partition only through its gateway.

    python _fleet_cluster_child.py CLUSTER_TOML OUTPUT_JSON

Writes ``{"rows": [[stream, partition, position, index, value_hex], ...],
"executor_pids": [...], "driver_pid": ...}`` to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    cluster, output = sys.argv[1], sys.argv[2]
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName("headgate-fleet-local-cluster")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.executor.memory", "512m")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        frame = (
            spark.read.format("headgate")
            .option("cluster", cluster)
            .option("streams", "orders")
            .option("bytesPerPartition", 16 * 1024)
            .load()
        )
        rows = [
            [r.stream, r.partition, r.position, r["index"], r.value.hex()]
            for r in frame.select("stream", "partition", "position", "index", "value").collect()
        ]

        def worker_pid(_: object) -> list[int]:
            return [os.getpid()]

        pids = sorted(
            set(spark.sparkContext.parallelize(range(8), 8).mapPartitions(worker_pid).collect())
        )
        with open(output, "w") as f:
            json.dump({"rows": rows, "executor_pids": pids, "driver_pid": os.getpid()}, f)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
