"""The hostile-peer suite: a real gateway, a good producer, and one attack at a time.

One ``headgate serve`` process (tokens and small limits, see ``CONFIG``)
serves the whole module. For each attack in ``attacks.ATTACKS``, an attacker
process attacks while a well-behaved producer, in this process, sends records
on a stream of its own and measures its throughput. Then, for each attack:

* the gateway is still up (and at the end of the module stops cleanly);
* its anonymous memory (RssAnon, from /proc) grew by less than ``MEMORY_BOUND``
  over its level after warm-up, sampled all through the attack;
* the good producer kept at least ``THROUGHPUT_RATIO`` of its throughput
  without attack (measured in this module, on the same machine);
* the good producer lost nothing: its stream's log holds every record
  exactly once, in order;
* the offender got the documented answer (PROTOCOL.md): its Error codes, or
  AnnounceDropping for what it sent beyond its guarantees.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from headgate.client import Producer
from headgate.gateway.auth import hash_token
from headgate.log import LogReader, frame_cost
from headgate.protocol.errors import ErrorCode
from headgate.protocol.records import decode_records
from tests.hostile.attacks import ATTACKS, DOCUMENTED

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
GOOD_TOKEN = "good-" + "g" * 40
BAD_TOKEN = "hostile-" + "h" * 40
#: The bind flood has a token of its own, so that using up its stream quota
#: (streams_per_token) leaves the other attacks theirs.
FLOOD_TOKEN = "flood-" + "f" * 40
#: How long each attack lasts (seconds).
ATTACK_SECONDS = 2.0
#: Records the good producer sends per run, at most, and for how long at most
#: (it runs while the attack is at full force).
GOOD_RECORDS = 200_000
GOOD_SECONDS = 1.0
#: The good producer keeps at least this share of its unattacked throughput.
#: Tolerant, because two cores are shared by the gateway, the attacker, this
#: process and whatever else runs; a gateway that stalls for an attack fails it.
THROUGHPUT_RATIO = 0.2
#: How much the gateway's anonymous memory may grow during an attack. Its
#: buffers are bounded per connection by max_message_size (a partial frame),
#: one 256 KiB read and max_write_buffer; ~40 connections at once stay far
#: below this (about 5 MiB was seen), while a gateway that buffered what the
#: attackers send (tens of MiB per attack) would not.
MEMORY_BOUND = 24 * 1024 * 1024

CONFIG = """
[gateway]
listen = "127.0.0.1:0"
data_dir = "{data}"
stream_capacity = "32MiB"
term_length = "1MiB"
max_message_size = "32KiB"
group_commit_interval_ms = 2
auth_file = "{tokens}"
idle_timeout_ms = 1000
handshake_timeout_ms = 500
max_connections = 128
max_write_buffer = "64KiB"
bind_budget = "1KiB"
max_streams = 64
streams_per_token = 16

