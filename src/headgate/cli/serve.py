"""``headgate serve``: run the gateway until a signal, and reload its settings on SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import click

from headgate.cli.text import in_use
from headgate.config import (
    DEFAULT_METRICS_PORT,
    GROUP_COMMIT_MODES,
    ConfigError,
    load_gateway_config,
    parse_address,
    parse_size,
)
from headgate.logformat import LOG_FORMATS, use_log_format

#: What `headgate serve` itself says while it runs (reloads, the clean stop):
#: shown at the default verbosity, in the format --log-format picks.
serve_log = logging.getLogger("headgate.serve")


@click.command()
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


def _size(value: str | None, what: str) -> int | None:
    return None if value is None else parse_size(value, what=what)


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
        click.echo(f"headgate serve: {in_use(exc)}", err=True)
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
