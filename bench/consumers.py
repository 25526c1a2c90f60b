"""Benchmark: producer rate and gateway memory with 1, 2 and 4 blocking consumers.

    .venv/bin/python bench/consumers.py             # 2M records per case
    .venv/bin/python bench/consumers.py --quick     # 300k records per case
    .venv/bin/python bench/consumers.py --release-every-ms 100   # a calmer pace

A ``headgate serve`` subprocess on loopback, its TOML declaring one stream
per case: ``cN`` has N blocking consumers (``k0`` .. ``kN-1``) and one
non-blocking consumer, ``stalled`` (``on_data_loss = "skip"``), that never
releases anything. One producer (in this process) sends 100-byte records with
``send_many`` (lists of 10,000) into a log of 64 MiB, several times smaller
than what a case writes (not with ``--quick``), so the producer lives on
released credit. Each blocking consumer keeps up as a fast Spark pipeline
does (a micro-batch costs about 0.3 s): it reads the durable position of the
stream's log from the data directory every 20 ms (``--release-every-ms``)
and releases it under its own name over its own connection: with 4
consumers, 200 Releases a second, each of which moves a consumer (the
gateway stores them off its event loop, coalesced). The gateway runs without a tokens file, so
every connection of this process shares one address's work budget: it is
raised to 1000 ms/s, so that the consumers' Releases (charged to them) do
not take the producer's budget, which separate tokens avoid in a deployment. The rate counts
only records acknowledged durable; each case is reported as a ratio to the
1-consumer case of the same run (target: at least 0.9 with 4 consumers).
The gateway's anonymous RSS (RssAnon: its own memory, not the page cache of
the mapped log) is sampled every 50 ms from ``/proc`` (target: flat,
whatever the number of consumers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # tail.py: how the benchmarks sample a gateway's own memory

from headgate.client import Producer  # noqa: E402
from headgate.client.reader import Reader  # noqa: E402
from headgate.log import LogReader  # noqa: E402
from tail import RssSampler, rss_kib  # noqa: E402

RECORD = b"x" * 100
CHUNK = 10_000
CASES = (1, 2, 4)
RELEASE_EVERY_S = 0.02


def gateway_toml(data: Path) -> str:
    lines = [
        "[gateway]",
        f'data_dir = "{data}"',
        'listen = "127.0.0.1:0"',
        'stream_capacity = "64MiB"',
        'term_length = "16MiB"',
        "group_commit_interval_ms = 2.0",
        "work_budget_ms = 1000",  # one address's budget for all (see the docstring)
    ]
    for stream in ["warm-up", *(f"c{n}" for n in CASES)]:
        count = 1 if stream == "warm-up" else int(stream[1:])
        for index in range(count):
            lines += [f'[streams."{stream}".consumers.k{index}]', "blocking = true"]
        lines += [
            f'[streams."{stream}".consumers.stalled]',
            "blocking = false",
            'on_data_loss = "skip"',
        ]
    return "\n".join(lines) + "\n"


async def keep_up(address: str, data: Path, stream: str, name: str, done: asyncio.Event) -> int:
    """Release the stream's durable end as consumer ``name`` until ``done``; the releases sent."""
    sent = 0
    directory = data / "streams" / stream
    async with Reader(address, client_name=f"bench-{name}") as reader:
        while not directory.exists() and not done.is_set():
            await asyncio.sleep(RELEASE_EVERY_S)
        log = None
        released = 0
        while not done.is_set():
            if log is None:
                with contextlib.suppress(Exception):  # still being created
                    log = LogReader.open(directory)
            if log is not None:
                durable = int(log.durable_position())
                if durable > released:
                    await reader.release(stream, durable, name)
                    released = durable
                    sent += 1
            await asyncio.sleep(RELEASE_EVERY_S)
        if log is not None:
            log.close()
    return sent


async def one_case(
    address: str, data: Path, stream: str, consumers: int, records: int
) -> tuple[float, int]:
    """Durable records/s of one producer on ``stream`` while ``consumers`` keep up."""
    done = asyncio.Event()
    tasks = [
        asyncio.create_task(keep_up(address, data, stream, f"k{i}", done)) for i in range(consumers)
    ]
    try:
        async with Producer(address, client_name="bench-consumers") as producer:
            batch = [RECORD] * CHUNK
            started = time.monotonic()
            for _ in range(max(1, records // CHUNK)):
                await producer.send_many(stream, batch)
            await producer.flush()
            elapsed = time.monotonic() - started
    finally:
        done.set()
        sent = sum(await asyncio.gather(*tasks))
    return max(1, records // CHUNK) * CHUNK / elapsed, sent


async def main_async(args: argparse.Namespace, address: str, pid: int, data: Path) -> None:
    await one_case(address, data, "warm-up", 1, args.records // 2)
    base_rss = rss_kib(pid)
    print(f"gateway anon RSS after the warm-up: {base_rss / 1024:8.1f} MiB")
    print(
        f"{'blocking consumers':>20} {'records/s':>12} {'ratio':>7} "
        f"{'releases':>9} {'peak anon RSS MiB':>18}"
    )
    first: float | None = None
    for consumers in CASES:
        sampler = RssSampler(pid)
        sampler.start()
        rate, releases = await one_case(address, data, f"c{consumers}", consumers, args.records)
        sampler.stop.set()
        sampler.join()
        first = first or rate
        print(
            f"{consumers:>20} {rate:>12,.0f} {rate / first:>7.2f} "
            f"{releases:>9} {sampler.peak / 1024:>18.1f}"
        )
    print("(each case also has one stalled non-blocking consumer that never releases)")


def main() -> None:
    global RELEASE_EVERY_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300k records per case")
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument(
        "--release-every-ms", type=float, default=RELEASE_EVERY_S * 1000, help="consumers' pace"
    )
    args = parser.parse_args()
    RELEASE_EVERY_S = args.release_every_ms / 1000
    if args.quick:
        args.records = 300_000
    root = Path(tempfile.mkdtemp(prefix="headgate-bench-consumers-"))
    data = root / "data"
    config = root / "gateway.toml"
    config.write_text(gateway_toml(data))
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
        asyncio.run(main_async(args, line.split()[-1], proc.pid, data))
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
