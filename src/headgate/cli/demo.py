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
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from headgate.client.background_loop import BackgroundLoop as BackgroundLoop
from headgate.config import GatewayConfig, StreamSettings
from headgate.gateway import Gateway, GatewayStreamStatistics
from headgate.log.lock import DirectoryInUse

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
        stream_capacity=16 * 1024**2,
        term_length=512 * 1024,
        max_message_size=64 * 1024,
        group_commit_interval_ms=2.0,
        streams={"audit": StreamSettings(capacity=1024**2)},
    )


@dataclass
class StreamSummary:
    stream: str
    sent: int
    acked: int
    written: int
    dead_letters: int
    acked_per_second: float
    #: Acknowledged after the load stopped: what the producer still held then.
    acked_after_load: int = 0


@dataclass
class DemoResult:
    """How ``headgate run`` ended, and the counts so far."""

    summaries: list[StreamSummary]
    #: True once every acknowledged record was written (or dead-lettered).
    completed: bool
    #: Ctrl-C stopped it.
    interrupted: bool = False
    #: The one-line reason it stopped early, or None.
    failure: str | None = None
    #: With several gateways: each partition's figures (see headgate.cli.fleet_demo).
    partitions: list[Any] = field(default_factory=list)


class DemoFailed(Exception):
    """The demo cannot go on; the message is one line for the user."""


#: How long the catch-up may go without any stream moving before it gives up.
STALL_TIMEOUT_S = 120.0
#: How long Spark may take to run its first (empty) batch of every query.
SPARK_START_TIMEOUT_S = 600.0
#: Dashboard refresh.
TICK_S = 0.5


async def _load(producer: Any, stream: str, stop: asyncio.Event) -> None:
    rng = random.Random(stream)
    make = GENERATORS[stream]
    n = 0
    while not stop.is_set():
        # Each send returns at once while the stream's producer buffer has
        # room, and waits for credit once it is full (the backpressure).
        await producer.send(stream, make(rng, n))
        n += 1
        if n % 200 == 0:
            await asyncio.sleep(0)


