"""The producer's send-to-durable-ack percentiles in ``statistics()``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from headgate.client import Producer, SyncProducer
from tests.helpers import GatewayProcess, gateway, run

pytestmark = pytest.mark.timeout(30)

LINGER_S = 0.03


def test_the_latency_runs_from_the_first_send_through_the_linger_to_the_ack(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path) as gw, Producer(gw.address, linger_ms=LINGER_S * 1000) as p:
            await p.send("timed", b"warm-up")  # binds the stream
            await p.flush()
            loop = asyncio.get_running_loop()
            stats = p.statistics().streams["timed"]
            assert stats.ack_latency_batches == 1
            warm_up = stats.ack_latency_max  # the bind's round trip included
            assert warm_up is not None and stats.ack_latency_p50 == warm_up

            started = loop.time()
            await p.send("timed", b"one")
            await p.send("timed", b"two")  # same batch: sealed by the linger
            for _ in range(300):
                if p.statistics().streams["timed"].records_acked == 3:
                    break
                await asyncio.sleep(0.005)
            elapsed = loop.time() - started
            stats = p.statistics().streams["timed"]
            assert stats.records_acked == 3
            assert stats.ack_latency_batches == 2
            low, high = stats.ack_latency_p50, stats.ack_latency_max
            assert low is not None and high is not None and low <= high
            assert stats.ack_latency_p99 == high  # of two batches, the p99 is the max
            timed = low if high == warm_up else high
            # The lingering batch waited at least the linger, from its first send().
            assert LINGER_S <= timed <= elapsed

    run(scenario())


def test_send_many_batches_are_timed_and_nothing_before_an_ack(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            gateway(tmp_path, max_message_size=16 * 1024) as gw,
            Producer(gw.address, linger_ms=50) as p,
        ):
            await p.send("many", b"first")  # in the open batch, lingering
            stats = p.statistics().streams["many"]
            assert stats.records_acked == 0
            assert stats.ack_latency_batches == 0 and stats.ack_latency_p50 is None
            assert stats.ack_latency_p99 is None and stats.ack_latency_max is None

            await (await p.send_many("many", [b"x" * 1000] * 100))  # several batches, after it
            stats = p.statistics().streams["many"]
            assert stats.records_acked == 101
            (stored,) = [s for s in gw.statistics() if s.name == "many"]
            assert stored.appended_batches >= 3
            assert stats.ack_latency_batches == stored.appended_batches  # each batch once
            assert stats.ack_latency_p50 is not None and stats.ack_latency_p99 is not None
            assert 0 < stats.ack_latency_p50 <= stats.ack_latency_p99 <= 5.0

    run(scenario())


def test_the_sync_producer_reports_the_same_percentiles(tmp_path: Path) -> None:
    served = GatewayProcess(tmp_path)
    address = served.start()
    try:
        with SyncProducer(address, linger_ms=1) as p:
            started = time.monotonic()
            for i in range(4):  # four batches, each flushed on its own
                p.send("sync", b"record-%d" % i)
                p.flush(timeout=8)
            elapsed = time.monotonic() - started
            stats = p.statistics().streams["sync"]
            assert stats.records_acked == 4
            assert stats.ack_latency_batches == 4
            p50, p99, worst = stats.ack_latency_p50, stats.ack_latency_p99, stats.ack_latency_max
            assert p50 is not None and p99 is not None and worst is not None
            # Ordered, each a real wait, none longer than the four round trips together.
            assert 0 < p50 <= p99 <= worst <= elapsed
    finally:
        served.stop()
