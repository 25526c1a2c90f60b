"""The ``headgate`` command."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

from headgate.config import ConfigError, load_gateway_config, parse_address, parse_size
from headgate.protocol.messages import is_valid_name


def _size(value: str | None, what: str) -> int | None:
    return None if value is None else parse_size(value, what=what)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """headgate: flow-controlled ingestion into Spark.

    Producers push records to a gateway over one connection each, on many
    named streams. The gateway stores each stream in a durable log; a Spark
    pipeline reads the logs and writes Parquet. A stream that Spark falls
    behind on slows only its own producers.
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("-c", "--config", type=click.Path(path_type=Path), help="TOML configuration file.")
@click.option("--listen", help="TCP address host:port (default 127.0.0.1:7878; port 0 = any).")
@click.option("--unix-socket", type=click.Path(path_type=Path), help="Also listen on this path.")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Where stream logs live.")
@click.option("--stream-capacity", help="Log capacity per stream, e.g. 64MiB.")
@click.option("--term-length", help="Term file size, a power of two, e.g. 16MiB.")
@click.option("--group-commit-ms", type=float, help="Group commit interval in milliseconds.")
def serve(
    config: Path | None,
    listen: str | None,
    unix_socket: Path | None,
    data_dir: Path | None,
    stream_capacity: str | None,
    term_length: str | None,
    group_commit_ms: float | None,
) -> None:
    """Run the gateway until SIGTERM or Ctrl-C, then flush, sync and exit.

    Settings come from the embedded defaults, then --config, then flags.
    """
    try:
        cfg = load_gateway_config(
            config,
            listen=None if listen is None else parse_address(listen),
            unix_socket=unix_socket,
            data_dir=data_dir,
            stream_capacity=_size(stream_capacity, "--stream-capacity"),
            term_length=_size(term_length, "--term-length"),
            group_commit_interval_ms=group_commit_ms,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    asyncio.run(_serve(cfg))


async def _serve(cfg: object) -> None:
    from headgate.config import GatewayConfig
    from headgate.gateway import Gateway
    from headgate.log import LogError

    assert isinstance(cfg, GatewayConfig)
    gateway = Gateway(cfg)
    try:
        await gateway.start()
    except (LogError, OSError) as exc:
        click.echo(f"headgate serve: cannot start: {exc}", err=True)
        sys.exit(1)
    host, port = gateway.address
    click.echo(f"listening on {host}:{port}", nl=True)
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gateway.stop()
    click.echo("gateway stopped cleanly", err=True)


@main.command()
@click.argument("stream")
@click.argument("source", type=click.File("rb"), default="-")
@click.option("--gateway", default="127.0.0.1:7878", show_default=True, help="host:port.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "raw"]),
    default="raw",
    show_default=True,
    help="jsonl: each line must be a JSON value (bad lines are reported, not sent).",
)
@click.option("--policy", type=click.Choice(["wait", "optimistic"]), default="wait")
@click.option("--producer-id", type=int, help="Reuse an id to resume after a crash.")
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to keep trying to reach the gateway before giving up.",
)
def send(
    stream: str,
    source: Any,
    gateway: str,
    fmt: str,
    policy: str,
    producer_id: int | None,
    timeout: float,
) -> None:
    """Send the lines of SOURCE (a file, or - for stdin) as records of STREAM.

    Each line (without its newline) is one record. Shows progress while it
    sends and reports the records and bytes the gateway acknowledged durable.
    """
    from headgate.client import ProducerError

    if not is_valid_name(stream):
        raise click.UsageError(
            f"{stream!r} is not a stream name: letters, digits, '.', '_' and '-', "
            "up to 255, starting with a letter or digit"
        )
    try:
        sent, acked, nbytes, bad = asyncio.run(
            _send(stream, source, gateway, fmt, policy, producer_id, timeout)
        )
    except ProducerError as exc:
        click.echo(f"headgate send: {exc}", err=True)
        sys.exit(1)
    click.echo(f"{acked:,} records ({nbytes:,} bytes) acknowledged durable on {stream}")
    if acked != sent:
        click.echo(f"only {acked:,} of {sent:,} records were acknowledged", err=True)
        sys.exit(1)
    if bad:
        click.echo(f"{bad:,} lines were not valid JSON and were not sent", err=True)
        sys.exit(2)


