"""The ``headgate`` command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from headgate.config import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    GROUP_COMMIT_MODES,
    ConfigError,
    load_gateway_config,
    parse_address,
    parse_size,
)
from headgate.logformat import LOG_FORMATS, TEXT_FORMAT, use_log_format
from headgate.protocol.messages import MAX_SECRET_BYTES, is_valid_name

if TYPE_CHECKING:
    from headgate.client.security import ClientSecurity
    from headgate.log.lock import DirectoryInUse

F = TypeVar("F", bound=Callable[..., Any])

_SECURITY_OPTIONS = ("token", "tls", "ca_file", "cert", "key", "server_name")


#: Where a client command finds the gateway (send, tail).
_gateway_option = click.option(
    "--gateway",
    default=f"127.0.0.1:{DEFAULT_PORT}",
    show_default=True,
    help="host:port, or unix:PATH for the gateway's Unix socket.",
)


def _security_options(command: F) -> F:
    """The token and TLS options every client command takes (send, tail)."""
    file = click.Path(exists=True, dir_okay=False, path_type=Path)
    for option in reversed(
        (
            click.option(
                "--token",
                envvar="HEADGATE_TOKEN",
                help="Authentication token (or set HEADGATE_TOKEN, which keeps it out of `ps`).",
            ),
            click.option(
                "--tls", is_flag=True, help="Use TLS; the gateway's certificate is verified."
            ),
            click.option(
                "--ca-file",
                type=file,
                help="CA bundle to verify the gateway with (implies --tls; default: the system's).",
            ),
            click.option(
                "--cert", type=file, help="Client certificate for mutual TLS (implies --tls)."
            ),
            click.option("--key", type=file, help="Its key."),
            click.option(
                "--server-name", help="Name the gateway's certificate must carry (default: host)."
            ),
        )
    ):
        command = option(command)
    return command


def _security(options: dict[str, Any]) -> ClientSecurity:
    """The :class:`ClientSecurity` of the options ``_security_options`` added; usage errors."""
    from headgate.client.security import ClientSecurity, SecurityError

    values = {name: options.pop(name) for name in _SECURITY_OPTIONS}
    token = values["token"]
    try:
        security = ClientSecurity(
            token=token.encode() if token else None,
            tls=values["tls"],
            ca_file=None if values["ca_file"] is None else str(values["ca_file"]),
            cert_file=None if values["cert"] is None else str(values["cert"]),
            key_file=None if values["key"] is None else str(values["key"]),
            server_name=values["server_name"],
        )
        security.ssl_context()  # files that cannot be loaded are usage errors
    except SecurityError as exc:
        message = str(exc).replace(
            "a client key needs its certificate (cert_file)", "--key needs --cert"
        )
        raise click.UsageError(message) from None
    return security


def _require_spark(command: str) -> None:
    """Exit with one line naming the extra to install, unless Spark is installed."""
    from headgate.extras import MissingExtra, require_spark

    try:
        require_spark()
    except MissingExtra as exc:
        click.echo(f"headgate {command}: {exc}", err=True)
        sys.exit(1)


def _size(value: str | None, what: str) -> int | None:
    return None if value is None else parse_size(value, what=what)


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: the version is looked up only here (see ``headgate.__version__``)."""
    if not value or ctx.resilient_parsing:
        return
    from headgate import __version__

    click.echo(f"headgate {__version__}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-V",
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_version,
    help="Show the version and exit.",
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """headgate: flow-controlled ingestion into Spark.

    Producers push records to a gateway over one connection each, on many
    named streams. The gateway stores each stream in a durable log; a Spark
    pipeline reads the logs and writes Parquet. A stream that Spark falls
    behind on slows only its own producers.
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format=TEXT_FORMAT)


#: What `headgate serve` itself says while it runs (reloads, the clean stop):
#: shown at the default verbosity, in the format --log-format picks.
serve_log = logging.getLogger("headgate.serve")


@main.command()
@click.option("-c", "--config", type=click.Path(path_type=Path), help="TOML configuration file.")
@click.option("--listen", help="TCP address host:port (default 127.0.0.1:7878; port 0 = any).")
@click.option(
    "--unix-socket",
    type=click.Path(path_type=Path),
    help="Also listen on this Unix socket (clients connect to unix:PATH).",
)
@click.option("--data-dir", type=click.Path(path_type=Path), help="Where stream logs live.")
@click.option("--stream-capacity", help="Log capacity per stream, e.g. 64MiB.")
@click.option("--term-length", help="Term file size, a power of two, e.g. 16MiB.")
@click.option("--group-commit-ms", type=float, help="Group commit interval in milliseconds.")
@click.option(
    "--group-commit-mode",
    type=click.Choice(GROUP_COMMIT_MODES),
    help="interval (default): commit every --group-commit-ms; eager: as soon as the "
    "commit before is done and something waits (lower ack latency, more fsyncs).",
)
@click.option(
    "--metrics",
    metavar="HOST:PORT",
    help=f"Serve Prometheus metrics at http://HOST:PORT/metrics (off unless given; "
    f"default port {DEFAULT_METRICS_PORT}).",
)
@click.option(
    "--policy",
    type=click.Choice(["credit", "window", "xonxoff"]),
    help="Default flow-control policy of a stream (default credit).",
)
@click.option("--window", type=click.IntRange(min=1), help="Window policy: batches in flight.")
@click.option(
    "--stream-policy",
    "stream_policies",
    multiple=True,
    metavar="STREAM=POLICY",
    help="Policy of one stream, e.g. ticks=window (repeatable).",
)
@click.option("--tls-cert", type=click.Path(path_type=Path), help="TLS certificate chain (PEM).")
@click.option("--tls-key", type=click.Path(path_type=Path), help="TLS private key (PEM).")
@click.option(
    "--tls-client-ca",
    type=click.Path(path_type=Path),
    help="Require client certificates signed by this CA (mutual TLS).",
)
@click.option(
    "--auth-file",
    type=click.Path(path_type=Path),
    help="Tokens file: require a token in Hello (see `headgate token`).",
)
@click.option("--idle-timeout-ms", type=int, help="Close connections silent this long (0: never).")
@click.option("--handshake-timeout-ms", type=float, help="Time a peer has to send Hello.")
@click.option("--max-connections", type=int, help="Largest number of concurrent connections.")
@click.option(
    "--cluster",
    type=click.Path(path_type=Path),
    help="Cluster file of a fleet of gateways: serve the partitions it assigns to --name.",
)
@click.option("--name", "cluster_name", help="This gateway's name in the --cluster file.")
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    envvar="HEADGATE_LOG_FORMAT",
    help="json: one JSON object per log line (time, level, logger, message, extra fields); "
    "or set HEADGATE_LOG_FORMAT.",
)
def serve(
    config: Path | None,
    listen: str | None,
    unix_socket: Path | None,
    data_dir: Path | None,
    stream_capacity: str | None,
    term_length: str | None,
    group_commit_ms: float | None,
    group_commit_mode: str | None,
    metrics: str | None,
    policy: str | None,
    window: int | None,
    stream_policies: tuple[str, ...],
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    auth_file: Path | None,
    idle_timeout_ms: int | None,
    handshake_timeout_ms: float | None,
    max_connections: int | None,
    cluster: Path | None,
    cluster_name: str | None,
    log_format: str,
) -> None:
    """Run the gateway until SIGTERM or Ctrl-C, then flush, sync and exit.

    Settings come from the embedded defaults, then --config, then flags.
    On SIGHUP the gateway reads --config again (flags still win) and applies
    what can change while it runs: stream capacities, windows, watermarks.
    """
    use_log_format(log_format)
    if serve_log.getEffectiveLevel() > logging.INFO:
        serve_log.setLevel(logging.INFO)
    per_stream: dict[str, str] = {}
    for item in stream_policies:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.UsageError(f"--stream-policy: expected STREAM=POLICY, got {item!r}")
        per_stream[name] = value

    def load() -> object:
        return load_gateway_config(
            config,
            listen=None if listen is None else parse_address(listen),
            unix_socket=unix_socket,
            data_dir=data_dir,
            stream_capacity=_size(stream_capacity, "--stream-capacity"),
            term_length=_size(term_length, "--term-length"),
            group_commit_interval_ms=group_commit_ms,
            group_commit_mode=group_commit_mode,
            metrics=None
            if metrics is None
            else parse_address(metrics, what="--metrics", default_port=DEFAULT_METRICS_PORT),
            policy=policy,
            window=window,
            stream_policies=per_stream,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_client_ca=tls_client_ca,
            auth_file=auth_file,
            idle_timeout_ms=idle_timeout_ms,
            handshake_timeout_ms=handshake_timeout_ms,
            max_connections=max_connections,
            cluster=cluster,
            cluster_name=cluster_name,
        )

    try:
        cfg = load()
    except ConfigError as exc:
        # One line: the file (or flag), the key, and how to fix it.
        click.echo(f"headgate serve: {exc}", err=True)
        sys.exit(2)
    asyncio.run(_serve(cfg, load))


def _reload(gateway: object, load: Callable[[], object]) -> None:
    from headgate.config import GatewayConfig
    from headgate.gateway import Gateway
    from headgate.log import LogError

    assert isinstance(gateway, Gateway)
    try:
        cfg = load()
        assert isinstance(cfg, GatewayConfig)
        gateway.reconfigure(cfg)
    except (ConfigError, LogError, click.UsageError) as exc:
        # A bad edit must not take the running gateway down. One line, in the
        # log's format: an operator (or a log shipper) sees it once.
        serve_log.error("reload refused, keeping the old settings: %s", exc)
        return
    serve_log.info("configuration reloaded")


def _in_use(exc: DirectoryInUse) -> str:
    """The one line that says a data directory has its gateway already, and what to do."""
    holder = "another gateway" if exc.pid is None else f"another gateway (pid {exc.pid})"
    return (
        f"the data directory {exc.directory} is in use by {holder}; "
        "stop it or choose another --data-dir"
    )


async def _serve(cfg: object, load: Callable[[], object] | None = None) -> None:
    from headgate.config import GatewayConfig
    from headgate.gateway import Gateway
    from headgate.gateway.server import AddressInUse
    from headgate.log import LogError
    from headgate.log.lock import DirectoryInUse

    assert isinstance(cfg, GatewayConfig)
    try:
        gateway = Gateway(cfg)
    except ConfigError as exc:
        click.echo(f"headgate serve: {exc}", err=True)
        sys.exit(2)
    try:
        # Listening first: the streams on disk are recovered after this, in
        # the background (a bind of one still recovering is told to retry).
        await gateway.listen()
    except DirectoryInUse as exc:
        click.echo(f"headgate serve: {_in_use(exc)}", err=True)
        sys.exit(1)
    except AddressInUse as exc:
        click.echo(f"headgate serve: {exc.address} is already in use", err=True)
        sys.exit(1)
    except (LogError, OSError) as exc:
        click.echo(f"headgate serve: cannot start: {exc}", err=True)
        sys.exit(1)
    # Before "listening on": whoever waits for that line may signal at once
    # (a SIGHUP before its handler would end the process).
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if load is not None:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, _reload, gateway, load)
    host, port = gateway.address
    click.echo(f"listening on {host}:{port}", nl=True)
    if gateway.metrics_address is not None:
        click.echo("metrics on http://{}:{}/metrics".format(*gateway.metrics_address))
    if cfg.unix_socket is not None:
        click.echo(f"listening on unix:{cfg.unix_socket}")
    sys.stdout.flush()
    recovered = asyncio.ensure_future(gateway.recovered())

    def say_recovered(done: asyncio.Future[None]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        if gateway.recovery_seconds is not None:
            serve_log.info(
                "recovered %d streams in %.3f s", gateway.recovery.done, gateway.recovery_seconds
            )

    recovered.add_done_callback(say_recovered)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({recovered, stopped}, return_when=asyncio.FIRST_COMPLETED)
    failure = recovered.exception() if recovered.done() else None
    if failure is None:
        await stopped
    stopped.cancel()
    recovered.cancel()
    await gateway.stop()
    if failure is not None:
        # As when the gateway recovered its streams before listening: a log
        # it cannot recover ends the start (the text names the file).
        click.echo(f"headgate serve: cannot start: {failure}", err=True)
        sys.exit(1)
    serve_log.info("gateway stopped cleanly")


@main.command()
@click.argument("stream")
@click.argument("source", type=click.File("rb"), default="-")
@_gateway_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "raw"]),
    default="raw",
    show_default=True,
    help="jsonl: each line must be a JSON value (bad lines are reported, not sent).",
)
@click.option(
    "--policy",
    type=click.Choice(["wait", "optimistic", "window"]),
    default="wait",
    show_default=True,
    help="window: for streams with the gateway's window policy (one batch per slot).",
)
@click.option("--producer-id", type=int, help="Reuse an id to resume after a crash.")
@click.option(
    "--producer-secret",
    help="With --producer-id, the hex secret that proves the id is ours (without tokens); "
    "printed when a send without tokens ends.",
)
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to keep trying to reach the gateway before giving up.",
)
@click.option(
    "--spool",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep unacknowledged records in this directory, so that a send cut short "
    "(Ctrl-C, a crash, a gateway away past --timeout) is resumed by the next send "
    "with the same --spool, each record stored once; the input goes on from the line "
    "it reports.",
)
@click.option(
    "--cluster",
    type=click.Path(path_type=Path),
    help="STREAM is partitioned over this cluster file's gateways (--gateway is not "
    "used): lines go to sticky partitions, round robin among the gateways that are up; "
    "--timeout bounds how long they wait for a gateway that is down.",
)
@_security_options
def send(
    stream: str,
    source: Any,
    gateway: str,
    fmt: str,
    policy: str,
    producer_id: int | None,
    producer_secret: str | None,
    timeout: float,
    spool: Path | None,
    cluster: Path | None,
    **options: Any,
) -> None:
    """Send the lines of SOURCE (a file, or - for stdin) as records of STREAM.

    Each line (without its newline) is one record. Shows progress while it
    sends and reports the records and bytes the gateway acknowledged durable.
    On Ctrl-C it reports what was acknowledged, the input line to go on
    from, and the producer id to go on with (exit status 130).
    """
    from headgate.cli.send import SendOptions, run_send
    from headgate.client import GatewayAddress, ProducerError, SpoolError
    from headgate.cluster import ClusterError, load_cluster

    try:
        GatewayAddress.parse(gateway, what="--gateway")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    loaded = None
    if cluster is not None:
        if producer_secret is not None:
            raise click.UsageError(
                "--producer-secret does not go with --cluster: each gateway of a fleet keeps "
                "its own secret (resume a fleet send with --spool)"
            )
        try:
            loaded = load_cluster(cluster)
            loaded.stream(stream)
        except ClusterError as exc:
            click.echo(f"headgate send: {exc}", err=True)
            sys.exit(2)
    if not is_valid_name(stream):
        raise click.UsageError(
            f"{stream!r} is not a stream name: letters, digits, '.', '_' and '-', "
            "up to 255, starting with a letter or digit"
        )
    secret = None
    if producer_secret is not None:
        if producer_id is None:
            raise click.UsageError("--producer-secret goes with the --producer-id it proves")
        try:
            secret = bytes.fromhex(producer_secret)
        except ValueError:
            raise click.UsageError("--producer-secret must be hex digits") from None
        if not 1 <= len(secret) <= MAX_SECRET_BYTES:
            raise click.UsageError(f"--producer-secret must be 1 to {MAX_SECRET_BYTES} bytes")
    security = _security(options)
    send_options = SendOptions(
        gateway,
        stream,
        fmt,
        policy,
        producer_id,
        secret,
        timeout,
        security=security,
        spool=spool,
        cluster=loaded,
    )
    try:
        report = asyncio.run(run_send(send_options, source))
    except ProducerError as exc:
        click.echo(f"headgate send: {exc}", err=True)
        sys.exit(1)
    except (SpoolError, ValueError) as exc:
        click.echo(f"headgate send: {exc}", err=True)
        sys.exit(1)
    if report.interrupted:
        click.echo(f"headgate send: {report.interrupted_message()}", err=True)
    else:
        where = f"{stream} ({report.gateway})" if loaded is not None else stream
        click.echo(
            f"{report.acked:,} records ({report.bytes_acked:,} bytes) "
            f"acknowledged durable on {where}"
        )
    if bad_lines := report.bad_lines_message():
        click.echo(f"headgate send: {bad_lines}", err=True)
    if report.producer_secret is not None or (report.interrupted and report.transmitted):
        # Without tokens the id is its secret's: what resuming it takes.
        click.echo(report.resume_hint(), err=True)
    if report.interrupted:
        sys.exit(130)
    if report.acked != report.sent:
        click.echo(
            f"headgate send: only {report.acked:,} of {report.sent:,} records were acknowledged",
            err=True,
        )
        sys.exit(1)
    if report.bad_lines:
        sys.exit(2)


@main.command()
@click.argument("stream")
@_gateway_option
@click.option(
    "--from",
    "start",
    default="now",
    show_default=True,
    help="now (new records only), earliest, or a record address to start at: "
    "POSITION[:INDEX], as --format json prints them.",
)
@click.option("--sample", type=click.IntRange(min=1), default=1, help="Show one batch in N.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["raw", "json"]),
    default="raw",
    show_default=True,
    help="raw: one value per line; json: one object per record, with its address "
    "(position and index).",
)
@click.option("--count", type=click.IntRange(min=1), help="Stop after this many records.")
@click.option(
    "--cluster",
    type=click.Path(path_type=Path),
    help="STREAM is partitioned over this cluster file's gateways: follow every "
    "partition, merged (--from now or earliest).",
)
@_security_options
def tail(
    stream: str,
    gateway: str,
    start: str,
    sample: int,
    fmt: str,
    count: int | None,
    cluster: Path | None,
    **options: Any,
) -> None:
    """Print records of STREAM as the gateway appends them.

    The tail never slows the producers: when it cannot keep up, the gateway
    skips batches and the tail says how many it missed (on stderr, or as
    {"missed_batches": N} lines with --format json).
    """
    from headgate.cli.tail import TailOptions, explain, parse_start, run_tail
    from headgate.client.reader import ReaderError
    from headgate.log.address import AddressError

    if not is_valid_name(stream):
        raise click.UsageError(f"{stream!r} is not a stream name")
    security = _security(options)
    try:
        tail_options = TailOptions(
            gateway, stream, parse_start(start), sample, fmt, count, security=security
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if cluster is not None:
        _tail_cluster(cluster, tail_options)
        return
    try:
        asyncio.run(run_tail(tail_options, sys.stdout.buffer))
    except ReaderError as exc:
        click.echo(f"headgate tail: {explain(exc, tail_options)}", err=True)
        sys.exit(1)
    except AddressError as exc:
        click.echo(f"headgate tail: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # The reader of our output went away (| head): stop quietly, and keep
        # Python from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _tail_cluster(cluster: Path, options: Any) -> None:
    """``headgate tail --cluster``: every partition of the stream, merged; one line per error."""
    from headgate.cli.tail import run_cluster_tail
    from headgate.cluster import ClusterError, load_cluster
    from headgate.log.address import RecordAddress

    if isinstance(options.start, RecordAddress):
        raise click.UsageError(
            "with --cluster, --from is now or earliest (a position is a partition's)"
        )
    try:
        loaded = load_cluster(cluster)
        loaded.stream(options.stream)
    except ClusterError as exc:
        click.echo(f"headgate tail: {exc}", err=True)
        sys.exit(2)
    try:
        asyncio.run(run_cluster_tail(loaded, options.stream, options, sys.stdout.buffer))
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@main.command()
@click.option("--name", default="producer", show_default=True, help="Shown in gateway logs.")
@click.option(
    "--write", "write", multiple=True, help="Stream pattern it may write (repeatable): 'sensor-*'."
)
@click.option("--read", "read", multiple=True, help="Stream pattern it may read (repeatable).")
@click.option("--admin", is_flag=True, help="May release positions and change settings.")
def token(name: str, write: tuple[str, ...], read: tuple[str, ...], admin: bool) -> None:
    """Make a new random token and print the tokens-file entry for it.

    The token itself goes to stderr, once: give it to the producer (for
    example as HEADGATE_TOKEN). Only its SHA-256 goes to stdout, as a
    [[token]] table to append to the gateway's tokens file (--auth-file).
    """
    import json

    from headgate.gateway.auth import generate_token, hash_token

    secret = generate_token()
    click.echo(f"token (keep it secret, it is shown only now): {secret}", err=True)
    lines = [
        "[[token]]",
        f"name = {json.dumps(name)}",
        f'sha256 = "{hash_token(secret.encode())}"',
        f"write = {json.dumps(list(write))}",
        f"read = {json.dumps(list(read))}",
        f"admin = {'true' if admin else 'false'}",
    ]
    click.echo("\n".join(lines))


@main.command()
@click.option(
    "--metrics",
    "address",
    default=f"127.0.0.1:{DEFAULT_METRICS_PORT}",
    show_default=True,
    metavar="HOST:PORT",
    help="The gateway's metrics endpoint (headgate serve --metrics).",
)
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds per refresh.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="json: one JSON object per snapshot, one per line (every metric; for scripts).",
)
def top(address: str, interval: float, once: bool, fmt: str) -> None:
    """Watch a running gateway: streams and connections, live.

    Per stream: log fill, guarantees, writers, records/s, drops, the p50
    and p99 of its batches' arrival-to-durable-ack latency since the last
    refresh, fsync latency (and positions, where the terminal is wide
    enough). Per
    connection: debt against its threshold, and whether its reads are
    paused. Read from the gateway's Prometheus endpoint, which `headgate
    serve --metrics HOST:PORT` turns on.
    """
    import json

    from rich.console import Console
    from rich.live import Live

    from headgate.cli.top import MetricsUnavailable, as_json, fetch, render_to_fit

    if interval <= 0:
        raise click.UsageError("--interval must be positive")
    try:
        where = parse_address(address, what="--metrics", default_port=DEFAULT_METRICS_PORT)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    hint = "is the gateway running with --metrics {}:{}?".format(*where)
    console = Console()
    try:
        previous = fetch(where)
        if fmt == "json":
            click.echo(json.dumps(as_json(previous)))
            while not once:
                time.sleep(interval)
                snap = fetch(where)
                click.echo(json.dumps(as_json(snap, previous)))
                previous = snap
            return
        if once:
            console.print(render_to_fit(console, previous))
            return
        with Live(render_to_fit(console, previous), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                snap = fetch(where)
                live.update(render_to_fit(console, snap, previous), refresh=True)
                previous = snap
    except MetricsUnavailable as exc:
        click.echo(f"headgate top: {exc}; {hint}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


@main.command()
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
        click.echo(f"headgate run: {_in_use(exc)}", err=True)
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


class _ConsumersGroup(click.Group):
    """``headgate consumers [STREAM...]`` lists; ``reset`` and ``delete`` change one.

    A first argument that is not a subcommand (a stream name, an option, or
    nothing) goes to ``list``, so that ``headgate consumers clicks`` reads
    as it is written.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in (*self.commands, "--help", "-h"):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@main.group(cls=_ConsumersGroup)
def consumers() -> None:
    """A gateway's named consumers: list them (the default), reset or delete one."""


@consumers.command(name="list")
@click.argument("names", nargs=-1)
@_gateway_option
@_security_options
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="table, or one JSON object per consumer (for scripts).",
)
def consumers_list(names: tuple[str, ...], gateway: str, fmt: str, **options: Any) -> None:
    """The named consumers of every stream (or of the streams NAMES), with their lag.

    position: what the consumer committed; lag: the durable bytes after it,
    the records in them ("?" where the gateway cannot count them: a
    non-blocking consumer's position freed before it was counted), and the
    age of the oldest of them; blocking: whether it holds the
    producers back; state: ok, idle (blocking and not releasing past
    idle_release_seconds) or detached (made non-blocking for idling).
    """
    from headgate.cli.streams import list_consumers
    from headgate.client.reader import ReaderError

    try:
        rows = asyncio.run(list_consumers(gateway, _security(options), names))
    except (ReaderError, LookupError) as exc:
        click.echo(f"headgate consumers: {exc}", err=True)
        sys.exit(1)
    if fmt == "json":
        for row in rows:
            click.echo(json.dumps(row.as_dict()))
        return
    if not rows:
        click.echo("no consumers", err=True)
        return
    header = ("stream", "consumer", "position", "lag", "lag_records", "lag_s", "blocking", "state")
    table = [header] + [
        (
            r.stream,
            r.consumer,
            f"{r.position:,}",
            _bytes_text(r.lag_bytes),
            _count_text(r.lag_records),
            f"{r.lag_seconds:,.1f}",
            "yes" if r.blocking else f"no ({r.on_data_loss})",
            r.state,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        click.echo("  ".join(cells).rstrip())


def _count_text(count: int | None) -> str:
    """A count of records for a table; ``?`` where the gateway could not count them."""
    return "?" if count is None else f"{count:,}"


def _reset_target(text: str) -> Any:
    """``earliest``, ``latest``, a position, or an ISO time (UTC unless it says)."""
    from datetime import UTC, datetime

    from headgate.protocol import messages as m

    if text in ("earliest", "latest"):
        return m.ResetTo(text)
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: expected earliest, latest, a position, or an ISO time "
            "such as 2026-11-25T03:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return m.ResetTime(round(when.timestamp() * 1_000_000))


def _change_consumer(gateway: str, options: dict[str, Any], change: Callable[..., Any]) -> int:
    from headgate.client.reader import Reader, ReaderError

    security = _security(options)

    async def run() -> int:
        async with Reader(gateway, client_name="headgate-consumers", security=security) as r:
            return int(await change(r))

    try:
        return asyncio.run(run())
    except ReaderError as exc:
        click.echo(f"headgate consumers: {exc}", err=True)
        sys.exit(1)


@consumers.command(name="reset")
@click.argument("name")
@click.option("--stream", required=True, help="The consumer's stream.")
@click.option(
    "--to",
    "target",
    required=True,
    help="earliest, latest, a log position, or an ISO time (UTC unless it says).",
)
@_gateway_option
@_security_options
def consumers_reset(name: str, stream: str, target: str, gateway: str, **options: Any) -> None:
    """Move consumer NAME of a stream back (to replay what the log holds) or forward.

    Needs a token with the admin right. A time moves it to the first record
    stored at or after it.
    """
    to = _reset_target(target)
    position = _change_consumer(gateway, options, lambda r: r.reset_consumer(stream, name, to))
    click.echo(f"consumer {name!r} of stream {stream!r} is at {position:,}")


@consumers.command(name="delete")
@click.argument("name")
@click.option("--stream", required=True, help="The consumer's stream.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@_gateway_option
@_security_options
def consumers_delete(name: str, stream: str, yes: bool, gateway: str, **options: Any) -> None:
    """Delete consumer NAME of a stream; the log is freed of what it held (admin right)."""
    if not yes:
        click.confirm(f"delete consumer {name!r} of stream {stream!r}?", abort=True)
    position = _change_consumer(gateway, options, lambda r: r.delete_consumer(stream, name))
    click.echo(f"deleted consumer {name!r} of stream {stream!r} (it was at {position:,})")


@main.group()
def cluster() -> None:
    """A fleet of gateways (a cluster file): its state."""


@cluster.command(name="status")
@click.argument("cluster_file", type=click.Path(path_type=Path))
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds per gateway.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="table, or one JSON object per gateway and per partition.",
)
@_security_options
def cluster_status(cluster_file: Path, timeout: float, fmt: str, **options: Any) -> None:
    """Each gateway of CLUSTER_FILE up or down, and per partition its fill and consumers' lag.

    Exits 1 when a gateway is down (after showing the others).
    """
    from dataclasses import asdict

    from headgate.cli.cluster import cluster_status as ask
    from headgate.cluster import ClusterError, load_cluster, partition_name

    security = _security(options)
    try:
        loaded = load_cluster(cluster_file)
    except ClusterError as exc:
        click.echo(f"headgate cluster status: {exc}", err=True)
        sys.exit(2)
    gateways, partitions = asyncio.run(ask(loaded, security, timeout))
    if fmt == "json":
        for gateway_row in gateways:
            click.echo(json.dumps({"kind": "gateway", **asdict(gateway_row)}))
        for partition_row in partitions:
            click.echo(json.dumps({"kind": "partition", **asdict(partition_row)}))
    else:
        for g in gateways:
            state = "up" if g.up else f"DOWN: {g.error}"
            click.echo(f"{g.name:<12} {g.address:<24} {state}")
        click.echo("")
        click.echo(f"{'partition':<24} {'gateway':<12} {'retained':>12}  consumers (lag)")
        for p in partitions:
            name = partition_name(p.stream, p.partition)
            fill = "?" if p.retained_bytes is None else _bytes_text(p.retained_bytes)
            counts = p.consumer_lag_records
            lags = ", ".join(
                f"{c} ({_bytes_text(lag)}, {_count_text(counts.get(c))} records)"
                for c, lag in sorted(p.consumers.items())
            )
            click.echo(f"{name:<24} {p.gateway:<12} {fill:>12}  {lags}".rstrip())
    if not all(g.up for g in gateways):
        sys.exit(1)


@main.group()
def streams() -> None:
    """List and describe a gateway's streams; delete one from a stopped gateway's directory."""


def _print_streams(rows: list[Any], fmt: str) -> None:
    if fmt == "json":
        for row in rows:
            click.echo(json.dumps(row.as_dict()))
        return
    from headgate.cli.streams import release_phrase

    now = time.time()
    header = ("stream", "start", "durable", "tail", "retained", "released")
    table = [header] + [
        (
            r.stream,
            f"{r.start_position:,}",
            f"{r.durable_position:,}",
            f"{r.tail_position:,}",
            _bytes_text(r.retained_bytes),
            release_phrase(r.released_at_us, now),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        # Names and the release time read from the left, numbers from the right.
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)
        ]
        click.echo("  ".join([*cells, row[-1]]).rstrip())


def _bytes_text(n: int) -> str:
    """``n`` bytes for people: 512 B, 1.5 KiB, 3.0 GiB."""
    if n < 1024:
        return f"{n:,} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:,.1f} {unit}"


def _streams_from(gateway: str, names: tuple[str, ...], options: dict[str, Any]) -> list[Any]:
    from headgate.cli.streams import list_streams
    from headgate.client.reader import ReaderError

    security = _security(options)
    try:
        return asyncio.run(list_streams(gateway, security, names))
    except (ReaderError, LookupError) as exc:
        click.echo(f"headgate streams: {exc}", err=True)
        sys.exit(1)


_streams_format = click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="table, or one JSON object per stream (for scripts).",
)


@streams.command(name="list")
@_gateway_option
@_streams_format
@_security_options
def streams_list(gateway: str, fmt: str, **options: Any) -> None:
    """Every stream of the gateway, with its positions and the bytes it retains.

    start: the oldest position kept (what Spark released is gone); durable:
    what is on disk and readable; tail: where the next batch goes; released:
    when a consumer last moved start (the gateway's clock, UTC).
    """
    rows = _streams_from(gateway, (), options)
    if not rows and fmt == "table":
        click.echo("no streams", err=True)
        return
    _print_streams(rows, fmt)


@streams.command(name="describe")
@click.argument("names", nargs=-1, required=True)
@_gateway_option
@_streams_format
@_security_options
def streams_describe(names: tuple[str, ...], gateway: str, fmt: str, **options: Any) -> None:
    """The positions of the streams NAMES, and when their consumers last released
    them; an unknown name is an error."""
    rows = _streams_from(gateway, names, options)
    if fmt == "json":
        _print_streams(rows, fmt)
        return
    from headgate.cli.streams import release_phrase

    now = time.time()
    for row in rows:
        click.echo(f"{row.stream}:")
        for key, value in row.as_dict().items():
            if isinstance(value, int) and key != "released_at_us":
                click.echo(f"  {key}: {value:,}")
        click.echo(f"  released: {release_phrase(row.released_at_us, now)}")


@streams.command(name="delete")
@click.argument("name")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=Path("headgate-data"),
    show_default=True,
    help="The stopped gateway's data directory.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def streams_delete(name: str, data_dir: Path, yes: bool) -> None:
    """Delete stream NAME's log and producer state, with the gateway stopped.

    Its records are gone for good, and producers that resume on it start a
    new sequence. A Spark checkpoint that read the stream refers to
    positions of the old log: delete it (and its output, if it should go
    too) before a pipeline reads a new stream of that name.
    """
    from headgate.cli.streams import delete_stream
    from headgate.log.lock import DirectoryInUse

    if not yes:
        click.confirm(f"Delete stream {name!r} and every record in it from {data_dir}?", abort=True)
    try:
        deleted = delete_stream(data_dir, name)
    except DirectoryInUse as exc:
        click.echo(
            f"headgate streams: {_in_use(exc).replace('choose another --data-dir', 'try again')}",
            err=True,
        )
        sys.exit(1)
    except LookupError as exc:
        click.echo(f"headgate streams: {exc}", err=True)
        sys.exit(1)
    click.echo(f"deleted stream {name!r} ({_bytes_text(deleted.bytes_removed)}) from {data_dir}")


@main.command(name="pipeline")
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
