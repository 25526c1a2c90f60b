"""The pipeline: one Structured Streaming query per stream, logs to Parquet.

Its parts, each in its own module:

* :mod:`headgate.spark.pipeline_config`: the TOML file, its checks and the
  :class:`PipelineConfig` it makes (no Spark needed);
* :mod:`headgate.spark.transform`: what each micro-batch goes through
  (values parsed, dead letters, the SQL transform, rows written into
  Parquet exactly once);
* :mod:`headgate.spark.checkpoints`: what each query's checkpoint records
  (its definition, its committed end);
* :mod:`headgate.spark.releases`: the gateway consumers the queries
  declare and release to;
* :mod:`headgate.spark.errors`: Spark's errors as one line;
* this module: running it. :class:`Pipeline` starts the queries in a
  SparkSession (:func:`spark_session`), one per stream with its trigger,
  and turns each committed batch into a release through a
  :class:`~pyspark.sql.streaming.StreamingQueryListener`. ``headgate
  pipeline`` (:mod:`headgate.spark.command`) wraps it with status lines,
  restarts and signals.

Every name of those modules that callers use is importable from here too,
as it always was (``from headgate.spark.pipeline import Pipeline,
load_pipeline_config``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headgate.protocol.messages import DEFAULT_CONSUMER
from headgate.spark.checkpoints import (
    DEFINITION_FILE,
    check_definitions,
    committed_positions,
    query_definition,
)
from headgate.spark.errors import BatchError, error_text, short_jvm_errors
from headgate.spark.pipeline_config import (
    FLEET_META_COLUMNS,
    FORMATS,
    META_COLUMNS,
    PARSER_OPTIONS,
    PipelineConfig,
    StreamPipeline,
    load_pipeline_config,
    meta_columns,
    pipeline_config_from_dict,
)
from headgate.spark.planning import offset_address
from headgate.spark.releases import (
    GatewayReleases,
    Release,
    consumer_settings,
    declare_consumers,
    release_committed,
)
from headgate.spark.transform import (
    CORRUPT_COLUMN,
    StreamPlan,
    check_pipeline,
    commit_batch,
    parse_batch,
    plan_stream,
    transform_batch,
)

__all__ = [
    "CORRUPT_COLUMN",
    "DEFINITION_FILE",
    "FLEET_META_COLUMNS",
    "FORMATS",
    "META_COLUMNS",
    "PARSER_OPTIONS",
    "BatchError",
    "ConsumerProgress",
    "GatewayReleases",
    "Pipeline",
    "PipelineConfig",
    "Release",
    "StreamPipeline",
    "check_definitions",
    "check_pipeline",
    "committed_positions",
    "consumer_progress",
    "consumer_settings",
    "declare_consumers",
    "error_text",
    "load_pipeline_config",
    "meta_columns",
    "pipeline_config_from_dict",
    "plan_stream",
    "query_definition",
    "query_name",
    "release_committed",
    "spark_session",
]

log = logging.getLogger("headgate.pipeline")


def spark_session(app_name: str = "headgate", *, local_dir: Path | None = None) -> Any:
    """A local SparkSession set up for headgate (workers use this interpreter).

    ``local_dir``: Spark's scratch space (``spark.local.dir``) instead of the
    system's temp folder. It applies only when this call starts Spark; a
    session that already runs keeps its own.
    """
    from pyspark.sql import SparkSession

    # An installed headgate does the first line at every interpreter start
    # (setup.py's .pth file); a source tree on PYTHONPATH has no .pth.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master("local[2]")
    if local_dir is not None:
        builder = builder.config("spark.local.dir", str(local_dir))
    spark = (
        builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


#: A key the pipeline leaves in the data source's shared environment once it is settled.
_SETTLED_MARK = "HEADGATE_SOURCE_ENVIRONMENT_SETTLED"


def _settle_source_environment(spark: Any) -> None:
    """Work around a Spark race that fails a query's batch with "Illegal size N of collection".

    Spark keeps one environment map (a Scala ``mutable.HashMap``) for the
    ``headgate`` data source in the whole JVM, shared by every query that
    reads it. Each query's start (``PythonStreamingSourceRunner.init``) puts
    its worker settings into that very map, and every task of every batch
    serializes it (inside the partition reader factory). When one query's
    start changes the map's structure while another query's batch is being
    serialized, the serializer counts fewer entries than it announced and the
    job fails with ``Task serialization failed: IllegalStateException:
    Illegal size 5 of collection, expected 7``. A restart over a full log hits
    it: the first query's batch runs while the next queries start.

    The structure changes in two cases only: a key put for the first time
    (the first start in this JVM), and a put that finds the map at its
    growth threshold (the growth check comes before the key is looked up,
    so the second start grows it). Growing the map well beyond its entries
    now, before any query of ours runs, leaves only the first start's new
    keys; :meth:`Pipeline.start` lets that start finish before the other
    queries begin. Where Spark has no such map (another version, Spark
    Connect), this does nothing.
    """
    try:
        source = (
            spark._jsparkSession.sessionState().dataSourceManager().lookupDataSource("headgate")
        )
        environment = source.dataSourceCls().envVars()
        if environment.containsKey(_SETTLED_MARK):
            return
        # A Scala or Java hash map never shrinks: 64 extra keys grow its table
        # to room for about 96, far above the dozen settings a start puts.
        fillers = [f"HEADGATE_SETTLING_{i}" for i in range(64)]
        for key in fillers:
            environment.put(key, "")
        for key in fillers:
            environment.remove(key)
        environment.put(_SETTLED_MARK, "1")
    except Exception:  # not the JVM this works around
        log.debug("no shared data source environment to settle", exc_info=True)


def _await_source_start(query: Any, timeout: float = 120.0) -> None:
    """Wait until ``query`` has created its source (its Python reader runs), or ended."""
    import time

    starting = ("Initializing StreamExecution", "Initializing sources")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and query.isActive:
        if query.status.get("message") not in starting:
            return
        time.sleep(0.05)


def query_name(stream: StreamPipeline) -> str:
    """The Spark query's name: one per stream and consumer (Spark refuses two alike at once).

    Two pipelines may read one stream in one SparkSession as two consumers.
    """
    if stream.consumer == DEFAULT_CONSUMER:
        return f"headgate_{stream.name}"
    return f"headgate_{stream.name}__{stream.consumer}"


@dataclass(frozen=True, slots=True)
class ConsumerProgress:
    """What a stream's last progress said of its consumer (the source's ``_consumer`` figures)."""

    #: The consumer the query reads for.
    consumer: str
    #: Log bytes between the end of the last planned batch and the durable end.
    lag_bytes: int
    #: Bytes skipped (freed before they were read) with fail_on_data_loss false.
    skipped_bytes: int
    #: Records in ``lag_bytes``; None where the source could not count them.
    lag_records: int | None = None
    #: Records in ``skipped_bytes``; None where the source could not count them.
    skipped_records: int | None = None


def consumer_progress(latest_offset: object) -> dict[str, ConsumerProgress]:
    """The consumer figures in a source progress's ``latestOffset``, by stream; {} if none."""
    from headgate.spark.source import PROGRESS_KEY

    try:
        parsed = json.loads(latest_offset) if isinstance(latest_offset, str) else latest_offset
    except ValueError:
        return {}
    figures = parsed.get(PROGRESS_KEY) if isinstance(parsed, dict) else None
    if not isinstance(figures, dict) or not isinstance(figures.get("lag_bytes"), dict):
        return {}
    skipped = figures.get("skipped_bytes")
    skipped = skipped if isinstance(skipped, dict) else {}

    def count(key: str, stream: object) -> int | None:
        table = figures.get(key)
        value = table.get(stream) if isinstance(table, dict) else None
        return value if isinstance(value, int) else None

    return {
        str(stream): ConsumerProgress(
            consumer=str(figures.get("name") or DEFAULT_CONSUMER),
            lag_bytes=int(lag),
            skipped_bytes=int(skipped.get(stream, 0)),
            lag_records=count("lag_records", stream),
            skipped_records=count("skipped_records", stream),
        )
        for stream, lag in figures["lag_bytes"].items()
        if isinstance(lag, int)
    }