class _Demo:
    """The demo's parts and its phases; what it knows so far makes the summary."""

    def __init__(self, data_dir: Path, console: Console, spark: Any | None) -> None:
        self.data_dir = data_dir
        self.console = console
        self.spark = spark
        self.gw_thread: BackgroundLoop | None = None
        self.gateway: Gateway | None = None
        self.pipeline: Any = None
        self.prod_thread: BackgroundLoop | None = None
        self.producer: Any = None
        self.stop_load: asyncio.Event | None = None
        self.loads: list[Future[Any]] = []
        self.load_started: float | None = None
        self.load_seconds = 0.0
        self.acked_under_load: dict[str, int] = {}
        self._last_producer_streams: dict[str, Any] = {}
        self.completed = False

    # -- phases -----------------------------------------------------------------

    def start_gateway(self) -> None:
        self.gw_thread = BackgroundLoop("headgate-gateway")
        try:
            self.gateway = Gateway(demo_gateway_config(self.data_dir))
            self.gw_thread.run(self.gateway.start(), 30)
        except DirectoryInUse:
            self.gateway = None
            raise  # the command says who holds it, in its own words
        except Exception as exc:
            self.gateway = None
            raise DemoFailed(f"the gateway did not start: {exc}") from None
        host, port = self.gateway.address
        self.console.print(f"gateway listening on {host}:{port}")

    def start_spark(self) -> None:
        from headgate.config import ConfigError
        from headgate.spark.pipeline import Pipeline, pipeline_config_from_dict, spark_session

        began = time.monotonic()
        with self.console.status("starting Spark (local mode) ...") as status:
            if self.spark is None:
                self.spark = spark_session("headgate-demo")

            def slow_score(action: str | None) -> int:
                time.sleep(0.0005)  # the deliberately slow transform
                return len(action or "")

            self.spark.udf.register("slow_score", slow_score, "int")
            self.pipeline = Pipeline(
                self.spark,
                pipeline_config_from_dict(self.pipeline_settings()),
                release=self.release_callback(),
            )
            try:
                self.pipeline.start()
            except ConfigError as exc:
                raise DemoFailed(f"the pipeline did not start: {exc}") from None
            # The load's clock starts once every query ran its first batch:
            # before that, Spark is still starting and nothing would drain.
            while True:
                states = self.query_states()
                dead = {s: why for s, why in states.items() if why is not None}
                if dead:
                    stream, why = next(iter(dead.items()))
                    raise DemoFailed(f"the {stream} query stopped: {why}")
                waiting = [s for s, q in self.pipeline.queries.items() if q.lastProgress is None]
                if not waiting:
                    break
                took = time.monotonic() - began
                if took > SPARK_START_TIMEOUT_S:
                    raise DemoFailed(
                        f"Spark did not run a first batch of {', '.join(waiting)} "
                        f"within {SPARK_START_TIMEOUT_S:.0f} s"
                    )
                status.update(
                    f"starting Spark (local mode): {took:.0f} s, "
                    f"waiting for the first batch of {', '.join(waiting)}"
                )
                time.sleep(TICK_S)
        self.console.print(f"Spark is ready ({time.monotonic() - began:.0f} s)")

    def pipeline_settings(self) -> dict[str, Any]:
        """The pipeline's configuration: the gateway's data directory, read locally."""
        # Spark starts before the producers create the streams.
        return {"data_dir": str(self.data_dir), "missing_streams": "wait", "streams": PIPELINE}

    def release_callback(self) -> Callable[[str, int], None] | None:
        """Where the pipeline's releases go: straight to the gateway in this process."""
        return self._release

    def new_producer(self) -> Any:
        from headgate.client import Producer

        assert self.gateway is not None
        host, port = self.gateway.address
        # A small producer-side buffer, so that the application itself feels
        # the backpressure: send() waits as soon as a stream runs out of credit.
        return Producer(
            f"{host}:{port}", client_name="headgate-demo", max_buffered_bytes=512 * 1024
        )

    def load(self, stream: str, stop: asyncio.Event) -> Any:
        """The coroutine that sends ``stream``'s records until ``stop``."""
        return _load(self.producer, stream, stop)

    #: How the dashboard names what carries the load.
    carried_by = "one connection"

    def run_load(self, seconds: float) -> None:
        self.prod_thread = BackgroundLoop("headgate-producer")
        self.producer = self.new_producer()
        try:
            self.prod_thread.run(self.producer.connect(), 30)
        except Exception as exc:
            raise DemoFailed(f"the producer could not connect: {exc}") from None
        self.stop_load = asyncio.Event()
        self.loads = [self.prod_thread.submit(self.load(s, self.stop_load)) for s in STREAMS]
        self.load_started = time.monotonic()
        previous = {s: 0 for s in STREAMS}
        last = self.load_started
        title = f"headgate: {seconds:g} s of load on {self.carried_by} (Ctrl-C stops early)"
        with Live(console=self.console, refresh_per_second=4) as live:
            while time.monotonic() - self.load_started < seconds:
                time.sleep(TICK_S)
                self._check_load()
                now = time.monotonic()
                acked = self.acked()
                rates = {s: (acked[s] - previous[s]) / max(now - last, 1e-6) for s in STREAMS}
                previous, last = acked, now
                live.update(self._dashboard(title, rates))
        self.end_load()
        sent = sum(self.acked_under_load.values())
        self.console.print(
            f"load stopped after {self.load_seconds:.0f} s with {sent:,} records acknowledged; "
            "flushing what the producer still holds and letting Spark catch up ..."
        )

    def end_load(self) -> None:
        """Stop the load: its tasks are cancelled on the producer's loop, which does it next."""
        if self.load_started is None or self.stop_load is None:
            return
        if not self.acked_under_load:
            self.load_seconds = time.monotonic() - self.load_started
            self.acked_under_load = self.acked()
        assert self.prod_thread is not None
        self.prod_thread.call(self.stop_load.set)
        # A send waiting for credit is cancelled; what it had handed to the
        # producer stays there and is flushed like the rest.
        for load in self.loads:
            load.cancel()

    def catch_up(self) -> None:
        """Flush the producer, then wait until Spark wrote everything, showing progress."""
        assert self.prod_thread is not None
        flush = self.prod_thread.submit(self.producer.flush())
        began = time.monotonic()
        moved_at = began
        last_mark: tuple[int, ...] = ()
        title = "headgate: catching up (Ctrl-C stops early)"
        with Live(console=self.console, refresh_per_second=4) as live:
            while True:
                time.sleep(TICK_S)
                now = time.monotonic()
                if flush.done() and flush.exception() is not None:
                    raise DemoFailed(f"the producer failed: {flush.exception()}")
                self._check_queries()
                gw = self.gateway_stats()
                mark = tuple(self.acked().values()) + tuple(g.release_position for g in gw.values())
                if mark != last_mark:
                    last_mark, moved_at = mark, now
                live.update(self._dashboard(title, None, gw=gw, catching_up=True))
                if flush.done() and all(
                    g.release_position >= g.durable_position for g in gw.values()
                ):
                    break
                if now - moved_at > STALL_TIMEOUT_S:
                    behind = [s for s, g in gw.items() if g.release_position < g.tail_position]
                    raise DemoFailed(
                        f"no progress for {STALL_TIMEOUT_S:.0f} s while catching up "
                        f"({', '.join(behind) or 'the producer'} still behind)"
                    )
        self.pipeline.drain_progress()
        self.completed = True
        self.console.print(f"caught up in {time.monotonic() - began:.0f} s")

    def teardown(self) -> None:
        """Stop everything started, in order; never raises."""
        if self.load_started is not None:
            self.end_load()
        if self.prod_thread is not None:
            if self.producer is not None:
                # Stopped early, nothing waits for acknowledgements: the
                # summary counts only acknowledged records as delivered.
                ending = self.producer.close() if self.completed else self.producer.abort()
                with contextlib.suppress(Exception):
                    self.prod_thread.run(ending, 30)
                with contextlib.suppress(Exception):
                    self.producer_streams()  # the final figures, before its loop goes
            self.prod_thread.stop()
        if self.pipeline is not None:
            with contextlib.suppress(Exception):
                self.pipeline.stop(finish_batches=30.0 if self.completed else 0.0)
        if self.gw_thread is not None:
            if self.gateway is not None:
                with contextlib.suppress(Exception):
                    self.gw_thread.run(self.gateway.stop(), 60)
            self.gw_thread.stop()

    # -- what it knows --------------------------------------------------------------

    def _release(self, stream: str, position: int) -> None:
        gateway, thread = self.gateway, self.gw_thread
        if gateway is None or thread is None:
            return

        def apply() -> None:
            with contextlib.suppress(Exception):
                gateway.release(stream, position)

        thread.call(apply)

    def producer_streams(self) -> dict[str, Any]:
        """The producer's per-stream statistics, taken on its own loop (they change there)."""
        producer, thread = self.producer, self.prod_thread
        if producer is None or thread is None:
            return {}

        async def snapshot() -> dict[str, Any]:
            return dict(producer.statistics().streams)

        coro = snapshot()
        try:
            streams: dict[str, Any] = thread.run(coro, 10)
        except RuntimeError:  # its loop is already closed: the last figures stand
            coro.close()  # never scheduled: no "never awaited" warning
            return self._last_producer_streams
        self._last_producer_streams = streams
        return streams

    def acked(self) -> dict[str, int]:
        stats = self.producer_streams()
        return {s: stats[s].records_acked if s in stats else 0 for s in STREAMS}

    def gateway_stats(self) -> dict[str, GatewayStreamStatistics]:
        assert self.gw_thread is not None and self.gateway is not None
        gateway = self.gateway

        async def snapshot() -> list[GatewayStreamStatistics]:
            return gateway.statistics()

        return {s.name: s for s in self.gw_thread.run(snapshot(), 10)}

    def query_states(self) -> dict[str, str | None]:
        """Per stream: None while its query runs, else why it stopped (one line)."""
        from headgate.spark.pipeline import error_text

        states: dict[str, str | None] = {}
        for stream, query in (self.pipeline.queries if self.pipeline else {}).items():
            try:
                if query.isActive:
                    states[stream] = None
                    continue
                exc = query.exception()
                states[stream] = "stopped" if exc is None else error_text(exc)
            except Exception as exc:  # the JVM itself is going away
                states[stream] = error_text(exc)
        return states

    def _check_queries(self) -> None:
        for stream, why in self.query_states().items():
            if why is not None:
                raise DemoFailed(f"the {stream} query stopped: {why}")

    def _check_load(self) -> None:
        self._check_queries()
        for load in self.loads:
            if load.done() and not load.cancelled() and load.exception() is not None:
                raise DemoFailed(f"the load failed: {load.exception()}")

    def summaries(self) -> list[StreamSummary]:
        stats = self.producer_streams()
        pipeline = self.pipeline
        elapsed = max(self.load_seconds, 1e-6)
        return [
            StreamSummary(
                stream=s,
                sent=stats[s].records_sent if s in stats else 0,
                acked=stats[s].records_acked if s in stats else 0,
                written=pipeline.rows_written[s] if pipeline else 0,
                dead_letters=pipeline.dead_letters[s] if pipeline else 0,
                acked_per_second=self.acked_under_load.get(s, 0) / elapsed,
                acked_after_load=(stats[s].records_acked if s in stats else 0)
                - self.acked_under_load.get(s, 0),
            )
            for s in STREAMS
        ]

    def _dashboard(
        self,
        title: str,
        rates: dict[str, float] | None,
        *,
        gw: dict[str, GatewayStreamStatistics] | None = None,
        catching_up: bool = False,
    ) -> Table:
        gw = gw if gw is not None else self.gateway_stats()
        acked = self.acked()
        producer = self.producer_streams()
        states = self.query_states()
        max_frame = demo_gateway_config(self.data_dir).max_message_size
        table = Table(title=title)
        columns = ["stream", "acked"]
        columns += ["to flush", "to write"] if catching_up else ["rec/s", "log"]
        columns += ["batches", "written", "bad", "state"]
        for column in columns:
            table.add_column(column, justify="left" if column in ("stream", "state") else "right")
        notes: list[str] = []
        full = False
        for s in STREAMS:
            g = gw.get(s)
            why = states.get(s)
            if why is not None:
                state = "[red]dead[/]"
                notes.append(f"{s}: its Spark query stopped: {why}")
            elif g is not None and g.storage_problem:
                state = "[red]held[/]"
                notes.append(f"{s}: the gateway cannot store it: {g.storage_problem}")
            elif g is not None and g.free_capacity - g.reserve < max_frame:
                state = "[yellow]log full[/]"
                full = True
            else:
                state = "flowing"
            row = [s, f"{acked[s]:,}"]
            if catching_up:
                p = producer.get(s)
                to_flush = 0 if p is None else p.buffered_bytes
                to_write = 0 if g is None else max(0, g.tail_position - g.release_position)
                row += [_kib(to_flush), _kib(to_write)]
            else:
                fill = "-" if g is None else f"{100 * (1 - g.free_capacity / g.capacity):.0f}%"
                row += [f"{(rates or {}).get(s, 0.0):,.0f}", fill]
            row += [
                str(self.pipeline.batches[s]),
                f"{self.pipeline.rows_written[s]:,}",
                f"{self.pipeline.dead_letters[s]:,}",
                state,
            ]
            table.add_row(*row)
        legend = (
            "to flush: in the producer, not yet acknowledged; to write: in the log, "
            "not yet written by Spark"
            if catching_up
            else "log: how full the stream's log is; bad: records that did not parse (dead letters)"
        )
        if full:
            notes.insert(
                0,
                "log full: no room left (the rest is kept for term rotation); "
                "its producer waits until Spark writes and releases",
            )
        table.caption = "\n".join([legend, *notes])
        return table


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"


