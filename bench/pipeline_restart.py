"""What the time from a pipeline's restart to its producers' resuming is made of.

A gateway (in this process) with one stream whose log is full: a producer
filled it while ``headgate pipeline`` was killed (SIGKILL, after it had
committed a few batches). The pipeline is then started again, and this
script stamps, from the moment the process is spawned:

* ``queries started``: Spark is up and every query has been started (the
  command's "reading ... from" line);
* each Release the gateway applies (its release position moves), which is
  what gives the producer credit back;
* each ``commits/N`` the checkpoint gains (a batch committed), and the delay
  from that file to the Release of the same position;
* the producer's first acknowledgement after the restart.

    .venv/bin/python bench/pipeline_restart.py --capacity 64MiB --max-records 200000

Not a test: it prints a timeline and a breakdown.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from headgate.cli.demo import BackgroundLoop
from headgate.client import SyncProducer
from headgate.config import GatewayConfig, parse_size
from headgate.gateway import Gateway

STREAM = "full"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="64MiB", help="the stream log's capacity")
    parser.add_argument("--value-bytes", type=int, default=200)
    parser.add_argument("--max-records", type=int, default=None, help="max_records_per_trigger")
    parser.add_argument(
        "--lost-release",
        action="store_true",
        help="the killed run's releases never reached the gateway (it had no address)",
    )
    parser.add_argument("--dir", default=None, help="work directory (default: a new temp one)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="hg-restart-"))
    data = work / "data"
    capacity = parse_size(args.capacity, what="--capacity")
    loop = BackgroundLoop("bench-gateway")
    gateway = Gateway(
        GatewayConfig(
            listen=("127.0.0.1", 0),
            data_dir=data,
            term_length=4 * 1024 * 1024,
            stream_capacity=capacity,
        )
    )
    loop.run(gateway.start(), 30)
    host, port = gateway.address
    address = f"{host}:{port}"

    def release_position() -> int:
        async def read() -> int:
            return next(s.release_position for s in gateway.statistics() if s.name == STREAM)

        value: int = loop.run(read(), 10)
        return value

    config = work / "pipeline.toml"
    limit = "" if args.max_records is None else f"max_records_per_trigger = {args.max_records}\n"
    stream = f"[streams.{STREAM}]\nformat = 'raw'\ntrigger_seconds = 1.0\n{limit}"
    config.write_text(f'data_dir = "{data}"\ngateway = "{address}"\n' + stream)
    first_config = work / "first.toml"
    first_config.write_text(f'data_dir = "{data}"\n' + stream if args.lost_release else "")
    checkpoint = data / "checkpoints" / STREAM / "commits"
    producer = SyncProducer(address, producer_id=5, connect_timeout=10)
    value = b"v" * args.value_bytes
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            producer.send_many(STREAM, [value] * 500)

    threading.Thread(target=produce, daemon=True).start()

    def acked() -> int:
        return producer.statistics().streams[STREAM].records_acked

    # 1. A first run that commits a few batches, then dies.
    first = spawn(first_config if args.lost_release else config, work / "run-1.log")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and count(checkpoint) < 3:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    # 2. The log fills up while nothing reads it.
    last, since = -1, time.monotonic()
    while time.monotonic() - since < 3.0:
        now_acked = acked()
        if now_acked != last:
            last, since = now_acked, time.monotonic()
        time.sleep(0.2)
    stored = gateway_tail(loop, gateway) - release_position()
    print(f"log full: {stored / 2**20:.1f} MiB unreleased, {last:,} records acked")
    # 3. The restart, timed.
    commits_before = count(checkpoint)
    release_before = release_position()
    t0 = time.monotonic()
    second = spawn(config, work / "run-2.log")
    events: list[tuple[float, str]] = []
    started = resumed = spark = None
    seen_commits = commits_before
    seen_release = release_before
    deadline = t0 + 600
    while time.monotonic() < deadline and second.poll() is None:
        now = time.monotonic() - t0
        text = (work / "run-2.log").read_text()
        if spark is None and "starting Spark" in text:
            spark = now
            events.append((now, "the command runs (Python and imports up)"))
        if started is None and "reading " in text:
            started = now
            events.append((now, "queries started"))
        position = release_position()
        if position != seen_release:
            seen_release = position
            events.append((now, f"release applied at position {position:,}"))
        for batch in new_commits(checkpoint, seen_commits):
            events.append((now, f"commits/{batch} written"))
        seen_commits = count(checkpoint)
        if resumed is None and acked() > last:
            resumed = now
            events.append((now, "producer acknowledged again"))
        if resumed is not None and seen_commits >= commits_before + 2:
            break
        time.sleep(0.02)
    second.send_signal(signal.SIGTERM)
    second.wait(120)
    stop.set()
    for at, what in events:
        print(f"{at:8.2f} s  {what}")
    loop.run(gateway.stop(), 30)
    loop.stop()
    print(f"work directory: {work}")


def spawn(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "headgate.cli", "pipeline", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # killed with its JVM, as a machine's end would
        )


def count(commits: Path) -> int:
    return len(new_commits(commits, -1)) if commits.is_dir() else 0


def new_commits(commits: Path, seen: int) -> list[int]:
    if not commits.is_dir():
        return []
    done = sorted(int(f.name) for f in commits.iterdir() if f.name.isdigit())
    return done[seen:] if seen >= 0 else done


def gateway_tail(loop: BackgroundLoop, gateway: Gateway) -> int:
    async def read() -> int:
        return next(s.tail_position for s in gateway.statistics() if s.name == STREAM)

    value: int = loop.run(read(), 10)
    return value


if __name__ == "__main__":
    main()
