"""Each flow-control policy keeps its contract, with a real gateway and producer.

The gateway runs in-process on 127.0.0.1 (a ``headgate serve`` subprocess for
the SIGHUP test); the consumer is played by reading the log and calling
``Gateway.release``, as Spark's progress does.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from headgate.client import Producer
from headgate.client.control import ReleaseClient
from headgate.config import ConfigError, StreamSettings, load_gateway_config
from headgate.costs import batch_cost
from headgate.gateway import Gateway
from headgate.gateway.policies import WindowFlow, XonXoffFlow
from headgate.log import LogReader
from headgate.protocol.session import GuaranteesReceived
from tests.helpers import SMALL, RawPeer, Releaser, gateway, records, run, values_in_order

pytestmark = pytest.mark.timeout(60)

KiB = 1024
MiB = 1024 * KiB


def unreleased(gw: Gateway, stream: str) -> int:
    if stream not in gw.streams:
        return 0
    log = gw.streams[stream].log
    return log.tail_position - log.release_position


# --- window ------------------------------------------------------------------------


def test_a_window_never_has_more_than_n_batches_in_flight(tmp_path: Path) -> None:
    window = 3

    async def scenario() -> None:
        async with (
            gateway(
                tmp_path,
                **SMALL,
                policy="window",
                window=window,
                streams={"A": StreamSettings(capacity=256 * KiB)},
            ) as gw,
            Producer(gw.address, policy="window", linger_ms=1, max_batch_bytes=4 * KiB) as p,
        ):
            values = records("w" * 100, 8000)  # about 900 KB, far beyond A's log

            async def sender() -> None:
                for value in values:
                    await p.send("A", value)
                await p.flush("A")

            task = asyncio.create_task(sender())
            most = 0
            for _ in range(150):  # 1.5 s with nobody releasing
                stats = p.statistics().streams.get("A")
                if stats is not None:
                    most = max(most, stats.batches_in_flight)
                    assert stats.batches_in_flight <= window
                await asyncio.sleep(0.01)
            assert not task.done()
            # The window was really used, and full: the log is full and A waits.
            assert most == window
            flow = gw.flow(gw.streams["A"])
            assert isinstance(flow, WindowFlow)
            assert 1 <= flow.statistics().max_in_flight <= window
            slot = batch_cost(16 * KiB)
            assert flow.statistics().peak_held_bytes <= window * slot
            assert unreleased(gw, "A") <= 256 * KiB

            releaser = Releaser(gw, tmp_path, "A")
            await releaser.run_until(task)
            await task
            releaser.close()
            assert flow.statistics().max_in_flight <= window
            assert values_in_order(releaser.frames, p.producer_id) == values

    run(scenario(), timeout=20)


@pytest.mark.parametrize("policy", ["credit", "window", "xonxoff"])
def test_every_policy_opens_a_data_channel_with_a_zero_guarantee(
    tmp_path: Path, policy: str
) -> None:
    # LCMUX: zero guarantees first say the server issues in advance; the
    # window policy then opens its whole window at once.
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, policy=policy, window=4) as gw:
            peer = RawPeer()
            await peer.connect(gw.address)
            handle = await peer.bind("A")
            channel = 2 + handle
            await peer.until(
                lambda: (
                    sum(
                        e.amount
                        for e in peer.events
                        if isinstance(e, GuaranteesReceived) and e.channel == channel
                    )
                    > 0
                )
            )
            grants = [
                e.amount
                for e in peer.events
                if isinstance(e, GuaranteesReceived) and e.channel == channel
            ]
            assert grants[0] == 0
            assert sum(grants) > 0
            if policy == "window":
                assert sum(grants) == 4 * batch_cost(16 * KiB)
            await peer.close()

    run(scenario())


def test_window_with_a_producer_that_never_sends_optimistically_does_not_deadlock(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, policy="window", window=2) as gw,
            Producer(gw.address, policy="wait", linger_ms=1) as p,
        ):
            values = records("n", 20_000)
            for value in values:
                await p.send("A", value)
            await asyncio.wait_for(p.flush("A"), 8.0)
            assert p.statistics().streams["A"].records_acked == len(values)
            assert p.statistics().streams["A"].batches_dropped == 0
            with LogReader.open(tmp_path / "streams" / "A") as reader:
                frames = reader.read(reader.start_position())
                got = [v for f in frames for v in _values(f.payload)]
            assert got == values

    run(scenario(), timeout=15)


def _values(payload: memoryview) -> list[bytes]:
    from headgate.protocol.records import decode_records

    return decode_records(payload).to_lists()[0]


# --- XON/XOFF -------------------------------------------------------------------------


def test_xonxoff_pauses_the_connection_at_xoff_and_resumes_it_at_xon(tmp_path: Path) -> None:
    xoff, xon = 160 * KiB, 48 * KiB

    async def scenario() -> None:
        async with (
            gateway(
                tmp_path,
                **SMALL,
                stream_capacity=1 * MiB,
                streams={"X": StreamSettings(policy="xonxoff", xoff=xoff, xon=xon)},
            ) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=8 * KiB) as p,
        ):
            values = records("x" * 100, 6000)  # about 650 KB

            async def sender() -> None:
                for value in values:
                    await p.send("X", value)
                await p.flush("X")

            task = asyncio.create_task(sender())
            conn = None
            for _ in range(300):
                conns = [c for c in gw.connections.values() if c.writers]
                if conns and conns[0].reading_paused:
                    conn = conns[0]
                    break
                await asyncio.sleep(0.01)
            assert conn is not None, "never paused"
            level = unreleased(gw, "X")
            assert level >= xoff
            await asyncio.sleep(0.3)
            # Still paused: the read side is off, nothing more is stored.
            assert conn.reading_paused
            assert unreleased(gw, "X") == level
            flow = gw.flow(gw.streams["X"])
            assert isinstance(flow, XonXoffFlow)
            assert flow.statistics().pauses == 1

            # The whole connection is held: another stream on it waits too.
            other = asyncio.create_task(p.send_many("Y", records("y", 10)))
            flushed_y = asyncio.create_task(p.flush("Y"))
            await asyncio.sleep(0.3)
            assert not flushed_y.done()

            # Releasing down to between the watermarks does not resume. (What
            # was stored is made durable first: the log frees nothing past its
            # durable end, and on a busy machine the last group commit may
            # still be due when the frames are read.)
            await gw.commit()
            with LogReader.open(tmp_path / "streams" / "X") as reader:
                ends = [f.end_position for f in reader.read(reader.start_position())]
            tail = gw.streams["X"].log.tail_position
            between = min(e for e in ends if tail - e < xoff - 1)
            assert tail - between > xon
            gw.release("X", between)
            await asyncio.sleep(0.2)
            assert flow.reason in conn.reads.reasons
            # Below xon: XON.
            below = min(e for e in ends if tail - e <= xon)
            gw.release("X", below)
            await gw.consumers_saved()  # the log frees once the position is stored
            # XON: the policy no longer holds the connection. (Its reads may
            # pause again at once for their own reasons, a full receive ring
            # or a turn, as the producer's backlog pours in.)
            assert flow.reason not in conn.reads.reasons
            assert flow.statistics().resumes == 1

            releaser = Releaser(gw, tmp_path, "X")
            releaser.position = below
            await releaser.run_until(task)
            await task
            await other
            await flushed_y
            releaser.close()
            stats = flow.statistics()
            assert stats.pauses >= 1 and stats.resumes >= 1
            # What was read past the watermark is bounded by one read.
            assert stats.peak_level <= xoff + 512 * KiB
            assert p.statistics().streams["X"].records_acked == len(values)

    run(scenario(), timeout=20)


# --- credit and capacity changes ----------------------------------------------------------


def test_credit_never_lets_buffered_bytes_exceed_capacity(tmp_path: Path) -> None:
    capacity = 256 * KiB

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": StreamSettings(capacity=capacity)}) as gw,
            Producer(gw.address, policy="optimistic", linger_ms=1) as eager,
            Producer(gw.address, policy="wait", linger_ms=1) as patient,
        ):
            a, b = records("e" * 80, 6000), records("p" * 80, 6000)

            async def send(p: Producer, values: list[bytes]) -> None:
                for value in values:
                    await p.send("A", value)
                await p.flush("A")

            both = asyncio.ensure_future(asyncio.gather(send(eager, a), send(patient, b)))
            releaser = Releaser(gw, tmp_path, "A")
            peak = 0
            for _ in range(2000):
                if both.done():
                    break
                peak = max(peak, unreleased(gw, "A"))
                assert unreleased(gw, "A") <= capacity
                if _ % 10 == 0:  # a slow consumer: the log fills between releases
                    releaser.poll()
                await asyncio.sleep(0.005)
            await releaser.run_until(both)
            await both
            releaser.close()
            assert peak > capacity // 2  # the log really filled up
            assert values_in_order(releaser.frames, eager.producer_id) == a
            assert values_in_order(releaser.frames, patient.producer_id) == b

    run(scenario(), timeout=25)


async def write_released(p: Producer, releaser: Releaser, values: list[bytes]) -> None:
    """Send ``values`` to A while the consumer keeps up: the producer earns its credit by use."""

    async def send() -> None:
        for value in values:
            await p.send("A", value)
        await p.flush("A")

    task = asyncio.create_task(send())
    await releaser.run_until(task)
    await task


async def guarantees_reach(p: Producer, least: int, seconds: float = 2.0) -> int:
    """The producer's guarantees on A once they reach ``least`` (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    g = p.statistics().streams["A"].guarantees or 0
    while g < least and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        g = p.statistics().streams["A"].guarantees or 0
    return g


