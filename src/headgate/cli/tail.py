"""``headgate tail STREAM``: watch a stream's records as the gateway appends them.

The tail is lossy by design: when this process (or the terminal it writes
to) cannot keep up, the gateway skips batches rather than slow its producers,
and the tail reports how many it missed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import sys
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import click

from headgate.cli.options import client_security, gateway_option, security_options
from headgate.client.reader import (
    MissedBatches,
    Reader,
    ReaderError,
    ReaderRefused,
    Subscription,
    TailBatch,
)
from headgate.client.security import ClientSecurity
from headgate.cluster import Cluster, ClusterError, load_cluster
from headgate.log.address import AddressError, RecordAddress
from headgate.protocol.messages import StartAt, is_valid_name
from headgate.protocol.records import decode_records

__all__ = ["TailOptions", "explain", "parse_start", "run_cluster_tail", "run_tail", "tail"]


def parse_start(text: str) -> StartAt | RecordAddress:
    """``now``, ``earliest`` or a record address; ValueError says what is accepted."""
    word = text.strip().lower()
    if word == "now":
        return StartAt.NOW
    if word == "earliest":
        return StartAt.EARLIEST
    try:
        return RecordAddress.parse(word)
    except AddressError as error:
        raise ValueError(
            "--from must be now, earliest or a log position (POSITION:INDEX for a record "
            f"inside its batch, as --format json prints them); {error}"
        ) from None


#: The gateway's refusals of a subscription that a user causes by what they
#: typed, as it words them (gateway/readers.py), with the plain line to show
#: instead. Its text names files on the gateway's machine and an error code
#: that means nothing to someone who mistyped a position.
_NO_STREAM = re.compile(r"the gateway holds no stream called ")
_NOT_A_BOUNDARY = re.compile(r"cannot read from position (\d+): no intact frame at position \d+")
_OUTSIDE = re.compile(r"cannot read \[(\d+), \d+\); the log holds \[(\d+), (\d+)\)")


def explain(error: ReaderError, options: TailOptions) -> str:
    """The one line that says why the tail could not start, for the person who started it."""
    if not isinstance(error, ReaderRefused):
        return str(error)
    stream = options.stream
    if _NO_STREAM.search(error.text):
        return f"gateway {options.gateway} has no stream called {stream!r}"
    match = _NOT_A_BOUNDARY.search(error.text)
    start = options.start
    if (
        match and isinstance(start, RecordAddress) and int(match[1]) == start.position
    ):  # later: damage, the gateway's to explain
        return (
            f"position {match[1]} is not where a batch of {stream!r} starts; use --from "
            "earliest, now, or a position that `headgate tail --format json` printed"
        )
    if match := _OUTSIDE.search(error.text):
        position, first, end = match.groups()
        return (
            f"position {position} is not in stream {stream!r}, which holds positions "
            f"{first} to {end}; use --from earliest or now"
        )
    return str(error)


@dataclass(frozen=True, slots=True)
class TailOptions:
    gateway: str
    stream: str
    #: Where to start: now, earliest, or a record's address (its batch's
    #: position, and its index in the batch).
    start: StartAt | RecordAddress = StartAt.NOW
    sample_every: int = 1
    #: "raw" (one value per line) or "json" (one object per record).
    output: str = "raw"
    #: Stop after this many records (None: until interrupted).
    count: int | None = None
    #: Token and TLS settings.
    security: ClientSecurity = field(default_factory=ClientSecurity)


def _text(data: bytes, name: str) -> dict[str, str]:
    try:
        return {name: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{name}_base64": base64.b64encode(data).decode("ascii")}


def _write_batch(
    batch: TailBatch, options: TailOptions, out: BinaryIO, budget: int | None, skip: int = 0
) -> int:
    """Write the batch's records from index ``skip`` on, at most ``budget``; return how many."""
    values, keys = decode_records(batch.records).to_lists()
    values = values[skip:] if budget is None else values[skip : skip + budget]
    if options.output == "raw":
        out.write(b"".join(v + b"\n" for v in values))
        return len(values)
    h = batch.header
    stamp = datetime.fromtimestamp(h.timestamp_us / 1e6, UTC).isoformat()
    lines = []
    for i, value in enumerate(values, start=skip):
        record: dict[str, object] = {
            "stream": batch.stream,
            "position": h.position,
            "index": i,
            "producer": h.producer_id,
            "sequence": h.first_sequence + i,
            "ingest_time": stamp,
        }
        key = None if keys is None else keys[i]
        if key is not None:
            record.update(_text(key, "key"))
        record.update(_text(value, "value"))
        lines.append(json.dumps(record) + "\n")
    out.write("".join(lines).encode("utf-8"))
    return len(values)


