"""The pipeline: one Structured Streaming query per stream, logs to Parquet.

For each stream the TOML file describes how values are parsed (JSON with a
DDL schema, CSV with a DDL schema, or raw bytes), an optional SQL transform
over a view named after the stream, and a Parquet sink. Records that do not
parse never stop the query: they go to a dead-letter dataset with the raw
bytes, the stream, the position and the error.

Exactly once: each micro-batch is written by ``foreachBatch`` into a staging
directory and then moved into the dataset under names that carry the batch
id, replacing whatever an earlier attempt of the same batch left. Spark's
checkpoint fixes which offsets a batch id covers, so a replayed batch writes
the same rows under the same names.

Credit: after each committed micro-batch (the last one of a run included),
a :class:`~pyspark.sql.streaming.StreamingQueryListener` hands the committed
end offsets to ``release``, which tells the gateway; the gateway frees that
log space and turns it into guarantees for the stream's producers.

Example ``pipeline.toml``::

    data_dir = "./headgate-data"
    gateway = "127.0.0.1:7878"          # where releases go; optional
    read_through_gateway = false        # true: read the logs through the gateway
                                        # (a cluster), not from data_dir

    [streams.ticks]
    format = "json"
    schema = "symbol STRING, price DOUBLE, ts TIMESTAMP"
    transform = "SELECT symbol, price, ts FROM ticks WHERE price > 0"
    partition_by = ["symbol"]
    trigger_seconds = 1.0
    max_records_per_trigger = 100000
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headgate.config import ConfigError

Release = Callable[[str, int], None]

FORMATS = ("json", "csv", "raw")


@dataclass(frozen=True, slots=True)
class StreamPipeline:
    """How one stream is parsed, transformed and written."""

    #: The stream name (also the name of the SQL view).
    name: str
    #: json, csv or raw.
    format: str = "raw"
    #: DDL schema of the parsed value (json and csv).
    schema: str | None = None
    #: Optional SQL over the view named after the stream.
    transform: str | None = None
    #: Parquet partition columns of the transformed rows.
    partition_by: tuple[str, ...] = ()
    #: Micro-batch interval in seconds.
    trigger_seconds: float = 1.0
    #: Admission control per micro-batch.
    max_records_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Where to read, where to write, and the streams."""

    data_dir: Path
    streams: tuple[StreamPipeline, ...]
    gateway: str | None = None
    #: Read the logs through ``gateway`` (option ``gateway``) instead of ``data_dir``.
    read_through_gateway: bool = False
    output_dir: Path = field(default=Path())
    checkpoint_dir: Path = field(default=Path())

    def output(self, stream: str) -> Path:
        return self.output_dir / stream

    def dead_letters(self, stream: str) -> Path:
        return self.output_dir / "_dead_letters" / stream


