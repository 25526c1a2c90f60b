"""``headgate streams``: list, describe, and delete offline, against a real gateway."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.cli.streams import StreamRow, consumer_silence, list_streams, release_phrase
from headgate.client import ReleaseClient
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.gateway.readers import ReaderConnection
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError

from .serving import HEADGATE
from .serving import serve as _serve
from .serving import stop as _stop


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "data"


def test_streams_lists_describes_and_deletes_only_with_the_gateway_stopped(
    data: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    proc, address = _serve(data)
    try:
        for stream, count in (("alpha", 30), ("beta", 5)):
            source = tmp_path / f"{stream}.txt"
            source.write_text("".join(f"record {i}\n" for i in range(count)))
            sent = subprocess.run(
                [*HEADGATE, "send", stream, str(source), "--gateway", address],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert sent.returncode == 0, sent.stderr

        listed = runner.invoke(main, ["streams", "list", "--gateway", address])
        assert listed.exit_code == 0, listed.output
        lines = listed.output.splitlines()
        assert lines[0].split() == ["stream", "start", "durable", "tail", "retained", "released"]
        assert [line.split()[0] for line in lines[1:]] == ["alpha", "beta"]

        as_json = runner.invoke(
            main, ["streams", "describe", "beta", "--gateway", address, "--format", "json"]
        )
        assert as_json.exit_code == 0, as_json.output
        (beta,) = [json.loads(line) for line in as_json.output.splitlines()]
        assert beta["stream"] == "beta" and beta["start_position"] == 0
        assert beta["durable_position"] == beta["tail_position"] > 0
        assert beta["retained_bytes"] == beta["tail_position"]

        unknown = runner.invoke(main, ["streams", "describe", "gamma", "--gateway", address])
        assert unknown.exit_code == 1
        assert (
            unknown.output == f"headgate streams: the gateway at {address} has no stream 'gamma'\n"
        )

        # The running gateway owns the directory: nothing is deleted under it.
        refused = runner.invoke(
            main, ["streams", "delete", "alpha", "--data-dir", str(data), "--yes"]
        )
        assert refused.exit_code == 1
        assert (
            "is in use by another gateway" in refused.output and "Traceback" not in refused.output
        )
        assert (data / "streams" / "alpha").is_dir()
    finally:
        _stop(proc)

    not_confirmed = runner.invoke(
        main, ["streams", "delete", "alpha", "--data-dir", str(data)], input="n\n"
    )
    assert not_confirmed.exit_code == 1 and (data / "streams" / "alpha").is_dir()
    deleted = runner.invoke(main, ["streams", "delete", "alpha", "--data-dir", str(data), "--yes"])
    assert deleted.exit_code == 0, deleted.output
    assert deleted.output.startswith("deleted stream 'alpha' (")
    assert not (data / "streams" / "alpha").exists()
    assert not (data / "state" / "alpha.producers.json").exists()
    assert not (data / "state" / "alpha.consumers.json").exists()
    assert (data / "state" / "beta.consumers.json").exists()
    again = runner.invoke(main, ["streams", "delete", "alpha", "--data-dir", str(data), "--yes"])
    assert again.exit_code == 1
    assert again.output == f"headgate streams: {data} holds no stream 'alpha'\n"

    # The gateway starts on what is left: beta only, with its records.
    proc, address = _serve(data)
    try:
        listed = runner.invoke(main, ["streams", "list", "--gateway", address, "--format", "json"])
        assert listed.exit_code == 0, listed.output
        rows = [json.loads(line) for line in listed.output.splitlines()]
        assert [row["stream"] for row in rows] == ["beta"]
        assert rows[0]["tail_position"] == beta["tail_position"]
    finally:
        _stop(proc)


def test_streams_say_when_each_consumer_last_released(data: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    proc, address = _serve(data)
    try:
        for stream in ("quiet", "read"):
            source = tmp_path / f"{stream}.txt"
            source.write_text("".join(f"record {i}\n" for i in range(20)))
            sent = subprocess.run(
                [*HEADGATE, "send", stream, str(source), "--gateway", address],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert sent.returncode == 0, sent.stderr
        listed = runner.invoke(main, ["streams", "list", "--gateway", address])
        assert listed.exit_code == 0, listed.output
        for line in listed.output.splitlines()[1:]:
            assert line.endswith("  never since the gateway started"), line

        described = runner.invoke(
            main, ["streams", "describe", "read", "--gateway", address, "--format", "json"]
        )
        (row,) = [json.loads(line) for line in described.output.splitlines()]
        before = time.time()
        with ReleaseClient(address) as client:
            client.release("read", row["durable_position"])
            assert client.flush(10)
        after = time.time()

        for _ in range(50):  # the log frees once the position is stored (a save later)
            as_json = runner.invoke(
                main, ["streams", "list", "--gateway", address, "--format", "json"]
            )
            quiet, read = [json.loads(line) for line in as_json.output.splitlines()]
            if read["start_position"] > 0:
                break
            time.sleep(0.02)
        assert quiet["released_at_us"] == 0 and quiet["released_at"] is None
        assert before * 1e6 <= read["released_at_us"] <= after * 1e6
        assert read["released_at"].endswith("Z") and read["start_position"] > 0

        text = runner.invoke(main, ["streams", "describe", "read", "quiet", "--gateway", address])
        assert text.exit_code == 0, text.output
        shown = re.findall(r"^  released: (.*)$", text.output, re.MULTILINE)
        assert len(shown) == 2  # sorted by name: quiet, then read
        assert shown[0] == "never since the gateway started"
        assert re.fullmatch(r"\d\d:\d\d:\d\d UTC \(\d+ s ago\)", shown[1]), shown
    finally:
        _stop(proc)


def test_release_times_read_as_people_say_them() -> None:
    now = 1_795_576_455.0  # 2026-11-25 03:14:15 UTC
    at = 1_795_576_360_000_000  # 03:12:40 UTC the same day
    assert release_phrase(at, now) == "03:12:40 UTC (95 s ago)"
    assert release_phrase(at, now + 3600) == "03:12:40 UTC (62 min ago)"
    assert release_phrase(at, now + 86400) == "2026-11-25 03:12:40 UTC (24 h ago)"
    assert release_phrase(at, now + 5 * 86400) == "2026-11-25 03:12:40 UTC (5 days ago)"
    assert release_phrase(at, now - 100) == "03:12:40 UTC (5 s ahead of this machine's clock)"
    assert release_phrase(m.MAX_TIME_US, now).startswith("9999-12-31 23:59:59 UTC (")
    assert release_phrase(0, now) == "never since the gateway started"
    assert release_phrase(None, now) == "not reported by this gateway"
    assert consumer_silence(at, now) == (
        "its consumer has not released it since 03:12:40 UTC (95 s ago)"
    )
    assert consumer_silence(0, now) == "no consumer has released it since the gateway started"
    assert consumer_silence(None, now) is None


def test_a_gateway_that_predates_describe_streams_is_listed_without_release_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = ReaderConnection.on_request

    def as_an_older_gateway(
        self: ReaderConnection, message: object, *args: object, **kwargs: object
    ) -> None:
        if isinstance(message, m.DescribeStreams):
            # What a gateway without the message type answers: MALFORMED_MESSAGE.
            raise ProtocolError(
                "unknown global message type 0x28", code=ErrorCode.MALFORMED_MESSAGE
            )
        original(self, message, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ReaderConnection, "on_request", as_an_older_gateway)

    async def run() -> list[StreamRow]:
        gw = Gateway(GatewayConfig(listen=("127.0.0.1", 0), data_dir=tmp_path / "d"))
        await gw.start()
        try:
            gw.stream("s")
            rows = await list_streams(f"127.0.0.1:{gw.address[1]}")
        finally:
            await gw.stop()
        return rows

    (row,) = asyncio.run(run())
    assert row.stream == "s" and row.start_position == 0
    assert row.released_at_us is None
    assert release_phrase(row.released_at_us, time.time()) == "not reported by this gateway"
