"""How fast the headgate source feeds Spark, beside a source that costs nothing.

Writes ``--rows`` records (100-byte values, no keys) to one stream log, then
in one SparkSession runs two ``Trigger.AvailableNow`` queries into Parquet:

* ``headgate``: the real source reading the log;
* ``synthetic``: an in-memory Arrow source that yields the same rows, in the
  same schema, partitions and batch sizes, without touching a disk.

The synthetic query is the ceiling (DESIGN.md: about 0.8M rows/s here); the
ratio says what reading the log costs on top of Spark itself::

    .venv/bin/python bench/spark.py --rows 2000000
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from headgate.log import StreamLog
from headgate.protocol.records import encode_arrow
from headgate.spark.decode import BATCH_RECORDS, arrow_schema
from headgate.spark.planning import StreamLogs, StreamSelection, plan_slices
from headgate.spark.source import DEFAULT_BYTES_PER_PARTITION, SCHEMA

VALUE_BYTES = 100
STREAM = "bench"
PRODUCER = 1
BASE_TIME_US = 1_700_000_000_000_000
_POOL_BYTES = 1 << 20


def value_pool() -> Any:
    """Every 100-byte window of 1 MiB of random letters: where values come from.

    Built where it is used (never a module global: Spark pickles the synthetic
    reader by value, globals included).
    """
    letters = np.random.default_rng(7).integers(97, 123, _POOL_BYTES, dtype=np.uint8)
    return np.lib.stride_tricks.sliding_window_view(letters, VALUE_BYTES)


def values_for(pool: Any, first: int, count: int) -> pa.Array:
    """Values of records ``first .. first + count``: 100 bytes each, text-like, deterministic."""
    starts = (np.arange(first, first + count, dtype=np.int64) * 7919) % len(pool)
    data = np.ascontiguousarray(pool[starts]).reshape(-1)
    offsets = np.arange(0, (count + 1) * VALUE_BYTES, VALUE_BYTES, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def write_log(data_dir: str, rows: int, per_frame: int) -> None:
    frame_bytes = 48 + 8 + 4 * (per_frame + 1) + VALUE_BYTES * per_frame
    capacity = (rows // per_frame + 2) * frame_bytes * 2
    with StreamLog.open(
        os.path.join(data_dir, "streams", STREAM), capacity=capacity - capacity % 8
    ) as log:
        pool = value_pool()
        for first in range(0, rows, per_frame):
            count = min(per_frame, rows - first)
            log.append(
                encode_arrow(values_for(pool, first, count)),
                producer_id=PRODUCER,
                first_sequence=first,
                record_count=count,
                timestamp_us=BASE_TIME_US + first,
            )
        log.sync()


# --- the synthetic ceiling: same rows, no log -------------------------------------------


class _Range(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        super().__init__((start, end))
        self.start, self.end = start, end


class _SyntheticReader(DataSourceStreamReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.rows = int(options["rows"])
        self.partition_count = int(options["partitions"])
        self.batch_rows = int(options["batchRows"])

    def initialOffset(self) -> dict[str, int]:
        return {"rows": 0}

    def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
        return {"rows": self.rows}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        a, b, n = start["rows"], end["rows"], self.partition_count
        cuts = [a + (b - a) * i // n for i in range(n + 1)]
        return [_Range(x, y) for x, y in itertools.pairwise(cuts) if y > x]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Range)
        schema = arrow_schema()
        pool = value_pool()
        for first in range(partition.start, partition.end, self.batch_rows):
            count = min(self.batch_rows, partition.end - first)
            positions = np.arange(first, first + count, dtype=np.int64)
            yield pa.RecordBatch.from_arrays(
                [
                    pa.repeat(pa.scalar(STREAM, pa.string()), count),
                    pa.array(positions // 1000 * 1000),
                    pa.array(positions % 1000),  # index: 1,000 records a frame
                    pa.array(np.full(count, PRODUCER, dtype=np.int64)),
                    pa.array(positions),
                    pa.array(BASE_TIME_US + positions // 1000 * 1000).view(
                        schema.field("ingest_time").type
                    ),
                    pa.nulls(count, pa.binary()),
                    values_for(pool, first, count),
                ],
                schema=schema,
            )


class SyntheticSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "headgate_bench_synthetic"

    def schema(self) -> Any:
        return SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return _SyntheticReader(self.options)


# --- running ------------------------------------------------------------------------------


def run(spark: SparkSession, source: str, options: dict[str, str], out: str) -> tuple[float, float]:
    """One AvailableNow query into Parquet: wall seconds (start to end) and batch seconds.

    Batch seconds add up the micro-batches' own time (Spark's ``triggerExecution``),
    leaving out the start and stop of the query, which cost the same for any source.
    """
    shutil.rmtree(out, ignore_errors=True)
    reader = spark.readStream.format(source)
    for key, value in options.items():
        reader = reader.option(key, value)
    started = time.perf_counter()
    query = (
        reader.load()
        .writeStream.format("parquet")
        .option("path", out)
        .option("checkpointLocation", out + ".ck")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    wall = time.perf_counter() - started
    batches = sum(
        p["durationMs"].get("triggerExecution", 0)
        for p in query.recentProgress
        if p["numInputRows"]
    )
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".ck", ignore_errors=True)
    return wall, batches / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="records to move")
    parser.add_argument("--per-frame", type=int, default=1000, help="records per log frame")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each; the best counts")
    args = parser.parse_args()

    os.environ["PYSPARK_PYTHON"] = sys.executable
    work = tempfile.mkdtemp(prefix="headgate-bench-")
    try:
        data_dir = os.path.join(work, "data")
        started = time.perf_counter()
        write_log(data_dir, args.rows, args.per_frame)
        print(f"wrote {args.rows:,} records in {time.perf_counter() - started:.1f} s")

        logs = StreamLogs(data_dir, StreamSelection())
        end = logs.latest(STREAM)
        partitions = len(plan_slices(logs, {STREAM: (0, end)}, DEFAULT_BYTES_PER_PARTITION))
        logs.close()

        spark = (
            SparkSession.builder.master("local[2]")
            .appName("headgate-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(SyntheticSource)
        sources = {
            "headgate": ("headgate", {"path": data_dir}),
            "synthetic": (
                "headgate_bench_synthetic",
                {
                    "rows": str(args.rows),
                    "partitions": str(partitions),
                    "batchRows": str(BATCH_RECORDS),
                },
            ),
        }
        # The first full-size query of a session runs two to three times slower
        # (JIT, Parquet and Arrow warm-up): one of each, not counted.
        print("warming up (one run of each, not counted)")
        for label, (source, options) in sources.items():
            run(spark, source, options, os.path.join(work, label))

        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):
            for label, (source, options) in sources.items():
                wall, batch = run(spark, source, options, os.path.join(work, label))
                print(
                    f"  {label:9} wall {wall:5.2f} s = {args.rows / wall:>9,.0f} rows/s   "
                    f"batch {batch:5.2f} s = {args.rows / batch:>9,.0f} rows/s"
                )
                old_wall, old_batch = best.get(label, (wall, batch))
                best[label] = (min(old_wall, wall), min(old_batch, batch))
        spark.stop()

        print(f"best of {args.repeat}, {args.rows:,} rows, {partitions} partitions, 1 batch:")
        for what, index in (("wall", 0), ("batch", 1)):
            ours, ceiling = (args.rows / best[label][index] for label in ("headgate", "synthetic"))
            print(
                f"  {what:5}  headgate {ours:>9,.0f} rows/s   synthetic {ceiling:>9,.0f} rows/s"
                f"   ratio {ours / ceiling:.2f} (target >= 0.80)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