def load_pipeline_config(path: Path) -> PipelineConfig:
    """Read a pipeline TOML file; every mistake is a ConfigError naming it."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"pipeline file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return pipeline_config_from_dict(raw, where=str(path))


def pipeline_config_from_dict(raw: dict[str, Any], *, where: str = "pipeline") -> PipelineConfig:
    unknown = set(raw) - {
        "data_dir",
        "gateway",
        "read_through_gateway",
        "output_dir",
        "checkpoint_dir",
        "streams",
    }
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    data_dir = Path(str(raw.get("data_dir", "headgate-data")))
    streams_raw = raw.get("streams")
    if not isinstance(streams_raw, dict) or not streams_raw:
        raise ConfigError(f"{where}: needs at least one [streams.NAME] table")
    streams = []
    for name, table in streams_raw.items():
        at = f"{where}: streams.{name}"
        if not isinstance(table, dict):
            raise ConfigError(f"{at} must be a table")
        known = {f for f in StreamPipeline.__dataclass_fields__ if f != "name"}
        bad = set(table) - known
        if bad:
            raise ConfigError(f"{at}: unknown key(s) {', '.join(sorted(bad))}")
        fmt = table.get("format", "raw")
        if fmt not in FORMATS:
            raise ConfigError(f"{at}.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if fmt != "raw" and not isinstance(table.get("schema"), str):
            raise ConfigError(f'{at}: format {fmt} needs a DDL schema, e.g. "a INT, b STRING"')
        partition_by = table.get("partition_by", [])
        if not isinstance(partition_by, list) or not all(isinstance(c, str) for c in partition_by):
            raise ConfigError(f"{at}.partition_by must be a list of column names")
        trigger = table.get("trigger_seconds", 1.0)
        if isinstance(trigger, bool) or not isinstance(trigger, int | float) or trigger <= 0:
            raise ConfigError(f"{at}.trigger_seconds must be a positive number")
        limits = {}
        for key in ("max_records_per_trigger", "max_bytes_per_trigger"):
            value = table.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"{at}.{key} must be a positive whole number")
            limits[key] = value
        transform = table.get("transform")
        if transform is not None and not isinstance(transform, str):
            raise ConfigError(f"{at}.transform must be SQL text")
        streams.append(
            StreamPipeline(
                name=name,
                format=fmt,
                schema=table.get("schema"),
                transform=transform,
                partition_by=tuple(partition_by),
                trigger_seconds=float(trigger),
                **limits,
            )
        )
    output_dir = Path(str(raw.get("output_dir", data_dir / "parquet")))
    checkpoint_dir = Path(str(raw.get("checkpoint_dir", data_dir / "checkpoints")))
    gateway = raw.get("gateway")
    through = raw.get("read_through_gateway", False)
    if not isinstance(through, bool):
        raise ConfigError(f"{where}: read_through_gateway must be true or false")
    if through and gateway is None:
        raise ConfigError(f'{where}: read_through_gateway needs gateway = "host:port"')
    return PipelineConfig(
        data_dir=data_dir,
        streams=tuple(streams),
        gateway=None if gateway is None else str(gateway),
        read_through_gateway=through,
        output_dir=output_dir,
        checkpoint_dir=checkpoint_dir,
    )


def spark_session(app_name: str = "headgate") -> Any:
    """A local SparkSession set up for headgate (workers use this interpreter)."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _commit_batch(frame: Any, target: Path, batch_id: int, partition_by: tuple[str, ...]) -> int:
    """Write one micro-batch's rows into ``target`` idempotently; return the row count."""
    staging = target / ".staging" / str(batch_id)
    shutil.rmtree(staging, ignore_errors=True)
    writer = frame.write.mode("overwrite")
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    writer.parquet(str(staging))
    prefix = f"batch-{batch_id:012d}-"
    # Whatever an earlier attempt of this batch moved in is replaced.
    for old in target.rglob(prefix + "*"):
        old.unlink()
    count = 0
    for part in staging.rglob("*.parquet"):
        relative = part.parent.relative_to(staging)
        destination = target / relative
        destination.mkdir(parents=True, exist_ok=True)
        os.replace(part, destination / f"{prefix}{part.name}")
        count += 1
    shutil.rmtree(staging, ignore_errors=True)
    return count


