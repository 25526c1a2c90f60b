"""A stream nobody releases costs the gateway no memory per batch stored in it.

Under the credit policy a batch's channel space is freed only when the
consumer releases the log past it. The gateway used to keep two small entries
per such batch (one in the stream, one in the channel's buffer), so a writer
of one-record batches within its guarantees, to a large stream that no
consumer releases, grew a real ``headgate serve``'s heap by about 80 MB per
460,000 batches. Now batches wait as runs (``UnreleasedRuns``), and the
heap stays flat however many batches the log holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from headgate.costs import batch_cost
from headgate.protocol import messages as m
from headgate.protocol.records import encode_records
from headgate.protocol.session import AckReceived, Role, Session
from tests.serving import serve, stop

pytestmark = pytest.mark.timeout(300)

MiB = 1024 * 1024
STREAM = "flood"
#: Batches stored before the first measure (the gateway's steady state) ...
WARM_UP = 50_000
#: ... and after it: each a single record, as small as a batch gets.
BATCHES = 550_000
#: The heap may grow this much over those batches (allocator noise); the old
#: books grew it by about 90 MiB.
MAX_GROWTH = 8 * MiB
RECORDS = encode_records([b"r"])
COST = batch_cost(m.BATCH_HEADER_SIZE + len(RECORDS))


def rss_anon(pid: int) -> int:
    """The process's anonymous resident memory (its heap, not the mapped logs), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc status")


class OneRecordWriter:
    """A producer of one-record batches within its guarantees, over raw frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.session = Session(Role.PRODUCER, data_cost=batch_cost)
        self.handle = -1
        self.sequence = 0
        self.acked = 0

    @classmethod
    async def open(cls, address: str) -> OneRecordWriter:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        self = cls(reader, writer)
        self.session.send_global(m.Hello(producer_id=99, client_name="flood"))
        await self._flush()
        deadline = time.monotonic() + 10
        while self.handle < 0:
            assert time.monotonic() < deadline, "no bind guarantees within 10 s"
            handle = self.session.bind_stream(STREAM)
            if handle is not None:
                self.handle = handle
            else:
                await self._read()
        await self._flush()
        return self

    async def _flush(self) -> None:
        self.writer.write(self.session.data_to_send())
        await self.writer.drain()

    async def _read(self, timeout: float = 10) -> None:
        data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
        assert data, "the gateway closed the connection"
        for event in self.session.receive_data(data):
            if isinstance(event, AckReceived):
                self.acked = max(self.acked, event.ack.next_sequence)
        await self._flush()

    async def write(self, batches: int) -> None:
        """Send ``batches`` more batches, as fast as the guarantees allow; wait for their acks."""
        end = self.sequence + batches
        deadline = time.monotonic() + 240
        while self.sequence < end:
            assert time.monotonic() < deadline, f"stuck at {self.sequence} of {end}"
            sent = 0
            while (
                self.sequence < end
                and sent < 2000
                and self.session.can_send_batch(self.handle, len(RECORDS))
            ):
                assert self.session.send_batch(self.handle, self.sequence, RECORDS)
                self.sequence += 1
                sent += 1
            if sent:
                await self._flush()
            if not sent:
                await self._read()
            else:
                # Take what the gateway sent meanwhile (guarantees, acks).
                with contextlib.suppress(TimeoutError):
                    await self._read(timeout=0.001)
        while self.acked < end:
            assert time.monotonic() < deadline, f"acked {self.acked} of {end}"
            await self._read()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def test_a_stream_nobody_releases_keeps_the_gateways_memory_flat(tmp_path: Path) -> None:
    # Room for every batch: the writer is never short of credit, only the
    # consumer never releases.
    capacity = 2 * (WARM_UP + BATCHES) * COST + 64 * MiB
    proc, address = serve(tmp_path / "data", "--stream-capacity", f"{capacity // MiB}MiB")
    try:

        async def flood() -> tuple[int, int]:
            writer = await OneRecordWriter.open(address)
            try:
                await writer.write(WARM_UP)
                before = rss_anon(proc.pid)
                await writer.write(BATCHES)
                return before, rss_anon(proc.pid)
            finally:
                await writer.close()

        before, after = asyncio.run(flood())
    finally:
        stop(proc)
    assert after - before < MAX_GROWTH, (
        f"the gateway's heap grew {(after - before) / MiB:.1f} MiB over {BATCHES} "
        f"unreleased batches ({before / MiB:.1f} -> {after / MiB:.1f} MiB)"
    )
