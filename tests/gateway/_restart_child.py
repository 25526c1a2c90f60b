"""A gateway stream's life before a restart, run in its own process so that it can be SIGKILLed.

    python -m tests.gateway._restart_child DATA_DIR BATCHES SNAPSHOT_EVERY UNSYNCED kill|close

Appends BATCHES one-record batches of producer 7 through ``Stream.append``
(as the gateway does), with a group commit after every ``SYNC_EVERY``, except
that the last UNSYNCED are never committed; snapshots are written every
SNAPSHOT_EVERY bytes of durable log. Then the process kills itself with
SIGKILL, or closes the stream cleanly.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from headgate.gateway import dedup
from headgate.gateway.streams import AppendOutcome, Stream, Writer
from headgate.protocol.records import encode_records

PRODUCER = 7
SYNC_EVERY = 10
TERM_LENGTH = 64 * 1024


def open_stream(data_dir: Path) -> Stream:
    return Stream.open(
        "s", data_dir, capacity=64 * TERM_LENGTH, term_length=TERM_LENGTH, max_message_size=4096
    )


def make_writer() -> Writer:
    session: Any = SimpleNamespace(send_global=lambda message: None)
    return Writer(
        session=session,
        stream="s",
        flush=lambda: None,
        handle=1,
        producer_id=PRODUCER,
        last_active=0.0,
    )


def send(stream: Stream, writer: Writer, sequence: int) -> AppendOutcome:
    """The batch of ``sequence``: the same bytes every time it is sent."""
    records = memoryview(encode_records([b"record %d" % sequence]))
    return stream.append(writer, sequence, 1, records, now=0.0, timestamp_us=0, in_channel=False)


def main() -> None:
    data_dir, batches, every, unsynced, end = sys.argv[1:]
    setattr(dedup, "SNAPSHOT_EVERY_BYTES", int(every))  # noqa: B010 (a Final, for the test)
    stream = open_stream(Path(data_dir))
    writer = make_writer()
    first = stream.dedup.get(PRODUCER, 0)
    count = int(batches)
    for i in range(count):
        assert send(stream, writer, first + i) is AppendOutcome.STORED
        if (i + 1) % SYNC_EVERY == 0 and i < count - int(unsynced):
            stream.log.sync()
            stream.on_durable()
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    stream.close()


if __name__ == "__main__":
    main()
