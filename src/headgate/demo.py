"""``headgate run``: the gateway, a demo load and the Spark pipeline, together.

One producer connection carries three streams of made-up data:

* ``ticks``: stock ticks (JSON), Parquet partitioned by symbol;
* ``accounting``: RADIUS-style accounting events (JSON), with a few malformed
  records that end up in the dead-letter dataset;
* ``audit``: audit events whose transform is deliberately slow.

The producer sends as fast as credit allows. Spark's progress is what frees
log space, so ``audit`` is throttled to its transform's pace while the other
two streams, on the same connection, run at full speed. The terminal shows
it live; at the end a summary counts records sent, acknowledged and written
per stream and runs one query over the Parquet output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from headgate.config import GatewayConfig, StreamSettings
from headgate.gateway import Gateway, StreamStatistics

STREAMS = ("ticks", "accounting", "audit")
SYMBOLS = ("ACME", "GLOBX", "INITECH", "UMBRL", "WAYNE")

PIPELINE = {
    "ticks": {
        "format": "json",
        "schema": "symbol STRING, price DOUBLE, volume INT, ts TIMESTAMP",
        "partition_by": ["symbol"],
        "trigger_seconds": 1.0,
    },
    "accounting": {
        "format": "json",
        "schema": "user STRING, session_id STRING, status STRING, octets_in BIGINT, "
        "octets_out BIGINT",
        "trigger_seconds": 1.0,
    },
    "audit": {
        "format": "json",
        "schema": "user STRING, action STRING",
        "transform": "SELECT *, slow_score(action) AS score FROM audit",
        "trigger_seconds": 1.0,
        "max_records_per_trigger": 2000,
    },
}


def _tick(rng: random.Random, n: int) -> bytes:
    return json.dumps(
        {
            "symbol": rng.choice(SYMBOLS),
            "price": round(rng.uniform(10, 500), 2),
            "volume": rng.randint(1, 1000),
            "ts": f"2026-11-21T00:00:{n % 60:02d}Z",
        }
    ).encode()


def _accounting(rng: random.Random, n: int) -> bytes:
    if n % 500 == 499:
        return b'{"user": "broken'  # a malformed record, for the dead letters
    return json.dumps(
        {
            "user": f"user{rng.randint(1, 200)}",
            "session_id": f"{n:08x}",
            "status": rng.choice(("Start", "Interim-Update", "Stop")),
            "octets_in": rng.randint(0, 10**7),
            "octets_out": rng.randint(0, 10**7),
        }
    ).encode()


def _audit(rng: random.Random, n: int) -> bytes:
    action = rng.choice(("login", "logout", "read", "write"))
    return json.dumps({"user": f"user{rng.randint(1, 50)}", "action": action}).encode()


GENERATORS: dict[str, Callable[[random.Random, int], bytes]] = {
    "ticks": _tick,
    "accounting": _accounting,
    "audit": _audit,
}


def demo_gateway_config(data_dir: Path) -> GatewayConfig:
    """Small logs, so that credit and throttling show within seconds."""
    return GatewayConfig(
        listen=("127.0.0.1", 0),
        data_dir=data_dir,
        stream_capacity=4 * 1024**2,
        term_length=256 * 1024,
        max_message_size=64 * 1024,
        group_commit_interval_ms=2.0,
        streams={"audit": StreamSettings(capacity=1024**2)},
    )


class BackgroundLoop:
    """An asyncio loop in a background thread, for the gateway or the producer."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class StreamSummary:
    stream: str
    sent: int
    acked: int
    written: int
    dead_letters: int
    acked_per_second: float


async def _load(producer: Any, stream: str, stop: asyncio.Event) -> None:
    rng = random.Random(stream)
    make = GENERATORS[stream]
    n = 0
    while not stop.is_set():
        for _ in range(200):
            await producer.send(stream, make(rng, n))
            n += 1
        await asyncio.sleep(0)


