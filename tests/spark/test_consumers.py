"""Two pipelines on one stream, each its own gateway consumer, for real.

A gateway runs in this process (a background event loop) on 127.0.0.1; the
pipelines' queries run in the shared local SparkSession and release over
real connections (:class:`~headgate.spark.pipeline.GatewayReleases`), each
naming its consumer. Both consumers block: the slower one alone decides
what the log frees, and so the producer's pace, and both outputs hold every
acknowledged record exactly once. With retention, a consumer reset to
``earliest`` replays the very same records. A non-blocking ``skip``
pipeline that the log left behind reports exactly the records it skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from headgate.cli.demo import BackgroundLoop
from headgate.client import Producer
from headgate.client.reader import Reader
from headgate.config import ConsumerSettings, GatewayConfig, StreamSettings
from headgate.gateway import Gateway
from headgate.protocol import messages as m
from headgate.spark.pipeline import (
    ConsumerProgress,
    Pipeline,
    consumer_progress,
    pipeline_config_from_dict,
)

pytestmark = pytest.mark.timeout(240)

RECORDS = 3000
KiB = 1024


class RunningGateway:
    def __init__(self, data_dir: Path, streams: dict[str, StreamSettings] | None = None) -> None:
        self.loop = BackgroundLoop("test-gateway")
        self.gateway = Gateway(
            GatewayConfig(
                listen=("127.0.0.1", 0),
                data_dir=data_dir,
                stream_capacity=128 * KiB,
                term_length=32 * KiB,
                max_message_size=4 * KiB,
                group_commit_interval_ms=1.0,
                streams=streams or {},
            )
        )
        self.loop.run(self.gateway.start(), 30)
        host, port = self.gateway.address
        self.address = f"{host}:{port}"

    def on_loop(self, read: Any) -> Any:
        """``read()`` on the gateway's loop (its state changes only there)."""

        async def call() -> Any:
            return read()

        return self.loop.run(call(), 10)

    def stop(self) -> None:
        self.loop.run(self.gateway.stop(), 30)
        self.loop.stop()


def pipeline(spark: Any, gw: RunningGateway, tmp_path: Path, name: str, **stream: Any) -> Pipeline:
    return Pipeline(
        spark,
        pipeline_config_from_dict(
            {
                "data_dir": str(tmp_path / "data"),
                "gateway": gw.address,
                "output_dir": str(tmp_path / name / "out"),
                "checkpoint_dir": str(tmp_path / name / "checkpoints"),
                "streams": {"s": {"consumer": name, **stream}},
            }
        ),
    )


def values(tmp_path: Path, name: str) -> list[bytes]:
    return list(pq.read_table(tmp_path / name / "out" / "s").to_pydict()["value"])


def test_two_blocking_pipelines_the_slow_one_throttles_and_both_get_every_record_once(
    spark: Any, tmp_path: Path
) -> None:
    # Both consumers exist before either query runs (the gateway's TOML
    # declares them): a consumer declared later starts where the log then
    # is, and the other may have freed what came before.
    both = StreamSettings(consumers=(("fast", ConsumerSettings()), ("slow", ConsumerSettings())))
    gw = RunningGateway(tmp_path / "data", {"s": both})
    producer_loop = BackgroundLoop("test-producer")
    producer = Producer(gw.address, max_batch_bytes=2048, max_buffered_bytes=64 * KiB)
    sent = [b"first"] + [b"record-%05d-" % i + b"x" * 100 for i in range(RECORDS)]
    pipelines: list[Pipeline] = []
    try:
        producer_loop.run(producer.connect(), 30)

        async def send(batch: list[bytes]) -> None:
            for value in batch:
                await producer.send("s", value)
            await producer.flush()

        producer_loop.run(send(sent[:1]), 30)  # the stream exists (missing_streams = fail)
        fast = pipeline(spark, gw, tmp_path, "fast", trigger_seconds=0.2)
        slow = pipeline(
            spark, gw, tmp_path, "slow", trigger_seconds=0.5, max_records_per_trigger=500
        )
        pipelines += [fast, slow]
        for each in pipelines:
            each.start()
        stream = gw.gateway.streams["s"]
        assert set(gw.on_loop(lambda: stream.consumers.consumers)) == {"fast", "slow"}
        done = producer_loop.submit(send(sent[1:]))
        samples: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + 180
        while not done.done() and time.monotonic() < deadline:
            sample = gw.on_loop(
                lambda: (
                    stream.consumers.consumers["fast"].position,
                    stream.consumers.consumers["slow"].position,
                    stream.consumed_position,
                )
            )
            samples.append(sample)
            time.sleep(0.1)
        done.result(10)
        # The log (so the producer's credit) never passed the slow consumer,
        # and the fast one was often ahead of it: the slow one set the pace.
        assert all(consumed <= min(f, s) for f, s, consumed in samples)
        assert sum(1 for f, s, consumed in samples if f > s == consumed) >= 3, samples
        tail = gw.on_loop(lambda: stream.log.durable_position)
        assert tail > 2 * 128 * KiB, "the producer must have waited for releases"
        for each in pipelines:
            each.catch_up()
        for name in ("fast", "slow"):
            got = values(tmp_path, name)
            assert len(got) == len(set(got)) == len(sent), name
            assert set(got) == set(sent), name
        # Each query's progress names its consumer and its lag.
        latest = fast.queries["s"].lastProgress.sources[0].latestOffset
        assert consumer_progress(latest) == {"s": ConsumerProgress("fast", 0, 0, 0, 0)}
        assert slow.consumer_progress["s"].consumer == "slow"
    finally:
        for each in pipelines:
            each.stop()
        producer_loop.run(producer.abort(), 30)
        producer_loop.stop()
        gw.stop()


