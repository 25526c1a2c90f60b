"""``headgate pipeline CONFIG.toml``: the pipeline as a command of its own.

It runs next to a gateway (``headgate serve``), reads the gateway's logs and
writes Parquet, one Structured Streaming query per stream, as the TOML file
describes (:mod:`headgate.spark.pipeline_config`). After each committed micro-batch
it sends the gateway a Release over its own connection
(:class:`~headgate.spark.releases.GatewayReleases`), which turns into credit
for the stream's producers. Each stream's releases name its consumer,
declared on the gateway before Spark starts (:func:`~headgate.spark.releases.declare_consumers`).

The order of the checks is the user's order of mistakes: the file's structure
first, without starting Spark; then the data directory; then schemas, SQL and
partition columns with Spark's analyser, before any query starts.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from headgate.client.security import SecurityError
from headgate.config import ConfigError
from headgate.spark.pipeline import (
    GatewayReleases,
    Pipeline,
    PipelineConfig,
    check_definitions,
    declare_consumers,
    error_text,
    load_pipeline_config,
    release_committed,
    spark_session,
)
from headgate.spark.restarts import RestartPolicy

Echo = Callable[[str], None]


def run_pipeline_file(
    path: Path,
    *,
    available_now: bool,
    echo: Echo,
    status_seconds: float = 10.0,
    stop: threading.Event | None = None,
) -> int:
    """Load ``path``, run the pipeline (see :func:`run_pipeline`), return the exit status.

    Raises:
        ConfigError: anything wrong in the file, or a data directory that
            is not there; the message names the file and the key.
    """
    config = load_pipeline_config(path)
    try:
        config.security.token_bytes()  # an unset variable or unreadable file: say so now
    except SecurityError as exc:
        raise ConfigError(f"{config.origin}: {exc}") from None
    reads_locally = not config.read_through_gateway and config.cluster is None
    if reads_locally and not config.data_dir.is_dir():
        raise ConfigError(
            f"{config.origin}: data_dir {config.data_dir} does not exist; it must be the "
            "gateway's data directory (headgate serve --data-dir)"
        )
    return run_pipeline(
        config,
        available_now=available_now,
        echo=echo,
        status_seconds=status_seconds,
        stop=stop,
    )


def run_pipeline(
    config: PipelineConfig,
    *,
    available_now: bool,
    echo: Echo,
    status_seconds: float = 10.0,
    stop: threading.Event | None = None,
    restarts: RestartPolicy | None = None,
) -> int:
    """Run the configured queries until they are done (``available_now``) or stopped.

    ``stop``: set it to stop (SIGTERM and Ctrl-C set it too, in the main thread).
    ``restarts``: when a failed query starts again from its checkpoint, and
    when the pipeline exits instead (:class:`RestartPolicy`'s defaults).
    """
    from pyspark import SparkContext

    # A session that already runs in this process (a notebook, the tests) is
    # reused and left running; one started here is stopped here.
    check_definitions(config, write_new=False)  # Pipeline.start records them
    remote = config.gateway is not None or config.cluster is not None
    if remote:
        # Each query's consumer must hold the log before its first batch;
        # a token that may not declare it fails here, in one line.
        declare_consumers(config)
    client = GatewayReleases(config) if remote else None
    if client is not None:
        # Before Spark starts: the last release before a kill may be lost.
        release_committed(config, client.release)
    owned = SparkContext._active_spark_context is None
    echo("starting Spark ..." if owned else "using the running Spark session")
    local_dir = config.spark_local_dir() if owned else None
    if local_dir is not None:
        _empty_scratch(local_dir)
    spark = spark_session("headgate-pipeline", local_dir=local_dir)
    pipeline = Pipeline(spark, config, release=client.release if client is not None else None)
    status = 0
    try:
        try:
            pipeline.start(available_now=available_now)
        except ConfigError:
            raise
        except Exception as exc:  # Spark refused a query: say why in one line
            echo(f"headgate pipeline: cannot start the queries: {error_text(exc)}")
            return 1
        where = (
            f"the fleet of cluster file {config.cluster}"
            if config.cluster is not None
            else config.gateway
            if config.read_through_gateway
            else config.data_dir
        )
        echo(
            f"reading {', '.join(s.name for s in config.streams)} from {where}"
            + ("" if client is None else f"; releases go to {client.address}")
            + ("; until all available data is processed" if available_now else "")
        )
        stop = stop if stop is not None else threading.Event()
        with _stop_on_signals(stop):
            failure = _wait(
                pipeline, available_now, echo, status_seconds, stop, restarts or RestartPolicy()
            )
        if stop.is_set():
            echo("stopping: letting the running micro-batches finish (up to 60 s) ...")
        elif failure is not None:
            echo(f"headgate pipeline: {failure}")
            status = 1
    finally:
        with contextlib.suppress(Exception):
            # Waits for the last progress (and release) to be out.
            pipeline.stop(finish_batches=60.0)
        confirmed = client.close(10.0) if client is not None else True
        if pipeline.queries:
            _summary(pipeline, config, client, echo)
        if client is not None and not confirmed:
            echo(
                f"warning: the gateway at {client.address} did not confirm every release; "
                "the next run sends them again"
            )
        if owned:
            spark.stop()
    return status


def _wait(
    pipeline: Pipeline,
    available_now: bool,
    echo: Echo,
    every: float,
    stop: threading.Event,
    restarts: RestartPolicy,
) -> str | None:
    """Wait for the queries (or ``stop``); restart failed ones; return why one failed for good."""
    last = time.monotonic()
    due: dict[str, float] = {}  # stream -> when its failed query starts again
    while not stop.is_set():
        now = time.monotonic()
        for name, when in list(due.items()):
            if when > now:
                continue
            del due[name]
            try:
                pipeline.restart_query(name)
            except Exception as exc:  # Spark refused it: a failure like any other
                failure = _failed(name, error_text(exc), restarts, due, echo)
                if failure is not None:
                    return failure
        running = len(due)  # waiting to start again
        for name, query in pipeline.queries.items():
            if name in due:
                continue
            if query.isActive:
                running += 1
                continue
            error = query.exception()
            if error is not None:
                failure = _failed(name, error_text(error), restarts, due, echo)
                if failure is not None:
                    return failure
                running += 1
        if running == 0:
            if not available_now:
                return "every query stopped"
            return None
        if not available_now and time.monotonic() - last >= every:
            last = time.monotonic()
            echo(_status_line(pipeline))
        # Wakes for a query's end at once; bounded so that signals get handled.
        with contextlib.suppress(Exception):
            pipeline.spark.streams.awaitAnyTermination(0.5)
        pipeline.spark.streams.resetTerminated()
    return None


def _failed(
    name: str, error: str, restarts: RestartPolicy, due: dict[str, float], echo: Echo
) -> str | None:
    """Schedule a failed query's restart with a one-line warning, or return the final failure."""
    delay = restarts.failed(name, time.monotonic())
    if delay is None:
        return (
            f"the query of stream {name} failed: {error} "
            f"({restarts.max_restarts} restarts within {restarts.window:.0f} s did not help)"
        )
    echo(
        f"warning: the query of stream {name} failed: {error}; restarting it from its "
        f"checkpoint in {delay:g} s ({restarts.recent(name)} of {restarts.max_restarts} "
        f"restarts within {restarts.window:.0f} s)"
    )
    due[name] = time.monotonic() + delay
    return None


def _empty_scratch(local_dir: Path) -> None:
    """Remove what an earlier run's Spark left in ``local_dir`` (killed drivers never do)."""
    if local_dir.is_dir():
        for entry in local_dir.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
    local_dir.mkdir(parents=True, exist_ok=True)


def _status_line(pipeline: Pipeline) -> str:
    parts = []
    for name in pipeline.queries:
        line = (
            f"{name}: {pipeline.batches[name]} batches, {pipeline.rows_written[name]:,} rows, "
            f"{pipeline.dead_letters[name]:,} dead"
        )
        figures = pipeline.consumer_progress.get(name)
        if figures is not None:
            line += f", consumer {figures.consumer} {figures.lag_bytes:,} bytes"
            if figures.lag_records is not None:
                line += f" ({figures.lag_records:,} records)"
            line += " behind"
            if figures.skipped_bytes:
                line += f" ({figures.skipped_bytes:,} bytes"
                if figures.skipped_records is not None:
                    line += f", {figures.skipped_records:,} records"
                line += " skipped: freed unread)"
        parts.append(line)
    return " | ".join(parts)


def _summary(
    pipeline: Pipeline, config: PipelineConfig, client: GatewayReleases | None, echo: Echo
) -> None:
    applied = client.applied() if client is not None else {}
    for name in pipeline.queries:
        committed = pipeline.committed.get(name)
        line = (
            f"{name}: {pipeline.batches[name]} batches, {pipeline.rows_written[name]:,} rows "
            f"to {config.output(name)}, {pipeline.dead_letters[name]:,} dead letters"
        )
        if committed is None and pipeline.batches[name]:
            line += ", progress not reported (nothing released)"
        elif committed is not None:
            line += f", committed up to position {committed:,}"
            if client is not None:
                released = applied.get(name)
                line += ", released" if released == committed else ", release not confirmed"
        echo(line)


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Let SIGTERM and SIGINT set ``stop`` (main thread only).

    Only a flag: an exception raised inside a py4j call would leave its
    connection to the JVM half-read, and nothing could stop the queries.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
