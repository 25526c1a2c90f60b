"""``headgate consumers``: a gateway's named consumers, their positions and lag; reset, delete.

Listing asks a running gateway (ListStreams, then ListConsumers per stream:
the ``read`` right with a tokens file). Reset and delete need the ``admin``
right.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import click

from headgate.cli.options import client_security, gateway_option, security_options, table_or_json
from headgate.cli.text import bytes_text, count_text
from headgate.client.reader import Reader, ReaderError
from headgate.client.security import ClientSecurity
from headgate.protocol import messages as m

__all__ = ["ConsumerRow", "consumers", "list_consumers"]


@dataclass(frozen=True, slots=True)
class ConsumerRow:
    """One consumer as ``headgate consumers`` shows it."""

    stream: str
    consumer: str
    position: int
    lag_bytes: int
    lag_seconds: float
    blocking: bool
    on_data_loss: str
    #: ``ok``, ``idle`` (blocking, holding the producers) or ``detached``.
    state: str
    #: Records in the durable log after its position; None where the gateway
    #: cannot count them (or is older than the field).
    lag_records: int | None = None

    @classmethod
    def of(cls, stream: str, info: m.ConsumerInfo) -> ConsumerRow:
        state = "detached" if info.detached else "idle" if info.idle else "ok"
        return cls(
            stream,
            info.consumer,
            info.position,
            info.lag_bytes,
            info.lag_ms / 1000,
            info.blocking,
            "skip" if info.skip_data_loss else "fail",
            state,
            info.lag_records,
        )

    def as_dict(self) -> dict[str, int | str | float | bool | None]:
        return {
            "stream": self.stream,
            "consumer": self.consumer,
            "position": self.position,
            "lag_bytes": self.lag_bytes,
            "lag_records": self.lag_records,
            "lag_seconds": self.lag_seconds,
            "blocking": self.blocking,
            "on_data_loss": self.on_data_loss,
            "state": self.state,
        }


async def list_consumers(
    gateway: str, security: ClientSecurity | None = None, names: Sequence[str] = ()
) -> list[ConsumerRow]:
    """The consumers of the gateway's streams (only ``names`` if given), by stream and name.

    Raises:
        ReaderError: the gateway cannot be reached or refused the request.
        LookupError: a stream of ``names`` does not exist.
    """
    async with Reader(gateway, client_name="headgate-consumers", security=security) as reader:
        known = [info.stream for info in await reader.list_streams()]
        missing = [name for name in names if name not in known]
        if missing:
            raise LookupError(
                f"the gateway at {gateway} has no stream {', '.join(map(repr, missing))}"
            )
        rows: list[ConsumerRow] = []
        for stream in sorted(names or known):
            rows += [ConsumerRow.of(stream, c) for c in await reader.list_consumers(stream)]
    return rows


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


@click.group(cls=_ConsumersGroup)
def consumers() -> None:
    """A gateway's named consumers: list them (the default), reset or delete one."""


@consumers.command(name="list")
@click.argument("names", nargs=-1)
@gateway_option
@security_options
@table_or_json("table, or one JSON object per consumer (for scripts).")
def consumers_list(names: tuple[str, ...], gateway: str, fmt: str, **options: Any) -> None:
    """The named consumers of every stream (or of the streams NAMES), with their lag.

    position: what the consumer committed; lag: the durable bytes after it,
    the records in them ("?" where the gateway cannot count them: a
    non-blocking consumer's position freed before it was counted), and the
    age of the oldest of them; blocking: whether it holds the
    producers back; state: ok, idle (blocking and not releasing past
    idle_release_seconds) or detached (made non-blocking for idling).
    """
    try:
        rows = asyncio.run(list_consumers(gateway, client_security(options), names))
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
            bytes_text(r.lag_bytes),
            count_text(r.lag_records),
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


def _reset_target(text: str) -> Any:
    """``earliest``, ``latest``, a position, or an ISO time (UTC unless it says)."""
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
    security = client_security(options)

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
@gateway_option
@security_options
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
@gateway_option
@security_options
def consumers_delete(name: str, stream: str, yes: bool, gateway: str, **options: Any) -> None:
    """Delete consumer NAME of a stream; the log is freed of what it held (admin right)."""
    if not yes:
        click.confirm(f"delete consumer {name!r} of stream {stream!r}?", abort=True)
    position = _change_consumer(gateway, options, lambda r: r.delete_consumer(stream, name))
    click.echo(f"deleted consumer {name!r} of stream {stream!r} (it was at {position:,})")
