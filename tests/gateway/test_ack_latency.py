"""``headgate_ack_latency_seconds``: each acked batch, from its arrival to its durable Ack."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from headgate.cli.top import ack_quantiles, as_json, fetch
from headgate.gateway import Gateway
from headgate.gateway.statistics import ACK_LATENCY_BUCKETS, LatencyHistogram
from headgate.protocol import messages as m
from tests.helpers import RawPeer, config, send_batches

pytestmark = pytest.mark.timeout(60)

#: How long the disk takes per sync in the slow-disk test.
SLOW_SYNC_S = 0.03


def ack_histogram(text: str, stream: str) -> dict[str, float]:
    """The stream's ack latency samples: ``le`` values, ``count`` and ``sum``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "headgate_ack_latency_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("stream") != stream:
                continue
            if sample.name.endswith("_bucket"):
                out[sample.labels["le"]] = sample.value
            else:
                out[sample.name.rsplit("_", 1)[1]] = sample.value
    return out


async def scrape_text(gateway: Gateway) -> str:
    assert gateway.metrics_address is not None
    host, port = gateway.metrics_address

    def get() -> str:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    return await asyncio.to_thread(get)


async def test_each_acked_batch_is_one_observation_bounded_by_the_time_it_waited(
    tmp_path: Path,
) -> None:
    gw = Gateway(config(tmp_path, metrics=("127.0.0.1", 0)))
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("timed")
        await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
        before = ack_histogram(await scrape_text(gw), "timed")
        assert before["count"] == 0 and before["sum"] == 0

        started = time.monotonic()
        await send_batches(peer, h, 10)
        elapsed = time.monotonic() - started

        after = ack_histogram(await scrape_text(gw), "timed")
        assert after["count"] == 10
        # No batch waited longer than the whole exchange took.
        assert 0 < after["sum"] <= 10 * elapsed
        assert after["+Inf"] == 10
        bounds = [le for le in after if le not in ("+Inf", "count", "sum")]
        assert [float(le) for le in bounds] == list(ACK_LATENCY_BUCKETS)
        cumulative = [after[le] for le in bounds]
        assert cumulative == sorted(cumulative)

        # headgate top reads the same histogram: p50 and p99 of those 10 batches.
        assert gw.metrics_address is not None
        seen = await asyncio.to_thread(fetch, gw.metrics_address)
        p50, p99 = ack_quantiles(seen, None, "timed")
        assert p50 is not None and p99 is not None
        assert 0 < p50 <= p99 <= 1.0
        assert as_json(seen)["streams"]["timed"]["ack_latency_p99_seconds"] == p99  # type: ignore[index]
        await peer.close()
    finally:
        await gw.stop()


async def test_the_latency_includes_a_slow_fsync(tmp_path: Path) -> None:
    # group commit every 1 ms, but each sync takes SLOW_SYNC_S: no batch can be
    # acked sooner than that after it arrived.
    gw = Gateway(config(tmp_path, metrics=("127.0.0.1", 0)))
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("slow")
        stream_log = gw.streams["slow"].log
        fast_sync = stream_log.sync

        def slow_sync() -> int:
            time.sleep(SLOW_SYNC_S)
            return fast_sync()

        stream_log.sync = slow_sync  # type: ignore[method-assign]
        await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
        await send_batches(peer, h, 5)
        after = ack_histogram(await scrape_text(gw), "slow")
        assert after["count"] == 5
        assert after["sum"] >= 5 * SLOW_SYNC_S
        assert after["0.02"] == 0  # every one above 20 ms
        await peer.close()
    finally:
        await gw.stop()


def test_the_histogram_counts_at_the_bucket_bound_as_prometheus_does() -> None:
    histogram = LatencyHistogram(ACK_LATENCY_BUCKETS)
    histogram.observe_since([-0.0001, -0.001, -0.0015, -0.002, -2.0], now=0.0)
    cumulative = dict(histogram.cumulative())
    assert cumulative["0.0005"] == 1
    assert cumulative["0.001"] == 2  # exactly 1 ms: in the le=0.001 bucket
    assert cumulative["0.002"] == 4
    assert cumulative["1.0"] == 4 and cumulative["+Inf"] == 5
    assert histogram.count == 5
    assert histogram.total == pytest.approx(0.0001 + 0.001 + 0.0015 + 0.002 + 2.0)
