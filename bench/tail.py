"""Benchmark: producer rate and gateway memory with many stalled tail subscribers.

    .venv/bin/python bench/tail.py                 # 100 subscribers, 3M records per phase
    .venv/bin/python bench/tail.py --quick         # 1M records per phase

A ``headgate serve`` subprocess on loopback; one producer (in this process)
sends 100-byte records with ``send_many`` (lists of 10,000), and the rate
counts only records acknowledged durable. Each phase writes its own stream,
well inside its capacity (nothing is released). Phase 1 has no subscribers.
Phase 2 first attaches N subscribers to its stream that
Subscribe from now, grant 1 MiB of guarantees each, and then never read their
sockets again: the worst a tail can do. The gateway must skip batches for
them (Missed) without slowing the producer, and its memory must stay within
its per-subscriber socket backlog bound (``readers.MAX_BACKLOG``) times N.
The gateway's anonymous RSS (RssAnon: its own memory, not the page cache
of the mapped log) is sampled every 50 ms from ``/proc``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from headgate.client import Producer
from headgate.costs import batch_cost
from headgate.gateway.readers import MAX_BACKLOG
from headgate.protocol import messages as m
from headgate.protocol.session import Role, Session, StreamBound

RECORD = b"x" * 100
CHUNK = 10_000


def rss_kib(pid: int) -> int:
    """Anonymous RSS: the gateway's own memory, without the log's mapped file pages
    (those are page cache, which grows with what was written, subscribers or not)."""
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"RssAnon:\s+(\d+) kB", text)
    return int(match.group(1)) if match else 0


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_kib(self.pid))
            time.sleep(0.05)


async def produce(address: str, stream: str, records: int) -> float:
    """Records per second acknowledged durable, for ``records`` records."""
    async with Producer(address, client_name="bench-tail") as producer:
        batch = [RECORD] * CHUNK
        started = time.monotonic()
        for _ in range(max(1, records // CHUNK)):
            await producer.send_many(stream, batch)
        await producer.flush()
        return max(1, records // CHUNK) * CHUNK / (time.monotonic() - started)


async def stalled_subscriber(
    host: str, port: int, stream: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Subscribe, grant 1 MiB, then never read again (the caller keeps the socket)."""
    reader, writer = await asyncio.open_connection(host, port, limit=64 * 1024)
    session = Session(Role.PRODUCER, data_cost=batch_cost)
    session.send_global(m.Hello(producer_id=0, client_name="stalled"))
    writer.write(session.data_to_send())
    bound = None
    while bound is None:
        data = await reader.read(65536)
        if not data:
            raise RuntimeError("the gateway closed a subscriber")
        for event in session.receive_data(data):
            if event.__class__.__name__ == "WelcomeReceived":
                session.grant(m.STREAM_CHANNEL, 4096)
                session.send_global(m.Subscribe(stream=stream, start=m.StartAt.NOW))
            if isinstance(event, StreamBound):
                bound = event.handle
        writer.write(session.data_to_send())
    session.grant(m.data_channel(bound), 1 << 20)
    writer.write(session.data_to_send())
    await writer.drain()
    return reader, writer


async def main_async(args: argparse.Namespace, address: str, pid: int) -> None:
    host, port = address.rsplit(":", 1)
    await produce(address, "warm-up", args.records // 2)
    await produce(address, "tailed", CHUNK)  # the stream exists, to subscribe to
    base_rss = rss_kib(pid)
    sampler = RssSampler(pid)
    sampler.start()
    alone = await produce(address, "alone", args.records)
    peak_alone = sampler.peak
    subscribers = [
        await stalled_subscriber(host, int(port), "tailed") for _ in range(args.subscribers)
    ]
    sampler.peak = 0
    with_tails = await produce(address, "tailed", args.records)
    peak_tails = sampler.peak
    sampler.stop.set()
    # Each stalled subscriber may hold the backlog bound plus the one message
    # that crossed it (at most max_message_size, 1 MiB by default).
    budget_kib = base_rss + args.subscribers * (MAX_BACKLOG + (1 << 20)) // 1024
    print(f"records/s, no subscribers:              {alone:12,.0f}")
    print(f"records/s, {args.subscribers} stalled subscribers:     {with_tails:12,.0f}")
    print(f"  ratio:                                {with_tails / alone:12.2f}")
    print(f"gateway anon RSS before the runs:        {base_rss / 1024:12.1f} MiB")
    print(f"gateway peak anon RSS, no subscribers:  {peak_alone / 1024:12.1f} MiB")
    print(f"gateway peak anon RSS, stalled subs:    {peak_tails / 1024:12.1f} MiB")
    print(
        f"  bound (before + {args.subscribers} x ({MAX_BACKLOG // 1024} KiB backlog + 1 MiB)): "
        f"{budget_kib / 1024:.1f} MiB"
    )
    for _, writer in subscribers:
        writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M records per phase")
    parser.add_argument("--records", type=int, default=3_000_000)
    parser.add_argument("--subscribers", type=int, default=100)
    args = parser.parse_args()
    if args.quick:
        args.records = 1_000_000
    data = Path(tempfile.mkdtemp(prefix="headgate-bench-tail-"))
    config = data / "gateway.toml"
    config.write_text(
        f'[gateway]\ndata_dir = "{data / "data"}"\nlisten = "127.0.0.1:0"\n'
        'stream_capacity = "2GiB"\nterm_length = "64MiB"\ngroup_commit_interval_ms = 2.0\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "headgate.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            raise SystemExit(f"the gateway did not start: {line!r}")
        asyncio.run(main_async(args, line.split()[-1], proc.pid))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