class _CtrlCSeen:
    """Notes a SIGINT (Ctrl-C) while the demo runs, then hands it to the handler before it.

    PySpark's own SIGINT handler cancels Spark's jobs and raises
    KeyboardInterrupt; when that lands inside a call into the JVM, py4j may
    swallow it and the next call fails instead. Only in the main thread
    (where signal handlers live); elsewhere it notes nothing.
    """

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.seen = True
        if callable(self._previous):
            self._previous(signum, frame)
        elif self._previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    def close(self) -> None:
        if self._installed:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGINT, previous)
            self._installed = False


def run_demo(
    data_dir: Path,
    seconds: float,
    console: Console,
    *,
    spark: Any | None = None,
    gateways: int = 1,
) -> DemoResult:
    """Run everything for ``seconds`` of load, then drain, stop and summarise.

    Never raises for what goes wrong in the demo itself (but for
    :class:`DirectoryInUse`: another gateway has the directory): the result
    says how it ended, and the summary (of what was done so far) is printed.
    ``spark``: a session to use (and leave running); else one is made and
    stopped at the end. ``gateways``: more than 1 runs the demo on a fleet of
    that many local gateways (:mod:`headgate.cli.fleet_demo`).
    """
    data_dir = data_dir.resolve()
    console.print(f"[bold]headgate run[/]: data in {data_dir}")
    demo: _Demo
    if gateways > 1:
        from headgate.cli.fleet_demo import FleetDemo

        demo = FleetDemo(data_dir, console, spark, gateways)
    else:
        demo = _Demo(data_dir, console, spark)
    own_spark = spark is None
    interrupted = False
    failure: str | None = None
    ctrl_c = _CtrlCSeen()
    try:
        demo.start_gateway()
        demo.start_spark()
        demo.run_load(seconds)
        demo.catch_up()
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: stopping ...")
    except DemoFailed as exc:
        if ctrl_c.seen:
            # A Ctrl-C that landed inside a call into Spark's JVM can break
            # that call instead of raising here: it is still an interrupt.
            interrupted = True
            console.print("interrupted: stopping ...")
        else:
            failure = str(exc)
    finally:
        ctrl_c.close()
        demo.teardown()
    result = DemoResult(demo.summaries(), demo.completed, interrupted, failure)
    try:
        _print_summary(console, result, data_dir, demo.spark if demo.completed else None)
        if gateways > 1:
            from headgate.cli.fleet_demo import FleetDemo, print_partitions

            assert isinstance(demo, FleetDemo)
            result.partitions = demo.partition_summaries(demo.spark if demo.completed else None)
            print_partitions(console, result.partitions)
    finally:
        if own_spark and demo.spark is not None:
            with contextlib.suppress(Exception):
                demo.spark.stop()
    return result