class Pipeline:
    """Runs the configured queries and reports progress back as releases.

    Releases go to ``release`` if given, else to the configured gateway as
    Release messages, else nowhere.
    """

    def __init__(self, spark: Any, config: PipelineConfig, release: Release | None = None):
        self.spark = spark
        self.config = config
        self._gateway_releases: GatewayReleases | None = None
        if release is None and (config.gateway is not None or config.cluster is not None):
            self._gateway_releases = GatewayReleases(config)
            release = self._gateway_releases.release
        self._release = release
        self.queries: dict[str, Any] = {}
        self.rows_written: dict[str, int] = {s.name: 0 for s in config.streams}
        self.dead_letters: dict[str, int] = {s.name: 0 for s in config.streams}
        self.batches: dict[str, int] = {s.name: 0 for s in config.streams}
        self.committed: dict[str, int] = {}
        #: Per stream, its consumer's lag and skipped bytes at the last progress.
        self.consumer_progress: dict[str, ConsumerProgress] = {}
        self._lock = threading.Lock()
        self._listener: Any = None
        self._query_names = {query_name(s) for s in config.streams}
        self._plans: dict[str, StreamPlan] = {}
        self._available_now = False

    def start(self, *, available_now: bool = False) -> None:
        """Check every stream, then start one query per stream.

        ``available_now``: read what is there, then stop.

        Raises:
            ConfigError: a stream's schema, transform or partitioning is wrong,
                or its checkpoint was made for another definition.
        """
        from pyspark.sql.streaming.listener import StreamingQueryListener

        plans = check_pipeline(self.spark, self.config)
        check_definitions(self.config)
        pipeline = self
        # Py4J logs every error raised in a foreachBatch callback with its
        # whole traceback; the same error ends the query, whose exception
        # says it in one line (error_text), so the log is only noise.
        logging.getLogger("py4j.clientserver").setLevel(logging.CRITICAL)

        class _Progress(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                pass

            def onQueryProgress(self, event: Any) -> None:
                pipeline._on_progress(event.progress)

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        if self._gateway_releases is not None:
            # Each query's consumer holds the log from before its first batch.
            declare_consumers(self.config)
        self._listener = _Progress()
        self.spark.streams.addListener(self._listener)
        self._plans = plans
        self._available_now = available_now
        self._release_checkpoints()
        _settle_source_environment(self.spark)
        for index, stream in enumerate(self.config.streams):
            self.queries[stream.name] = self._start_query(plans[stream.name], available_now)
            if index == 0:
                # The first start in this JVM adds keys to the environment
                # that every batch serializes (see _settle_source_environment):
                # no other query may be in a batch meanwhile.
                _await_source_start(self.queries[stream.name])

    def restart_query(self, stream: str) -> None:
        """Start a stream's query again, from its checkpoint (after it failed)."""
        self.queries[stream] = self._start_query(self._plans[stream], self._available_now)

    def _release_checkpoints(self) -> None:
        """Release what each checkpoint records as committed, before any batch runs."""
        release_committed(self.config, self._release_once)

    def _release_once(self, stream: str, position: int) -> None:
        """Send a release unless one at or past ``position`` went out already."""
        with self._lock:
            if position <= self.committed.get(stream, -1):
                return
            self.committed[stream] = position
        if self._release is not None:
            try:
                self._release(stream, int(position))
            except Exception:  # never let it kill Spark's listener thread
                log.exception("releasing %s at %d failed", stream, position)

    def _on_progress(self, progress: Any) -> None:
        # Fires in the driver after the batch's commit, the last batch included,
        # for every query of the session: another pipeline's are not ours.
        if progress.name not in self._query_names:
            return
        for source in progress.sources:
            figures = consumer_progress(source.latestOffset)
            if figures:
                with self._lock:
                    self.consumer_progress.update(figures)
            end = source.endOffset
            if not end:
                continue
            offsets = json.loads(end) if isinstance(end, str) else end
            for stream, value in offsets.items():
                # An address inside a batch: that batch is not read yet.
                self._release_once(stream, offset_address(value).position)

    def _start_query(self, plan: StreamPlan, available_now: bool) -> Any:
        stream = plan.stream
        reader = (
            self.spark.readStream.format("headgate")
            .option("streams", stream.name)
            .option("missingStreams", self.config.missing_streams)
            .option("consumer", stream.consumer)
            .option("failOnDataLoss", "true" if stream.fail_on_data_loss else "false")
        )
        if self.config.cluster is not None:
            from headgate.spark.source import security_options

            reader = reader.option("cluster", str(self.config.cluster))
            for key, value in security_options(self.config.security).items():
                reader = reader.option(key, value)
        elif self.config.read_through_gateway:
            from headgate.spark.source import security_options

            reader = reader.option("gateway", self.config.gateway)
            for key, value in security_options(self.config.security).items():
                reader = reader.option(key, value)
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
            with short_jvm_errors():
                write(batch, batch_id)

        def write(batch: Any, batch_id: int) -> None:
            good, bad = parse_batch(plan, batch)
            good = transform_batch(plan, good).persist()
            rows = good.count()
            commit_batch(good, output, batch_id, stream.partition_by)
            good.unpersist()
            bad_rows = 0
            if bad is not None:
                bad = bad.persist()
                bad_rows = bad.count()
                if bad_rows:
                    commit_batch(bad, dead, batch_id, ())
                bad.unpersist()
            with pipeline._lock:
                pipeline.rows_written[stream.name] += rows
                pipeline.dead_letters[stream.name] += bad_rows
                pipeline.batches[stream.name] += 1

        writer = (
            source.writeStream.foreachBatch(write_batch)
            .option("checkpointLocation", str(self.config.checkpoint(stream.name)))
            .queryName(query_name(stream))
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

    def stop(self, *, finish_batches: float = 0.0) -> None:
        """Stop the queries; every progress event (so every release) is out first.

        ``finish_batches``: wait up to this many seconds for each query's
        running micro-batch to end, rather than interrupt it (an interrupted
        batch is not lost: the next run does it again).
        """
        import time

        deadline = time.monotonic() + finish_batches
        for query in self.queries.values():
            while time.monotonic() < deadline and query.isActive:
                if not query.status.get("isTriggerActive"):
                    break
                time.sleep(0.1)
            query.stop()
        if self._listener is not None:
            # Removing the listener drops the events still on Spark's bus,
            # among them the last batch's release.
            self.drain_progress()
            self.spark.streams.removeListener(self._listener)
            self._listener = None
        if self._gateway_releases is not None:
            self._gateway_releases.close()