# Small, so that the optimist soon sends beyond all it can be guaranteed.
[streams.h-optimist]
capacity = "2MiB"
"""


@dataclass
class Served:
    address: str
    data: Path
    proc: subprocess.Popen[str]
    base_memory: int = 0
    base_rate: float = 0.0


def rss_anon(pid: int) -> int:
    """Anonymous resident memory of a process, in bytes (heap, not mapped files)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc status")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hostile")
    tokens = root / "tokens.toml"
    tokens.write_text(
        f'[[token]]\nname = "good"\nsha256 = "{hash_token(GOOD_TOKEN.encode())}"\n'
        'write = ["good-*"]\n\n'
        f'[[token]]\nname = "hostile"\nsha256 = "{hash_token(BAD_TOKEN.encode())}"\n'
        'write = ["h-*"]\n\n'
        f'[[token]]\nname = "flood"\nsha256 = "{hash_token(FLOOD_TOKEN.encode())}"\n'
        'write = ["h-flood-*"]\n'
    )
    config = root / "gateway.toml"
    config.write_text(CONFIG.format(data=root / "data", tokens=tokens))
    log = (root / "gateway.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "headgate.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield Served(address=line.split()[-1], data=root / "data", proc=proc)
        assert proc.poll() is None, "the gateway died"
        proc.terminate()
        assert proc.wait(20) == 0, "the gateway did not stop cleanly"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def record(stream: str, i: int) -> bytes:
    return f"{stream}:{i:07d}:".encode().ljust(100, b".")


async def good_producer(served: Served, stream: str) -> tuple[float, int, int]:
    """Send records for up to GOOD_SECONDS; return (records/s, records, peak memory)."""
    peak = rss_anon(served.proc.pid)
    loop = asyncio.get_running_loop()
    async with Producer(
        served.address, token=GOOD_TOKEN, reconnect_timeout=10, client_name="good"
    ) as producer:
        started = loop.time()
        count = 0
        while count < GOOD_RECORDS and loop.time() - started < GOOD_SECONDS:
            for i in range(count, count + 500):
                await producer.send(stream, record(stream, i))
            count += 500
            peak = max(peak, rss_anon(served.proc.pid))
        await producer.flush()
        elapsed = loop.time() - started
        stats = producer.statistics()
        assert stats.reconnects == 0, stats.last_error
    return count / elapsed, count, peak


def stored_values(data: Path, stream: str) -> list[bytes]:
    reader = LogReader.open(data / "streams" / stream)
    try:
        out: list[bytes] = []
        for frame in reader.read(reader.start_position(), reader.published_position()):
            values, _ = decode_records(frame.payload).to_lists()
            out += values
        return out
    finally:
        reader.close()


def stored_cost(data: Path, stream: str) -> int:
    directory = data / "streams" / stream
    if not directory.exists():
        return 0
    reader = LogReader.open(directory)
    try:
        frames = reader.read(reader.start_position(), reader.published_position())
        return sum(frame_cost(len(f.payload)) for f in frames)
    finally:
        reader.close()


@pytest.fixture(scope="module")
def baseline(served: Served) -> Served:
    """The good producer alone: warm-up, then the median of three runs."""

    async def runs() -> list[float]:
        await good_producer(served, "good-warmup")
        return [(await good_producer(served, f"good-baseline-{i}"))[0] for i in range(3)]

    rates = asyncio.run(runs())
    served.base_rate = statistics.median(rates)
    served.base_memory = rss_anon(served.proc.pid)
    for i in range(3):
        name = f"good-baseline-{i}"
        values = stored_values(served.data, name)
        assert values == [record(name, j) for j in range(len(values))]
    return served


async def run_attack(served: Served, name: str) -> tuple[dict[str, Any], float, int]:
    attacker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.hostile.attacks",
        name,
        served.address,
        FLOOD_TOKEN if name == "bind_flood" else BAD_TOKEN,
        str(ATTACK_SECONDS),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert attacker.stdout is not None
        started = await asyncio.wait_for(attacker.stdout.readline(), 30)
        assert started.strip() == b"attacking", started
        await asyncio.sleep(0.2)  # under way
        rate, count, peak = await good_producer(served, f"good-{name}")
        out, _ = await asyncio.wait_for(attacker.communicate(), 60)
    finally:
        if attacker.returncode is None:
            attacker.kill()
            await attacker.wait()
    assert attacker.returncode == 0
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    values = stored_values(served.data, f"good-{name}")
    assert values == [record(f"good-{name}", i) for i in range(count)], "lost or repeated records"
    return report, rate, peak


def codes(*names: ErrorCode) -> list[int]:
    return [int(code) for code in names]


def code_set(*names: ErrorCode) -> set[int]:
    return {int(code) for code in names}


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_the_gateway_survives_the_attack_and_the_good_producer_is_unharmed(
    baseline: Served, name: str
) -> None:
    served = baseline
    started = time.monotonic()
    report, rate, peak = await run_attack(served, name)
    print(
        f"\n{name}: good producer {rate:,.0f} rec/s (baseline {served.base_rate:,.0f}), "
        f"gateway RssAnon +{(peak - served.base_memory) / 1024:,.0f} KiB, "
        f"{report['connections']} attacking connections, {time.monotonic() - started:.1f} s"
    )
    assert served.proc.poll() is None, "the gateway died"
    assert peak - served.base_memory < MEMORY_BOUND
    assert rate >= THROUGHPUT_RATIO * served.base_rate
    errors: list[list[int]] = report["errors"]
    for got in errors:
        assert set(got) <= DOCUMENTED
        assert len(got) <= 1, "more than one Error before the close"
    check_offender(served, name, report)


def check_offender(served: Served, name: str, report: dict[str, Any]) -> None:
    errors: list[list[int]] = report["errors"]
    connections = report["connections"]
    if name in ("random_frames", "mutated_frames"):
        # Anything goes in, one documented Error comes out, then the close.
        assert report["closed"] == connections
        assert sum(1 for got in errors if got) >= 0.9 * connections
    elif name in ("truncated_frames", "slowloris"):
        assert report["closed"] == connections
        assert errors == [codes(ErrorCode.TIMEOUT)] * connections
    elif name == "huge_lengths":
        assert report["closed"] == connections
        assert errors == [codes(ErrorCode.FRAME_TOO_LARGE)] * connections
    elif name == "bind_flood":
        # Binds beyond the guarantees are dropped (AnnounceDropping on channel
        # 0); binds of streams beyond max_streams are refused one by one.
        assert 0 in report["dropping"]
        assert set(report["scoped_errors"]) == code_set(ErrorCode.RESOURCE_EXHAUSTED)
        # A flooder that reads too little of the gateway's answers stops
        # being read, and is then cut off as idle.
        for got in errors:
            assert set(got) <= code_set(ErrorCode.TIMEOUT, ErrorCode.RESOURCE_EXHAUSTED)
        assert report["facts"]["binds_sent"] > 10 * report["facts"]["bind_guarantees"] // 20
        # The hostile token's quota, not the gateway's limit, stopped it.
        flooded = [p for p in (served.data / "streams").iterdir() if p.name.startswith("h-flood")]
        assert 0 < len(flooded) <= 16
    elif name == "bad_frees":
        assert report["closed"] == connections
        assert errors == [
            codes(ErrorCode.UNKNOWN_HANDLE),
            codes(ErrorCode.UNKNOWN_HANDLE),
            codes(ErrorCode.UNKNOWN_HANDLE),
            codes(ErrorCode.HANDLE_FREED),
        ]
    elif name == "absolve_and_apologise":
        assert report["closed"] == connections
        assert errors == [
            codes(ErrorCode.ABSOLVED_TOO_MUCH),
            codes(ErrorCode.ABSOLVED_TOO_MUCH),
            codes(ErrorCode.UNEXPECTED_APOLOGY),
            codes(ErrorCode.UNEXPECTED_APOLOGY),
        ]
    elif name == "optimistic_never_apologised":
        assert 2 in report["dropping"]
        # Stored: at most what the guarantees covered; the rest was dropped.
        assert stored_cost(served.data, "h-optimist") <= report["facts"]["guarantees"]
        assert report["facts"]["batches_sent"] * 1000 > report["facts"]["guarantees"]
    elif name == "never_reads":
        # Cut off; the Error may be lost with the unsent bytes of a peer that
        # does not read, so only its code is checked, when it arrives.
        assert report["closed"] == connections
        for got in errors:
            assert set(got) <= code_set(ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.TIMEOUT)
    else:
        raise AssertionError(f"no offender check for {name}")