def test_lowering_capacity_pleads_the_producer_down_and_raising_grants_more(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, stream_capacity=1 * MiB) as gw,
            Producer(gw.address, linger_ms=1) as p,
        ):
            releaser = Releaser(gw, tmp_path, "A")
            # Credit follows use: writing earns the producer most of the stream.
            warm = records("w" * 100, 8000)
            await write_released(p, releaser, warm)
            stream = gw.streams["A"]
            before = await guarantees_reach(p, 512 * KiB + 1)
            assert before > 512 * KiB

            low = 256 * KiB
            gw.set_capacity("A", low)
            for _ in range(200):
                g = p.statistics().streams["A"].guarantees
                if g is not None and g + unreleased(gw, "A") + stream.reserve <= low:
                    break
                await asyncio.sleep(0.01)
            g = p.statistics().streams["A"].guarantees
            assert g is not None and g + unreleased(gw, "A") + stream.reserve <= low
            assert stream.outstanding() + unreleased(gw, "A") + stream.reserve <= low

            # Under load with a slow consumer, the log never holds more than `low`.
            values = records("l" * 100, 5000)

            async def send() -> None:
                for value in values:
                    await p.send("A", value)
                await p.flush("A")

            task = asyncio.create_task(send())
            for i in range(3000):
                if task.done():
                    break
                assert unreleased(gw, "A") <= low
                if i % 10 == 0:
                    releaser.poll()
                await asyncio.sleep(0.003)
            await releaser.run_until(task)
            await task

            # Raised: a producer that goes on writing is granted more than before.
            gw.set_capacity("A", 2 * MiB)
            more = records("m" * 100, 8000)
            await write_released(p, releaser, more)
            g = await guarantees_reach(p, 1 * MiB + 1)
            assert g > 1 * MiB
            releaser.close()
            assert values_in_order(releaser.frames, p.producer_id) == [*warm, *values, *more]

    run(scenario(), timeout=25)