def _print_summary(console: Console, result: DemoResult, data_dir: Path, spark: Any | None) -> None:
    """The counts per stream; once complete, also a query over the Parquet output."""
    summaries = result.summaries
    title = "summary" if result.completed else "summary so far (the run did not finish)"
    table = Table(title=title)
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
    if not result.completed:
        console.print(
            "Acknowledged records not yet written stay in the logs; the next run writes them first."
        )
        return
    fastest = max(s.acked_per_second for s in summaries if s.stream != "audit")
    audit = next(s for s in summaries if s.stream == "audit")
    console.print(
        f"audit (slow transform) ran at {audit.acked_per_second:,.0f} rec/s, "
        f"{audit.acked_per_second / max(fastest, 1):.2f}x the fastest stream: "
        "credit throttled only that stream."
    )
    after = sum(s.acked_after_load for s in summaries)
    console.print(
        f"After the load stopped, the producer flushed the {after:,} records it still "
        "held (at most 512 KiB per stream: max_buffered_bytes)."
    )
    console.print(f"Parquet output: {data_dir / 'parquet'} (dead letters under _dead_letters/)")
    console.print(f'Query it: .venv/bin/headgate query --data-dir {data_dir} "SELECT ..."')
    if spark is None:
        return
    query = (
        "SELECT symbol, count(*) AS ticks, round(avg(price), 2) AS avg_price "
        "FROM ticks GROUP BY symbol ORDER BY symbol"
    )
    spark.read.parquet(str(data_dir / "parquet" / "ticks")).createOrReplaceTempView("ticks")
    console.print(f"query: {query}")
    rows = spark.sql(query).collect()
    result_table = Table()
    for column in ("symbol", "ticks", "avg_price"):
        result_table.add_column(column)
    for row in rows:
        result_table.add_row(str(row["symbol"]), f"{row['ticks']:,}", str(row["avg_price"]))
    console.print(result_table)