def _write_missed(missed: MissedBatches, options: TailOptions, out: BinaryIO) -> None:
    if options.output == "json":
        out.write((json.dumps({"missed_batches": missed.count}) + "\n").encode())
    else:
        print(
            f"headgate tail: missed {missed.count} batches (this tail was too slow)",
            file=sys.stderr,
        )


async def run_tail(options: TailOptions, out: BinaryIO) -> int:
    """Follow the stream until ``count`` records were written; return that number.

    Raises :class:`~headgate.client.reader.ReaderError` (naming the gateway)
    when the gateway cannot be reached or refuses the subscription, and
    :class:`~headgate.log.address.AddressError` when the batch at the start
    address has no record at its index.
    """
    written = 0
    start = options.start
    # Records of the first batch before the start address's index are not shown.
    inside = start if isinstance(start, RecordAddress) and start.index else None
    position = start.position if isinstance(start, RecordAddress) else start
    async with Reader(
        options.gateway, client_name="headgate-tail", security=options.security
    ) as reader:
        subscription = reader.subscribe(options.stream, position, sample_every=options.sample_every)
        async for item in subscription:
            if isinstance(item, MissedBatches):
                _write_missed(item, options, out)
                continue
            skip = 0
            if inside is not None and item.position == inside.position:
                inside.check_in_frame(options.stream, item.position, item.record_count)
                skip = inside.index
            inside = None
            budget = None if options.count is None else options.count - written
            written += _write_batch(item, options, out, budget, skip)
            out.flush()
            if options.count is not None and written >= options.count:
                break
            await asyncio.sleep(0)
    return written


async def run_cluster_tail(
    cluster: Cluster, stream: str, options: TailOptions, out: BinaryIO
) -> int:
    """Follow every partition of partitioned ``stream``, merged as they arrive.

    One reader per gateway; each record's ``stream`` (``--format json``) is
    its partition's log, ``orders.p3``, so it says where it came from. A
    gateway that cannot be reached is said on stderr once, and the tail goes
    on with the others. ``options.start`` is ``now`` or ``earliest`` (a
    position belongs to one partition). Returns the records written.
    """
    partitions = cluster.stream(stream).partitions
    items: asyncio.Queue[tuple[TailBatch | MissedBatches, TailOptions]] = asyncio.Queue(maxsize=64)
    position = options.start if isinstance(options.start, StartAt) else StartAt.NOW

    async def follow(gateway: str, held: list[str]) -> None:
        from headgate.client.fleet import gateway_security

        entry = cluster.gateways[gateway]
        try:
            async with Reader(
                entry.address,
                client_name="headgate-tail",
                security=gateway_security(options.security, entry),
            ) as reader:
                subscriptions = [
                    reader.subscribe(name, position, sample_every=options.sample_every)
                    for name in held
                ]

                async def pump(subscription: Subscription, name: str) -> None:
                    partition_options = replace(options, stream=name)
                    async for item in subscription:
                        await items.put((item, partition_options))

                async with asyncio.TaskGroup() as group:
                    for subscription, name in zip(subscriptions, held, strict=True):
                        group.create_task(pump(subscription, name))
        except* ReaderError as errors:
            print(f"headgate tail: gateway {gateway}: {errors.exceptions[0]}", file=sys.stderr)

    by_gateway: dict[str, list[str]] = {}
    for p in partitions:
        by_gateway.setdefault(p.gateway, []).append(p.name)
    tasks = [asyncio.ensure_future(follow(g, names)) for g, names in by_gateway.items()]
    written = 0
    try:
        while options.count is None or written < options.count:
            getter = asyncio.ensure_future(items.get())
            done, _ = await asyncio.wait([getter, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                tasks = [t for t in tasks if not t.done()]
                if not tasks:
                    break  # no gateway is left to follow
                continue
            item, partition_options = getter.result()
            if isinstance(item, MissedBatches):
                _write_missed(item, partition_options, out)
                continue
            budget = None if options.count is None else options.count - written
            written += _write_batch(item, partition_options, out, budget)
            out.flush()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return written


@click.command()
@click.argument("stream")
@gateway_option
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
@security_options
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
    if not is_valid_name(stream):
        raise click.UsageError(f"{stream!r} is not a stream name")
    security = client_security(options)
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


def _tail_cluster(cluster: Path, options: TailOptions) -> None:
    """``headgate tail --cluster``: every partition of the stream, merged; one line per error."""
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