class Pipeline:
    """Runs the configured queries and reports progress back as releases.

    Releases go to ``release`` if given, else to the configured gateway as
    Release messages, else nowhere.
    """

    def __init__(self, spark: Any, config: PipelineConfig, release: Release | None = None):
        self.spark = spark
        self.config = config
        self._gateway_releases: Any = None
        if release is None and config.gateway is not None:
            from headgate.spark.remote import GatewayReleases

            self._gateway_releases = GatewayReleases(config.gateway)
            release = self._gateway_releases
        self._release = release
        self.queries: dict[str, Any] = {}
        self.rows_written: dict[str, int] = {s.name: 0 for s in config.streams}
        self.dead_letters: dict[str, int] = {s.name: 0 for s in config.streams}
        self.batches: dict[str, int] = {s.name: 0 for s in config.streams}
        self.committed: dict[str, int] = {}
        self._lock = threading.Lock()
        self._listener: Any = None

    def start(self, *, available_now: bool = False) -> None:
        """Start one query per stream (``available_now``: read what is there, then stop)."""
        from pyspark.sql.streaming.listener import StreamingQueryListener

        pipeline = self

        class _Progress(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                pass

            def onQueryProgress(self, event: Any) -> None:
                pipeline._on_progress(event.progress)

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        self._listener = _Progress()
        self.spark.streams.addListener(self._listener)
        for stream in self.config.streams:
            self.queries[stream.name] = self._start_query(stream, available_now)

    def _on_progress(self, progress: Any) -> None:
        # Fires in the driver after the batch's commit, the last batch included.
        for source in progress.sources:
            end = source.endOffset
            if not end:
                continue
            offsets = json.loads(end) if isinstance(end, str) else end
            for stream, position in offsets.items():
                with self._lock:
                    if position <= self.committed.get(stream, -1):
                        continue
                    self.committed[stream] = position
                if self._release is not None:
                    self._release(stream, int(position))

    def _start_query(self, stream: StreamPipeline, available_now: bool) -> Any:
        from pyspark.sql import functions as F

        reader = self.spark.readStream.format("headgate").option("streams", stream.name)
        if self.config.read_through_gateway:
            reader = reader.option("gateway", self.config.gateway)
        else:
            reader = reader.option("path", str(self.config.data_dir))
        if stream.max_records_per_trigger is not None:
            reader = reader.option("maxRecordsPerTrigger", stream.max_records_per_trigger)
        if stream.max_bytes_per_trigger is not None:
            reader = reader.option("maxBytesPerTrigger", stream.max_bytes_per_trigger)
        source = reader.load()
        output = self.config.output(stream.name)
        dead = self.config.dead_letters(stream.name)
        pipeline = self

        def write_batch(batch: Any, batch_id: int) -> None:
            text = F.col("value").cast("string")
            if stream.format == "raw":
                good = batch.select(
                    "stream", "position", "producer", "sequence", "ingest_time", "key", "value"
                )
                bad = None
            else:
                assert stream.schema is not None  # checked when the config was read
                if stream.format == "json":
                    parsed = F.from_json(text, stream.schema, {"mode": "PERMISSIVE"})
                else:
                    parsed = F.from_csv(text, stream.schema, {"mode": "PERMISSIVE"})
                with_parsed = batch.withColumn("_parsed", parsed)
                # A record is bad when nothing of the schema could be read.
                fields = [
                    F.col(f"_parsed.{n}")
                    for n in with_parsed.schema["_parsed"].dataType.fieldNames()
                ]
                ok = F.lit(False)
                for column in fields:
                    ok = ok | column.isNotNull()
                good = with_parsed.where(ok).select(
                    "stream", "position", "producer", "sequence", "ingest_time", "_parsed.*"
                )
                bad = with_parsed.where(~ok).select(
                    "stream",
                    "position",
                    "producer",
                    "sequence",
                    F.col("value").alias("raw"),
                    F.lit(f"value is not valid {stream.format} for schema {stream.schema}").alias(
                        "error"
                    ),
                )
            if stream.transform:
                good.createOrReplaceTempView(stream.name)
                good = good.sparkSession.sql(stream.transform)
            good = good.persist()
            rows = good.count()
            _commit_batch(good, output, batch_id, stream.partition_by)
            good.unpersist()
            bad_rows = 0
            if bad is not None:
                bad = bad.persist()
                bad_rows = bad.count()
                if bad_rows:
                    _commit_batch(bad, dead, batch_id, ())
                bad.unpersist()
            with pipeline._lock:
                pipeline.rows_written[stream.name] += rows
                pipeline.dead_letters[stream.name] += bad_rows
                pipeline.batches[stream.name] += 1

        writer = (
            source.writeStream.foreachBatch(write_batch)
            .option("checkpointLocation", str(self.config.checkpoint_dir / stream.name))
            .queryName(f"headgate_{stream.name}")
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{stream.trigger_seconds} seconds")
        return writer.start()

    def await_done(self, timeout: float | None = None) -> None:
        """Wait for availableNow queries to finish (or raise their failure)."""
        for query in self.queries.values():
            query.awaitTermination(timeout)
        self.drain_progress()

    def drain_progress(self, timeout_ms: int = 30_000) -> None:
        """Wait until Spark delivered every progress event, so the last release is out.

        Progress reaches the listener asynchronously, through Spark's listener
        bus; without this the final batch's release could be lost at shutdown.
        """
        bus = self.spark.sparkContext._jsc.sc().listenerBus()
        bus.waitUntilEmpty(timeout_ms)

    def catch_up(self) -> None:
        """Block until every running query has processed what is available now."""
        for query in self.queries.values():
            query.processAllAvailable()
        self.drain_progress()

    def stop(self) -> None:
        for query in self.queries.values():
            query.stop()
        if self._listener is not None:
            self.spark.streams.removeListener(self._listener)
            self._listener = None
        if self._gateway_releases is not None:
            self._gateway_releases.close()
