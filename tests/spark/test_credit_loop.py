"""Spark's progress is what gives producers credit: the whole loop, for real.

A gateway (in a background event loop), a producer, and the pipeline's Spark
query in this process. While Spark commits nothing, the stream's log fills
and its producer waits; once Spark runs, its commits release log space and
the producer finishes. Every record lands in Parquet exactly once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from headgate.cli.demo import BackgroundLoop
from headgate.client import Producer
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.spark.pipeline import Pipeline, pipeline_config_from_dict

RECORDS = 3000


def test_producers_wait_while_spark_is_held_back_and_resume_when_it_moves(
    spark: Any, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    config = GatewayConfig(
        listen=("127.0.0.1", 0),
        data_dir=data,
        stream_capacity=128 * 1024,
        term_length=32 * 1024,
        max_message_size=4 * 1024,
        group_commit_interval_ms=1.0,
    )
    gw_thread = BackgroundLoop("test-gateway")
    gateway = Gateway(config)
    gw_thread.run(gateway.start(), 30)
    producer_thread = BackgroundLoop("test-producer")
    host, port = gateway.address
    producer = Producer(f"{host}:{port}", max_batch_bytes=2048, max_buffered_bytes=64 * 1024)
    pipeline = None
    try:
        producer_thread.run(producer.connect(), 30)

        async def produce() -> None:
            for i in range(RECORDS):
                await producer.send("held", b"record-%05d-" % i + b"x" * 100)
            await producer.flush()

        done = asyncio.run_coroutine_threadsafe(produce(), producer_thread.loop)
        # Spark is held back: nothing is committed, so nothing is released.
        time.sleep(2.0)
        assert not done.done(), "the producer must wait for credit"
        stats = producer.statistics().streams["held"]
        assert 0 < stats.records_acked < RECORDS
        held_at = stats.records_acked
        time.sleep(0.5)
        assert producer.statistics().streams["held"].records_acked == held_at, (
            "no progress without Spark"
        )

        def release(stream: str, position: int) -> None:
            gw_thread.loop.call_soon_threadsafe(gateway.release, stream, position)

        pipeline = Pipeline(
            spark,
            pipeline_config_from_dict(
                {"data_dir": str(data), "streams": {"held": {"trigger_seconds": 0.2}}}
            ),
            release=release,
        )
        pipeline.start()
        done.result(120)  # Spark moved on: the producer finished
        pipeline.catch_up()
        values = pq.read_table(data / "parquet" / "held").to_pydict()["value"]
        assert len(values) == len(set(values)) == RECORDS
    finally:
        if pipeline is not None:
            pipeline.stop()
        producer_thread.run(producer.abort(), 30)
        producer_thread.stop()
        gw_thread.run(gateway.stop(), 30)
        gw_thread.stop()