def run_demo(data_dir: Path, seconds: float, console: Console) -> list[StreamSummary]:
    """Run everything for ``seconds`` of load, then drain, stop and summarise."""
    from headgate.client import Producer
    from headgate.spark.pipeline import Pipeline, pipeline_config_from_dict, spark_session

    data_dir = data_dir.resolve()
    console.print(f"[bold]headgate run[/]: data in {data_dir}")
    gw_thread = BackgroundLoop("headgate-gateway")
    gateway = Gateway(demo_gateway_config(data_dir))
    gw_thread.run(gateway.start(), 30)
    host, port = gateway.address
    console.print(f"gateway listening on {host}:{port}")

    def release(stream: str, position: int) -> None:
        def apply() -> None:
            with contextlib.suppress(Exception):
                gateway.release(stream, position)

        gw_thread.loop.call_soon_threadsafe(apply)

    console.print("starting Spark (local mode) ...")
    spark = spark_session("headgate-demo")

    def slow_score(action: str | None) -> int:
        time.sleep(0.0005)  # the deliberately slow transform
        return len(action or "")

    spark.udf.register("slow_score", slow_score, "int")
    pipeline = Pipeline(
        spark,
        pipeline_config_from_dict({"data_dir": str(data_dir), "streams": PIPELINE}),
        release=release,
    )
    pipeline.start()

    prod_thread = BackgroundLoop("headgate-producer")
    # A small producer-side buffer, so that the application itself feels the
    # backpressure: send() waits as soon as a stream runs out of credit.
    producer = Producer(
        f"{host}:{port}", client_name="headgate-demo", max_buffered_bytes=512 * 1024
    )
    prod_thread.run(producer.connect(), 30)
    stop = asyncio.Event()
    loads = [
        asyncio.run_coroutine_threadsafe(_load(producer, s, stop), prod_thread.loop)
        for s in STREAMS
    ]
    started = time.monotonic()
    try:
        with Live(console=console, refresh_per_second=4) as live:
            previous = {s: 0 for s in STREAMS}
            last = time.monotonic()
            while time.monotonic() - started < seconds:
                time.sleep(0.5)
                now = time.monotonic()
                stats = producer.statistics().streams
                gw_stats = {s.name: s for s in _gateway_stats(gw_thread, gateway)}
                table = _dashboard(stats, gw_stats, pipeline, previous, now - last)
                previous = {s: stats[s].records_acked if s in stats else 0 for s in STREAMS}
                last = now
                live.update(table)
        elapsed = time.monotonic() - started
        during_load = {s: st.records_acked for s, st in producer.statistics().streams.items()}
        console.print("load finished; flushing the producer and letting Spark catch up ...")
        prod_thread.loop.call_soon_threadsafe(stop.set)
        # A load stops at its next send; one waiting for credit on the slow
        # stream waits for Spark, which can take a while on a busy machine.
        for load in loads:
            load.result(300)
        prod_thread.run(producer.flush(), 300)
        final = producer.statistics().streams
        pipeline.catch_up()
    finally:
        with contextlib.suppress(Exception):
            prod_thread.run(producer.close(), 30)
        prod_thread.stop()
        pipeline.stop()
        gw_thread.run(gateway.stop(), 60)
        gw_thread.stop()
    summaries = [
        StreamSummary(
            stream=s,
            sent=final[s].records_sent,
            acked=final[s].records_acked,
            written=pipeline.rows_written[s],
            dead_letters=pipeline.dead_letters[s],
            acked_per_second=during_load.get(s, 0) / elapsed,
        )
        for s in STREAMS
    ]
    _print_summary(console, summaries, data_dir, spark)
    spark.stop()
    return summaries


def _gateway_stats(thread: BackgroundLoop, gateway: Gateway) -> list[StreamStatistics]:
    async def snapshot() -> list[StreamStatistics]:
        return gateway.statistics()

    result: list[StreamStatistics] = thread.run(snapshot(), 5)
    return result


def _dashboard(
    stats: Any,
    gw_stats: dict[str, StreamStatistics],
    pipeline: Any,
    previous: dict[str, int],
    interval: float,
) -> Table:
    table = Table(title="headgate: per-stream flow (Ctrl-C stops early)")
    for column in (
        "stream",
        "acked",
        "ingest rec/s",
        "log fill",
        "guarantees",
        "spark batches",
        "rows written",
        "dead letters",
    ):
        table.add_column(column, justify="right" if column != "stream" else "left")
    for s in STREAMS:
        st = stats.get(s)
        acked = st.records_acked if st else 0
        rate = (acked - previous.get(s, 0)) / max(interval, 1e-6)
        g = gw_stats.get(s)
        fill = f"{100 * (1 - g.free_capacity / g.capacity):.0f}%" if g else "-"
        table.add_row(
            s,
            f"{acked:,}",
            f"{rate:,.0f}",
            fill,
            f"{g.guarantees_outstanding:,}" if g else "-",
            str(pipeline.batches[s]),
            f"{pipeline.rows_written[s]:,}",
            str(pipeline.dead_letters[s]),
        )
    return table


def _print_summary(
    console: Console, summaries: list[StreamSummary], data_dir: Path, spark: Any
) -> None:
    table = Table(title="summary")
    for column in ("stream", "sent", "acked", "written", "dead letters", "rec/s under load"):
        table.add_column(column, justify="right" if column != "stream" else "left")
    for s in summaries:
        table.add_row(
            s.stream,
            f"{s.sent:,}",
            f"{s.acked:,}",
            f"{s.written:,}",
            f"{s.dead_letters:,}",
            f"{s.acked_per_second:,.0f}",
        )
    console.print(table)
    fastest = max(s.acked_per_second for s in summaries if s.stream != "audit")
    audit = next(s for s in summaries if s.stream == "audit")
    console.print(
        f"audit (slow transform) ran at {audit.acked_per_second:,.0f} rec/s, "
        f"{audit.acked_per_second / max(fastest, 1):.2f}x the fastest stream: "
        "credit throttled only that stream."
    )
    console.print(f"Parquet output: {data_dir / 'parquet'} (dead letters under _dead_letters/)")
    query = (
        "SELECT symbol, count(*) AS ticks, round(avg(price), 2) AS avg_price "
        "FROM ticks GROUP BY symbol ORDER BY symbol"
    )
    spark.read.parquet(str(data_dir / "parquet" / "ticks")).createOrReplaceTempView("ticks")
    console.print(f"query: {query}")
    rows = spark.sql(query).collect()
    result = Table()
    for column in ("symbol", "ticks", "avg_price"):
        result.add_column(column)
    for row in rows:
        result.add_row(str(row["symbol"]), f"{row['ticks']:,}", str(row["avg_price"]))
    console.print(result)