def test_a_consumer_reset_to_earliest_inside_the_retention_replays_the_same_records(
    spark: Any, tmp_path: Path
) -> None:
    retained = StreamSettings(retain_bytes=1024 * KiB)
    gw = RunningGateway(tmp_path / "data", {"s": retained})
    producer_loop = BackgroundLoop("test-producer")
    sent = [b"replay-%05d" % i for i in range(500)]
    try:

        async def send() -> None:
            async with Producer(gw.address, max_batch_bytes=1024) as producer:
                for value in sent:
                    await producer.send("s", value)
                await producer.flush()

        producer_loop.run(send(), 30)
        first = pipeline(spark, gw, tmp_path, "archive")
        first.start(available_now=True)
        first.await_done(120)
        first.stop()
        stream = gw.gateway.streams["s"]
        # The pipeline's consumer took the place of the implicit one.
        assert set(gw.on_loop(lambda: stream.consumers.consumers)) == {"archive"}
        end = gw.on_loop(lambda: stream.log.durable_position)
        assert gw.on_loop(lambda: stream.consumers.consumers["archive"].position) == end
        assert gw.on_loop(lambda: stream.log.release_position) == 0  # retained

        async def reset() -> int:
            async with Reader(gw.address) as reader:
                return await reader.reset_consumer("s", "archive", m.ResetTo.EARLIEST)

        assert producer_loop.run(reset(), 30) == 0
        # The replay: the same consumer, from a fresh checkpoint, from earliest.
        replay = Pipeline(
            spark,
            pipeline_config_from_dict(
                {
                    "data_dir": str(tmp_path / "data"),
                    "gateway": gw.address,
                    "output_dir": str(tmp_path / "replay" / "out"),
                    "checkpoint_dir": str(tmp_path / "replay" / "checkpoints"),
                    "streams": {"s": {"consumer": "archive"}},
                }
            ),
        )
        replay.start(available_now=True)
        replay.await_done(120)
        replay.stop()
        original = pq.read_table(tmp_path / "archive" / "out" / "s").to_pydict()
        again = pq.read_table(tmp_path / "replay" / "out" / "s").to_pydict()
        key = ("position", "index", "sequence", "value")
        assert sorted(zip(*(original[k] for k in key), strict=True)) == sorted(
            zip(*(again[k] for k in key), strict=True)
        )
        assert sorted(again["value"]) == sorted(sent)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if gw.on_loop(lambda: stream.consumers.consumers["archive"].position) == end:
                break
            time.sleep(0.05)
        assert gw.on_loop(lambda: stream.consumers.consumers["archive"].position) == end
    finally:
        producer_loop.stop()
        gw.stop()


def wait_on(gw: RunningGateway, read: Any, expected: Any, seconds: float = 10) -> None:
    """Poll ``read()`` on the gateway's loop until it gives ``expected`` (bounded)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and gw.on_loop(read) != expected:
        time.sleep(0.05)
    assert gw.on_loop(read) == expected


def test_a_skip_pipeline_left_behind_reports_the_exact_records_it_skipped(
    spark: Any, tmp_path: Path
) -> None:
    # "archive" blocks and is released by hand; the pipeline's "live" does not.
    gw = RunningGateway(
        tmp_path / "data", {"s": StreamSettings(consumers=(("archive", ConsumerSettings()),))}
    )
    producer_loop = BackgroundLoop("test-producer")
    first = [b"first-%05d" % i for i in range(300)]
    gone = [b"gone-%05d" % i for i in range(1000)]
    later = [b"later-%05d" % i for i in range(50)]
    try:

        async def send(batch: list[bytes]) -> None:
            async with Producer(gw.address, max_batch_bytes=512, linger_ms=1) as producer:
                for value in batch:
                    await producer.send("s", value)
                await producer.flush()

        def live() -> Pipeline:
            return pipeline(spark, gw, tmp_path, "live", blocking=False, fail_on_data_loss=False)

        producer_loop.run(send(first), 30)
        run = live()
        run.start(available_now=True)
        run.await_done(120)
        run.stop()
        stream = gw.gateway.streams["s"]
        read_to = gw.on_loop(lambda: stream.log.durable_position)
        wait_on(gw, lambda: stream.consumers.consumers["live"].position, read_to)
        # While the pipeline is away, the blocking consumer frees everything:
        # "gone" is deleted before "live" reads it.
        producer_loop.run(send(gone), 30)
        end = gw.on_loop(lambda: stream.log.durable_position)
        gw.on_loop(lambda: gw.gateway.release("s", end, "archive"))
        wait_on(gw, lambda: stream.log.release_position, end)
        producer_loop.run(send(later), 30)

        again = live()  # from its checkpoint, at read_to: freed
        again.start(available_now=True)
        again.await_done(120)
        again.stop()
        figures = again.consumer_progress["s"]
        assert figures.consumer == "live"
        assert figures.skipped_bytes == end - read_to
        assert figures.skipped_records == len(gone)  # exactly the records freed unread
        assert figures.lag_records == 0
        assert sorted(values(tmp_path, "live")) == sorted(first + later)
    finally:
        producer_loop.stop()
        gw.stop()