@main.command()
@click.argument("stream")
@click.option("--gateway", default="127.0.0.1:7878", show_default=True, help="host:port.")
@click.option(
    "--from",
    "start",
    default="now",
    show_default=True,
    help="now (new records only), earliest, or a log position to start at.",
)
@click.option("--sample", type=click.IntRange(min=1), default=1, help="Show one batch in N.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["raw", "json"]),
    default="raw",
    show_default=True,
    help="raw: one value per line; json: one object per record, with its position.",
)
@click.option("--count", type=click.IntRange(min=1), help="Stop after this many records.")
def tail(stream: str, gateway: str, start: str, sample: int, fmt: str, count: int | None) -> None:
    """Print records of STREAM as the gateway appends them.

    The tail never slows the producers: when it cannot keep up, the gateway
    skips batches and the tail says how many it missed (on stderr, or as
    {"missed_batches": N} lines with --format json).
    """
    from headgate.client.reader import ReaderError
    from headgate.tail import TailOptions, parse_start, run_tail

    if not is_valid_name(stream):
        raise click.UsageError(f"{stream!r} is not a stream name")
    try:
        options = TailOptions(gateway, stream, parse_start(start), sample, fmt, count)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        asyncio.run(run_tail(options, sys.stdout.buffer))
    except ReaderError as exc:
        click.echo(f"headgate tail: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # The reader of our output went away (| head): stop quietly, and keep
        # Python from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


async def _send(
    stream: str,
    source: Any,
    gateway: str,
    fmt: str,
    policy: str,
    producer_id: int | None,
    timeout: float,
) -> tuple[int, int, int, int]:
    import json

    from rich.progress import Progress

    from headgate.client import Producer

    sent = bad = 0
    async with Producer(
        gateway,
        policy="optimistic" if policy == "optimistic" else "wait",
        producer_id=producer_id,
        client_name="headgate-send",
        reconnect_timeout=timeout,
    ) as producer:
        with Progress(transient=True) as progress:
            task = progress.add_task(f"sending to {stream}", total=None)
            for line in source:
                value = line.rstrip(b"\r\n")
                if fmt == "jsonl":
                    try:
                        json.loads(value)
                    except ValueError:
                        bad += 1
                        continue
                await producer.send(stream, value)
                sent += 1
                if sent % 10_000 == 0:
                    progress.update(task, completed=sent)
            progress.update(task, description="waiting for durable acks")
            await producer.flush()
        stats = producer.statistics().streams.get(stream)
        acked = stats.records_acked if stats is not None else 0
        nbytes = stats.bytes_acked if stats is not None else 0
    return sent, acked, nbytes, bad


@main.command()
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=Path("headgate-data"),
    show_default=True,
    help="Logs, checkpoints and Parquet output.",
)
@click.option("--seconds", type=float, default=20.0, show_default=True, help="Length of the load.")
def run(data_dir: Path, seconds: float) -> None:
    """The main job: gateway, demo load and Spark pipeline, on embedded defaults.

    One producer connection sends stock ticks, RADIUS-style accounting events
    and audit events on three streams. The audit stream's transform is
    deliberately slow: watch it being throttled while the others run at full
    speed. Ends with a summary and a query over the Parquet output.
    """
    from rich.console import Console

    from headgate.demo import run_demo

    if seconds <= 0:
        raise click.UsageError("--seconds must be positive")
    summaries = run_demo(data_dir, seconds, Console())
    lost = [s.stream for s in summaries if s.acked != s.written + s.dead_letters]
    if lost:
        click.echo(f"records acknowledged but not written: {', '.join(lost)}", err=True)
        sys.exit(1)


@main.command()
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
    from headgate.spark.pipeline import spark_session

    root = data_dir / "parquet"
    tables = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    if not tables:
        raise click.UsageError(f"no Parquet datasets under {root}; run the pipeline first")
    spark = spark_session("headgate-query")
    try:
        for table in tables:
            spark.read.parquet(str(table)).createOrReplaceTempView(table.name)
        try:
            frame = spark.sql(sql)
        except Exception as exc:  # Spark's analysis errors: show them plainly
            raise click.UsageError(f"query failed: {str(exc).splitlines()[0]}") from None
        frame.show(50, truncate=False)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
