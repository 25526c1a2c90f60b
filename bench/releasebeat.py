"""When row 4's slow bursts come: durable-ack bursts timed, beside the releases that free terms.

    .venv/bin/python bench/releasebeat.py                          # row 4's shape at 1 KiB, 10 s
    .venv/bin/python bench/releasebeat.py --size 100 --rate 1000000
    .venv/bin/python bench/releasebeat.py --no-release --capacity 8GiB
    .venv/bin/python bench/releasebeat.py --term-length 256MiB --capacity 2GiB

Runs ``bench/ingest.py`` row 4's load in this one process (its own
``_drive_paced`` and ``_DurableReleaser``: ``--rate`` records per second of
``--size`` bytes in bursts every 1 ms, each closed by ``flush(stream)``, the
stream released to its durable end every 250 ms) against a ``headgate
serve`` subprocess, and prints, beside the bursts' p50 / p99 / max:

* every *episode* of slow bursts (at or above ``--slow-ms``, default 30;
  bursts less than 20 ms apart are one episode): when it started, in seconds
  from the start, how long it lasted, the worst burst and how many bursts;
  episodes every 0.25 s point at the releases, every term's worth of bytes
  at the terms;
* the CPU the gateway and this process used, in cores;
* the gateway's own ack-latency histogram (``headgate_ack_latency_seconds``:
  first byte of a batch to its Ack written) read from its metrics endpoint,
  which says whether the time was spent in the gateway or around it.

It found the release-beat stalls of issue 17 (BENCHMARKS.md, Ingest, "Tenth
session"): on a file system mounted with ``discard``, deleting freed terms
stalls the next group commits. Nothing here is a target; it is a probe.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ingest  # noqa: E402  (bench/ingest.py: the load and the releaser)
from headgate.client import Producer  # noqa: E402

#: Bursts closer than this belong to one episode.
EPISODE_GAP_S = 0.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _episodes(slow: list[tuple[float, float]]) -> list[tuple[float, float, float, int]]:
    """(start, end, worst, bursts) of runs of slow bursts."""
    found: list[list[float]] = []
    for began, took in slow:
        if found and began - found[-1][1] < EPISODE_GAP_S:
            last = found[-1]
            last[1], last[2], last[3] = began, max(last[2], took), last[3] + 1
        else:
            found.append([began, began, took, 1])
    return [(a, b, w, int(n)) for a, b, w, n in found]


async def probe(args: argparse.Namespace, data: Path) -> None:
    metrics_port = _free_port()
    argv = [
        *ingest._headgate_command(),
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data),
        "--stream-capacity",
        args.capacity,
        "--term-length",
        args.term_length,
        "--group-commit-ms",
        "2",
        "--group-commit-mode",
        args.group_commit_mode,
        "--metrics",
        f"127.0.0.1:{metrics_port}",
    ]
    server = ingest.Server("gateway", argv, data / "gateway.log")
    try:
        pool = ingest._pool(args.size)
        producer = Producer(("127.0.0.1", server.port), client_name="releasebeat")
        await producer.connect()
        await producer.send("s", pool[0])
        await producer.flush()
        releaser = ingest._DurableReleaser(("127.0.0.1", server.port), data / "streams" / "s", "s")
        spec = ingest.RunSpec(
            "headgate",
            "paced",
            args.size,
            server.port,
            "s",
            args.seconds,
            10**12,
            rate=args.rate,
            release=args.release,
            data_dir=str(data),
        )
        slow: list[tuple[float, float]] = []
        start = time.monotonic()

        async def timed(flush: object, began: float, out: list[float]) -> None:
            await flush  # type: ignore[misc]
            took = time.monotonic() - began
            out.append(took)
            if took * 1e3 >= args.slow_ms:
                slow.append((began - start, took))

        gateway_cpu, own_cpu = _cpu_seconds(server.pid), _cpu_seconds(os.getpid())
        ingest._timed = timed
        _, _, _, latencies = await ingest._drive_paced(
            producer.send,
            lambda: producer.flush("s"),
            spec,
            pool,
            releaser if args.release else None,
        )
        wall = time.monotonic() - start
        gateway_cores = (_cpu_seconds(server.pid) - gateway_cpu) / wall
        own_cores = (_cpu_seconds(os.getpid()) - own_cpu) / wall
        latencies.sort()

        def q(f: float) -> float:
            return latencies[min(len(latencies) - 1, int(f * len(latencies)))] * 1e3

        print(
            f"{args.size} B at {args.rate:,.0f} rec/s for {args.seconds:g} s, "
            f"{'released every 250 ms' if args.release else 'never released'}, "
            f"capacity {args.capacity}, terms {args.term_length}, {args.group_commit_mode}"
        )
        print(
            f"bursts {len(latencies)}: p50 / p99 / max {q(0.5):.2f} / {q(0.99):.2f} / "
            f"{latencies[-1] * 1e3:.2f} ms; cores: gateway {gateway_cores:.2f}, "
            f"this process {own_cores:.2f}"
        )
        episodes = _episodes(slow)
        print(f"episodes of bursts >= {args.slow_ms:g} ms: {len(episodes)}")
        for a, b, worst, count in episodes:
            print(
                f"  at {a:7.3f} s, {1e3 * (b - a):6.1f} ms long, "
                f"worst {worst * 1e3:6.1f} ms, {count} bursts"
            )
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        print("gateway's ack latency (cumulative batches by bound):")
        for line in body.read().decode().splitlines():
            if line.startswith("headgate_ack_latency_seconds_bucket") and 'stream="s"' in line:
                print("  " + line)
        await producer.close()
        releaser.close()
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="bytes per record (1024)")
    parser.add_argument(
        "--rate", type=float, default=344_300, help="records per second (344,300: half of row 1)"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="how long (10)")
    parser.add_argument("--slow-ms", type=float, default=30.0, help="a slow burst (30)")
    parser.add_argument("--capacity", default="512MiB", help="--stream-capacity (512MiB)")
    parser.add_argument("--term-length", default="16MiB", help="--term-length (16MiB)")
    parser.add_argument("--group-commit-mode", choices=("interval", "eager"), default="interval")
    parser.add_argument(
        "--release",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="release the durable end every 250 ms (default), as row 4 does",
    )
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="headgate-releasebeat-"))
    try:
        asyncio.run(probe(args, data))
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
