"""HEADGATE_COMMIT_TRACE: each group commit's phases and each acked batch, as JSON lines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from headgate.gateway import Gateway
from headgate.gateway.commit_trace import TRACE_ENV
from headgate.protocol import messages as m
from tests.helpers import RawPeer, config, send_batches

pytestmark = pytest.mark.timeout(60)


async def test_the_trace_has_every_commit_in_order_and_every_acked_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    gw = Gateway(config(tmp_path))
    await gw.start()
    started = time.monotonic()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("traced")
        await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
        await send_batches(peer, h, 12)
        await peer.close()
    finally:
        await gw.stop()
    ended = time.monotonic()

    events = [json.loads(line) for line in path.read_text().splitlines()]
    header = events[0]
    assert header["trace"] == 1 and header["interval_s"] == pytest.approx(0.001)
    assert header["term_length"] == 64 * 1024
    commits = [e for e in events if "commit" in e]
    acks = [e for e in events if "acks" in e and e["stream"] == "traced"]
    assert [c["commit"] for c in commits] == list(range(1, len(commits) + 1))
    for c in commits:
        # Each phase begins where the one before it ended, within the run.
        assert started <= c["woke"] <= c["thread"] <= c["synced"] <= c["resumed"] <= c["done"]
        assert c["done"] <= ended
        if c["due"] is not None:  # an interval's commit (not the one at stop)
            assert c["due"] <= c["woke"]
    # Every batch once, acked after it arrived, by a commit that synced its stream.
    arrivals = [a for e in acks for a in e["arrived"]]
    assert len(arrivals) == 12
    by_number = {c["commit"]: c for c in commits}
    for e in acks:
        commit = by_number[e["acks"]]
        assert commit["resumed"] <= e["at"] <= commit["done"]
        assert all(a <= e["at"] for a in e["arrived"])
        assert "traced" in [name for name, _, _ in commit["streams"]]


async def test_without_the_variable_there_is_no_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        assert gw._trace is None
    finally:
        await gw.stop()


async def test_a_trace_that_cannot_be_written_is_a_warning_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "no-such-directory" / "trace.jsonl"))
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        assert gw._trace is None
        assert "cannot write the commit trace" in caplog.text
    finally:
        await gw.stop()
