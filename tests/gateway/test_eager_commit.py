"""group_commit_mode = "eager": a commit starts when the one before is done and a batch waits."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path

import pytest

from headgate.config import ConfigError, GatewayConfig, load_gateway_config
from headgate.gateway import Gateway
from headgate.log.errors import storage_error
from headgate.protocol import messages as m
from headgate.protocol.records import encode_records
from tests.helpers import RawPeer, config, send_batches

pytestmark = pytest.mark.timeout(60)

#: Far longer than a commit: under "interval" every batch would wait for it.
LONG_INTERVAL_MS = 1000.0
BATCHES = 5


async def test_each_batch_is_acked_without_waiting_for_the_interval(tmp_path: Path) -> None:
    gw = Gateway(
        config(tmp_path, group_commit_interval_ms=LONG_INTERVAL_MS, group_commit_mode="eager")
    )
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("eager")
        await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
        started = time.monotonic()
        # One batch at a time, each sent after the one before was acked: with
        # commits every interval this takes about BATCHES intervals.
        for i in range(BATCHES):
            await send_batches_from(peer, h, i)
        elapsed = time.monotonic() - started
        assert elapsed < LONG_INTERVAL_MS / 1000 / 2, f"{BATCHES} acks took {elapsed:.3f} s"
        await peer.close()
    finally:
        await gw.stop()


async def send_batches_from(peer: RawPeer, handle: int, index: int) -> None:
    """One batch of two records, numbered after ``index`` earlier ones; wait for its Ack."""
    await peer.until(lambda: peer.session.can_send_batch(handle, 40))
    peer.session.send_batch(handle, 2 * index, encode_records([b"r" * 10, b"s" * 10]))
    await peer.send()
    await peer.until(lambda: peer.acked(handle) == 2 * (index + 1))


async def test_a_failing_disk_is_retried_once_per_interval_not_in_a_loop(tmp_path: Path) -> None:
    interval_ms = 50.0
    gw = Gateway(config(tmp_path, group_commit_interval_ms=interval_ms, group_commit_mode="eager"))
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("failing")
        await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
        await send_batches(peer, h, 1)
        stream_log = gw.streams["failing"].log
        attempts = 0

        def failing_sync() -> int:
            nonlocal attempts
            attempts += 1
            raise storage_error("injected", tmp_path, OSError(errno.EIO, "EIO"))

        stream_log.sync = failing_sync  # type: ignore[method-assign]
        try:
            peer.session.send_batch(h, 2, encode_records([b"r" * 10, b"s" * 10]))
            await peer.send()
            await asyncio.sleep(0.5)
        finally:
            del stream_log.sync  # the real one again, so that stop() can sync
        # About 0.5 s / 50 ms = 10 tries; a loop without the interval makes thousands.
        assert 1 <= attempts <= 20, attempts
        assert peer.acked(h) == 2  # nothing acked that is not durable
        await peer.close()
    finally:
        await gw.stop()


def test_the_mode_is_checked_in_the_file_and_in_the_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="group_commit_mode"):
        GatewayConfig(group_commit_mode="soon").validate()
    good = tmp_path / "good.toml"
    good.write_text('[gateway]\ngroup_commit_mode = "eager"\n')
    assert load_gateway_config(good).group_commit_mode == "eager"
    bad = tmp_path / "bad.toml"
    bad.write_text('[gateway]\ngroup_commit_mode = "sometimes"\n')
    with pytest.raises(ConfigError, match="interval, eager"):
        load_gateway_config(bad)
