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
from pathlib import Path


def main() -> None:
    cluster, output = sys.argv[1], sys.argv[2]
    # The child runs as a script: the repository's root is not on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.spark._cluster_child import executor_pids, local_cluster_session

    spark = local_cluster_session("headgate-fleet-local-cluster")
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
        pids = executor_pids(spark)
        with open(output, "w") as f:
            json.dump({"rows": rows, "executor_pids": pids, "driver_pid": os.getpid()}, f)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
