"""The commands that need the spark extra: ``run``, ``pipeline`` and ``query``.

Each checks for Spark before it imports anything of it (or of the demo), so
that an install without the extra gets one line naming what to install
(tests/test_packaging.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from headgate.cli.text import in_use
from headgate.config import ConfigError


def _require_spark(command: str) -> None:
    """Exit with one line naming the extra to install, unless Spark is installed."""
    from headgate.extras import MissingExtra, require_spark

    try:
        require_spark()
    except MissingExtra as exc:
        click.echo(f"headgate {command}: {exc}", err=True)
        sys.exit(1)


@click.command()
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=Path("headgate-demo"),
    show_default=True,
    help="Logs, checkpoints and Parquet output.",
)
@click.option("--seconds", type=float, default=20.0, show_default=True, help="Length of the load.")
@click.option(
    "--gateways",
    type=click.IntRange(min=1, max=9),
    default=1,
    show_default=True,
    help="More than 1: a fleet of that many local gateways (127.0.0.1, a generated "
    "cluster file in --data-dir), keyed producers, one Spark query per stream over "
    "every partition, and a summary per gateway and partition.",
)
def run(data_dir: Path, seconds: float, gateways: int) -> None:
    """The main job: gateway, demo load and Spark pipeline, on embedded defaults.

    One producer connection sends stock ticks, RADIUS-style accounting events
    and audit events on three streams. The audit stream's transform is
    deliberately slow: watch it being throttled while the others run at full
    speed. Ends with a summary and a query over the Parquet output.
    """
    _require_spark("run")
    from rich.console import Console

    from headgate.cli.demo import run_demo
    from headgate.log.lock import DirectoryInUse

    if seconds <= 0:
        raise click.UsageError("--seconds must be positive")
    try:
        result = run_demo(data_dir, seconds, Console(), gateways=gateways)
    except DirectoryInUse as exc:
        click.echo(f"headgate run: {in_use(exc)}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:  # a second Ctrl-C, while stopping
        click.echo("headgate run: interrupted", err=True)
        sys.exit(130)
    if result.failure is not None:
        click.echo(f"headgate run: {result.failure}", err=True)
        sys.exit(1)
    if result.interrupted:
        sys.exit(130)
    lost = [s.stream for s in result.summaries if s.acked > s.written + s.dead_letters]
    if lost:
        click.echo(
            f"headgate run: records acknowledged but not written: {', '.join(lost)}", err=True
        )
        sys.exit(1)


@click.command(name="pipeline")
@click.argument("config", type=click.Path(path_type=Path))
@click.option(
    "--available-now",
    "--once",
    "available_now",
    is_flag=True,
    help="Process what the logs hold now, in as many micro-batches as the "
    "read limits ask, then stop (Trigger.AvailableNow).",
)
def pipeline_command(config: Path, available_now: bool) -> None:
    """Run the Spark pipeline that CONFIG (a TOML file) describes.

    One Structured Streaming query per stream reads the gateway's log,
    parses each value (json or csv with a DDL schema, or raw bytes), applies
    an optional SQL transform over a view named after the stream, and writes
    Parquet exactly once. Records that do not parse go to
    <output_dir>/_dead_letters/<stream>. After each committed micro-batch the
    gateway is told the committed position, which becomes credit for that
    stream's producers. Runs until Ctrl-C or SIGTERM, or with --available-now
    until the data there now is written. Example CONFIG:

    \b
        data_dir = "headgate-data"    # the gateway's data directory
        gateway = "127.0.0.1:7878"    # releases go here (or "unix:/path.sock")
        [streams.ticks]
        format = "json"
        schema = "symbol STRING, price DOUBLE"
        transform = "SELECT * FROM ticks WHERE price > 0"
        partition_by = ["symbol"]
        max_records_per_trigger = 100000
        [streams.radius]
        format = "csv"
        schema = "user STRING, octets BIGINT"
        options = { sep = ";" }

    examples/pipeline.toml in the repository lists every key.
    """
    _require_spark("pipeline")
    from headgate.spark.command import run_pipeline_file

    try:
        status = run_pipeline_file(config, available_now=available_now, echo=click.echo)
    except ConfigError as exc:
        click.echo(f"headgate pipeline: {exc}", err=True)
        sys.exit(2)
    sys.exit(status)


@click.command()
@click.argument("sql")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=Path("headgate-data"),
    show_default=True,
    help="Where the pipeline wrote Parquet (<data-dir>/parquet/<stream>).",
)
def query(sql: str, data_dir: Path) -> None:
    """Run SQL over the Parquet output; each stream is a table of its name."""
    _require_spark("query")
    from headgate.spark.query import QueryError, parquet_tables, run_query

    try:
        parquet_tables(data_dir)  # before Spark starts: a wrong --data-dir is said at once
    except QueryError as exc:
        click.echo(f"headgate query: {exc}", err=True)
        sys.exit(2)
    from headgate.spark.pipeline import spark_session

    spark = spark_session("headgate-query")
    try:
        run_query(spark, sql, data_dir)
    except QueryError as exc:
        click.echo(f"headgate query: {exc}", err=True)
        sys.exit(2)
    finally:
        spark.stop()
