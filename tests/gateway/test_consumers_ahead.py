"""A consumer declared before its stream exists, against a real gateway on 127.0.0.1.

A pipeline often starts before the producers that create its streams: each
partition of a fleet, or a stream it waits for (``missing_streams =
"wait"``). The gateway keeps such a declaration in the stream's consumers
file, so the stream starts with the consumer and holds every record from
its first for it, exactly as if it had been declared the moment the stream
was created; it says nothing above INFO, and the connection goes on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from headgate.client import Producer, StreamRefused
from headgate.client.reader import Reader, ReaderRefused
from headgate.config import ConsumerSettings, StreamSettings
from headgate.gateway.consumers import consumers_file
from headgate.protocol.errors import ErrorCode
from tests.helpers import SMALL, consumers, gateway, positions, records, run

pytestmark = pytest.mark.timeout(60)


def stored(data_dir: Path, stream: str) -> dict[str, dict[str, Any]]:
    raw = json.loads(consumers_file(data_dir, stream).read_text())
    return {c["name"]: c for c in raw["consumers"]}


@pytest.mark.parametrize(
    ("consumer", "origin", "then"),
    [
        # A pipeline file's own consumer takes the implicit default's place.
        ("archive", "runtime", {"archive": 0, "other": 0}),
        # ``headgate run --gateways 3``: its pipeline releases as ``default``,
        # which stays the implicit one (a named blocking consumer takes its place).
        ("default", "default", {"other": 0}),
    ],
)
def test_a_consumer_declared_before_its_stream_holds_it_from_its_first_record_quietly(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    consumer: str,
    origin: str,
    then: dict[str, int],
) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL) as gw:
            with caplog.at_level(logging.INFO, logger="headgate"):
                async with Reader(gw.address) as reader:
                    assert await reader.declare_consumer("later", consumer) == 0
                    # Declared again (a pipeline's restart): found, not refused.
                    assert await reader.declare_consumer("later", consumer) == 0
                    # The connection goes on, and the stream is not created by it.
                    assert "later" not in [s.stream for s in await reader.list_streams()]
            assert "later" not in gw.streams
            loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert loud == []
            assert stored(tmp_path, "later")[consumer]["origin"] == origin
            async with Producer(gw.address, linger_ms=1) as p:
                for value in records("x", 40):
                    await p.send("later", value)
                await p.flush("later")
            # The stream started with the consumer, at its first record:
            # nothing is freed before it releases.
            assert positions(gw, "later") == {consumer: 0}
            assert gw.streams["later"].log.release_position == 0
            async with Reader(gw.address) as reader:
                assert await reader.declare_consumer("later", "other") == 0
            assert positions(gw, "later") == then

    run(scenario(), timeout=20)


def test_a_declaration_before_the_stream_survives_a_restart_and_keeps_the_rules(
    tmp_path: Path,
) -> None:
    settings = StreamSettings(consumers=consumers(audit=ConsumerSettings()))

    async def declare() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": settings}) as gw:
            async with Reader(gw.address) as reader:
                assert await reader.declare_consumer("s", "live", blocking=False) == 0
                assert await reader.declare_consumer("t", "live", blocking=False) == 0
            async with Reader(gw.address) as reader:
                # Other settings than declared: refused, as on a stream that exists.
                with pytest.raises(ReaderRefused) as refused:
                    await reader.declare_consumer("t", "live", blocking=True)
                assert refused.value.code is ErrorCode.UNEXPECTED_FRAME
                assert "exists with blocking=false" in refused.value.text

    async def create() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": settings}) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("s", b"v")
                await p.send("t", b"v")
                await p.flush("s")
                await p.flush("t")
            # Beside the configured consumer; beside the implicit default (a
            # non-blocking consumer does not take its place): as if declared
            # the moment each stream was created.
            assert positions(gw, "s") == {"audit": 0, "live": 0}
            assert positions(gw, "t") == {"default": 0, "live": 0}
            assert gw.streams["t"].consumers.get("live").blocking is False

    run(declare(), timeout=20)
    run(create(), timeout=20)


def test_streams_declared_ahead_count_against_max_streams(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, max_streams=2) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("a", b"v")
                await p.flush("a")
            async with Reader(gw.address) as reader:
                assert await reader.declare_consumer("b", "archive") == 0
                assert await reader.declare_consumer("b", "other", blocking=False) == 0
                with pytest.raises(ReaderRefused) as refused:
                    await reader.declare_consumer("c", "archive")
            assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
            assert "maximum of 2 streams" in refused.value.text
            assert not consumers_file(tmp_path, "c").exists()
            # Once created, the stream counts as itself, not twice.
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("b", b"v")
                await p.flush("b")
            assert positions(gw, "b") == {"archive": 0, "other": 0}

    async def raised() -> None:
        async with (
            gateway(tmp_path, **SMALL, max_streams=4) as gw,
            Reader(gw.address) as reader,
        ):
            assert await reader.declare_consumer("c", "archive") == 0

    async def restarted() -> None:
        # "c" is still declared ahead (its file says so): with "a" and "b" the
        # gateway holds its maximum again, so no other stream is kept.
        async with gateway(tmp_path, **SMALL, max_streams=3) as gw:
            async with Reader(gw.address) as reader:
                with pytest.raises(ReaderRefused) as refused:
                    await reader.declare_consumer("d", "archive")
            assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
            async with Reader(gw.address) as reader:
                assert await reader.declare_consumer("c", "other", blocking=False) == 0

    run(scenario(), timeout=20)
    run(raised(), timeout=20)
    run(restarted(), timeout=20)


def test_a_bind_cannot_take_the_slot_of_a_stream_declared_ahead(tmp_path: Path) -> None:
    """One rule for ``max_streams``: a slot is held by a stream, one still
    recovering, or one with consumers declared ahead, whoever asks (a bind or
    a DeclareConsumer). A bind of another new stream must not take the slot
    promised to the stream declared ahead, whose own bind then succeeds."""

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, max_streams=2) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("a", b"v")
                await p.flush("a")
            async with Reader(gw.address) as reader:
                assert await reader.declare_consumer("b", "archive") == 0
            async with Producer(gw.address, linger_ms=1, reconnect_timeout=5) as p:
                await p.send("c", b"v")
                with pytest.raises(StreamRefused) as refused:
                    await p.flush("c")
            assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
            assert "maximum of 2 streams" in str(refused.value)
            assert "c" not in gw.streams
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("b", b"v")
                await p.flush("b")
            assert positions(gw, "b") == {"archive": 0}

    run(scenario(), timeout=20)
