"""``headgate consumers``: every consumer's position, lag and state, from a real gateway."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.client import Producer
from headgate.client.control import ReleaseClient

from .serving import serve, stop

pytestmark = pytest.mark.timeout(60)


def test_consumers_lists_each_consumer_with_its_lag_and_state(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[streams.clicks.consumers.archive]\n"
        '[streams.clicks.consumers.live]\nblocking = false\non_data_loss = "skip"\n'
    )
    proc, address = serve(tmp_path / "data", "--config", str(config))
    try:

        async def produce() -> int:
            async with Producer(address, linger_ms=1) as p:
                for i in range(100):
                    await p.send("clicks", b"record %d" % i)
                    await p.send("views", b"v")
                await p.flush()
                return 0

        asyncio.run(produce())
        runner = CliRunner()
        before = runner.invoke(main, ["consumers", "--gateway", address, "--format", "json"])
        assert before.exit_code == 0, before.output
        rows = [json.loads(line) for line in before.output.splitlines()]
        assert [(r["stream"], r["consumer"]) for r in rows] == [
            ("clicks", "archive"),
            ("clicks", "live"),
            ("views", "default"),
        ]
        archive = rows[0]
        assert archive["position"] == 0 and archive["lag_bytes"] > 0
        assert archive["blocking"] is True and archive["state"] == "ok"
        assert rows[1]["blocking"] is False and rows[1]["on_data_loss"] == "skip"
        end = archive["lag_bytes"]
        with ReleaseClient(address, consumer="archive") as client:
            client.release("clicks", end)
            assert client.flush(10)

        table = runner.invoke(main, ["consumers", "clicks", "--gateway", address])
        assert table.exit_code == 0, table.output
        lines = table.output.splitlines()
        assert lines[0].split() == [
            "stream", "consumer", "position", "lag", "lag_s", "blocking", "state",
        ]  # fmt: skip
        assert lines[1].split()[:4] == ["clicks", "archive", f"{end:,}", "0"]
        assert lines[1].split()[-2:] == ["yes", "ok"]
        assert lines[2].split()[:2] == ["clicks", "live"] and "no (skip)" in lines[2]

        unknown = runner.invoke(main, ["consumers", "nothing", "--gateway", address])
        assert unknown.exit_code == 1
        assert unknown.output == (
            f"headgate consumers: the gateway at {address} has no stream 'nothing'\n"
        )
    finally:
        stop(proc)
