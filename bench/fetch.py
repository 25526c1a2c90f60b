"""Benchmark: reading a stream through the gateway (Fetch) beside reading its log locally.

    .venv/bin/python bench/fetch.py

An in-process gateway on loopback holds 600,000 records of 100 bytes, written
with ``send_many``. A :class:`~headgate.client.reader.SyncReader` (what a Spark
executor uses) fetches the whole stream, paced by its guarantees; the baseline
is a :class:`~headgate.log.LogReader` on the same log files, as a local Spark
read does. Neither decodes records: the figure is what the transport delivers
to the decoder.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from headgate.cli.demo import BackgroundLoop
from headgate.client import Producer
from headgate.client.reader import SyncReader
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.log import LogReader

RECORDS = 600_000
CHUNK = 10_000


def main() -> None:
    data = Path(tempfile.mkdtemp(prefix="headgate-bench-fetch-"))
    loop = BackgroundLoop("bench-gateway")
    gateway = Gateway(
        GatewayConfig(
            listen=("127.0.0.1", 0),
            data_dir=data,
            stream_capacity=512 << 20,
            term_length=64 << 20,
        )
    )
    loop.run(gateway.start(), 30)
    address = f"127.0.0.1:{gateway.address[1]}"

    async def fill() -> None:
        async with Producer(address) as producer:
            for _ in range(RECORDS // CHUNK):
                await producer.send_many("s", [b"x" * 100] * CHUNK)
            await producer.flush()

    try:
        loop.run(fill(), 300)
        with SyncReader(address) as reader:
            (info,) = reader.list_streams()
            started = time.monotonic()
            records = 0
            for batch in reader.fetch("s", 0, info.durable_position):
                records += batch.record_count
            remote = time.monotonic() - started
        assert records == RECORDS
        with LogReader.open(data / "streams" / "s") as log:
            started = time.monotonic()
            position = records = 0
            while position < info.durable_position:
                frames = log.read(position, info.durable_position, max_bytes=4 << 20)
                records += sum(f.record_count for f in frames)
                position = frames[-1].end_position
            local = time.monotonic() - started
        assert records == RECORDS
        size = info.durable_position / 1e6
        for what, seconds in (("fetch through the gateway", remote), ("local LogReader", local)):
            rate, mb = RECORDS / seconds, size / seconds
            print(f"{what:26} {rate:12,.0f} records/s {mb:7.0f} MB/s")
    finally:
        loop.run(gateway.stop(), 30)
        loop.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