def test_set_capacity_refuses_less_than_two_terms(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL) as gw:
            with pytest.raises(ConfigError, match="two terms"):
                gw.set_capacity("A", 64 * KiB)

    run(scenario())


def test_sighup_rereads_the_config_and_lowers_a_stream_capacity(tmp_path: Path) -> None:
    toml = tmp_path / "headgate.toml"

    def write(capacity: str) -> None:
        toml.write_text(
            '[gateway]\nlisten = "127.0.0.1:0"\n'
            f'data_dir = "{tmp_path / "data"}"\n'
            'term_length = "64KiB"\nmax_message_size = "16KiB"\nstream_capacity = "1MiB"\n'
            f'[streams.A]\ncapacity = "{capacity}"\n'
        )

    write("1MiB")
    proc = subprocess.Popen(
        [sys.executable, "-m", "headgate.cli", "serve", "--config", str(toml)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10.0)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("listening on "), line
        port = int(line.rsplit(":", 1)[1])

        releases = ReleaseClient(("127.0.0.1", port))

        async def scenario() -> None:
            async with Producer(("127.0.0.1", port), linger_ms=1) as p:
                # Credit follows use: a producer that keeps writing (its
                # consumer keeping up) earns most of the stream.
                for i in range(40):
                    for value in records("x" * 100, 200, start=200 * i):
                        await p.send("A", value)
                    await p.flush("A")
                    with LogReader.open(tmp_path / "data" / "streams" / "A") as reader:
                        durable = reader.durable_position()
                    releases.release("A", durable)
                    assert releases.flush(5.0)
                    g = p.statistics().streams["A"].guarantees
                    if g is not None and g > 512 * KiB:
                        break
                assert g is not None and g > 512 * KiB
                write("192KiB")
                os.kill(proc.pid, signal.SIGHUP)
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:
                    g = p.statistics().streams["A"].guarantees
                    if g is not None and g < 192 * KiB:
                        break
                    await asyncio.sleep(0.02)
                assert g is not None and g < 192 * KiB
                # A broken edit is refused and the gateway keeps running.
                toml.write_text("[gateway\n")
                os.kill(proc.pid, signal.SIGHUP)
                await asyncio.sleep(0.2)
                await p.send("A", b"still here")
                await p.flush("A")

        try:
            run(scenario(), timeout=15)
        finally:
            releases.close()
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=5)
    assert "configuration reloaded" in err
    assert "reload refused" in err
    assert proc.returncode == 0


def test_stream_settings_in_toml_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    for text, needle in [
        ('[streams.a]\npolicy = "fast"\n', "policy"),
        ("[streams.a]\nwindow = 0\n", "window"),
        ('[streams.a]\nxoff = "1KiB"\nxon = "2KiB"\n', "xon"),
        ('[gateway]\npolicy = "tcp"\n', "policy"),
        ("[streams.a]\nburst = 3\n", "burst"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            load_gateway_config(path)
    path.write_text(
        '[gateway]\npolicy = "window"\nwindow = 5\n'
        '[streams.a]\npolicy = "xonxoff"\nxoff = "40MiB"\nxon = "8MiB"\n'
    )
    config = load_gateway_config(path)
    assert config.flow_for("a").policy == "xonxoff"
    assert (config.flow_for("a").xoff, config.flow_for("a").xon) == (40 * MiB, 8 * MiB)
    assert config.flow_for("b").policy == "window" and config.flow_for("b").window == 5
