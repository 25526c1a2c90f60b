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
        # Every record sent is in the lag, counted exactly (not estimated from bytes).
        assert archive["lag_records"] == 100 and rows[1]["lag_records"] == 100
        assert rows[2]["lag_records"] == 100
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
            "stream", "consumer", "position", "lag", "lag_records", "lag_s", "blocking", "state",
        ]  # fmt: skip
        assert lines[1].split()[:6] == ["clicks", "archive", f"{end:,}", "0", "B", "0"]
        assert lines[2].split()[5] == "100"  # live: "<lag> B 100 ..."
        assert lines[1].split()[-2:] == ["yes", "ok"]
        assert lines[2].split()[:2] == ["clicks", "live"] and "no (skip)" in lines[2]

        unknown = runner.invoke(main, ["consumers", "nothing", "--gateway", address])
        assert unknown.exit_code == 1
        assert unknown.output == (
            f"headgate consumers: the gateway at {address} has no stream 'nothing'\n"
        )
    finally:
        stop(proc)


def test_consumers_reset_and_delete_need_admin_and_replay_what_the_log_holds(
    tmp_path: Path,
) -> None:
    from tests.gateway._tokens import Token, write_tokens

    tokens = write_tokens(
        tmp_path / "tokens.toml",
        Token("ops", "o" * 32, admin=True, read=("*",), write=("*",)),
        Token("reader", "r" * 32, read=("*",)),
    )
    config = tmp_path / "gateway.toml"
    config.write_text("[streams.clicks.consumers.archive]\n[streams.clicks.consumers.audit]\n")
    proc, address = serve(tmp_path / "data", "--config", str(config), "--auth-file", str(tokens))
    ops = ["--gateway", address, "--token", "o" * 32]
    try:
        from headgate.client.security import ClientSecurity

        async def produce() -> None:
            async with Producer(
                address, linger_ms=1, security=ClientSecurity(token=b"o" * 32)
            ) as p:
                for i in range(50):
                    await p.send("clicks", b"record %d" % i)
                await p.flush()

        asyncio.run(produce())
        runner = CliRunner()
        listed = runner.invoke(main, ["consumers", "clicks", *ops, "--format", "json"])
        assert listed.exit_code == 0, listed.output
        end = json.loads(listed.output.splitlines()[0])["lag_bytes"]

        forward = runner.invoke(
            main, ["consumers", "reset", "archive", "--stream", "clicks", "--to", "latest", *ops]
        )
        assert forward.exit_code == 0, forward.output
        assert forward.output == f"consumer 'archive' of stream 'clicks' is at {end:,}\n"
        back = runner.invoke(
            main, ["consumers", "reset", "archive", "--stream", "clicks", "--to", "earliest", *ops]
        )
        assert back.output == "consumer 'archive' of stream 'clicks' is at 0\n"
        past = runner.invoke(
            main,
            ["consumers", "reset", "archive", "--stream", "clicks", "--to", "2000-01-01", *ops],
        )
        assert past.output == "consumer 'archive' of stream 'clicks' is at 0\n"
        bad = runner.invoke(
            main, ["consumers", "reset", "archive", "--stream", "clicks", "--to", "soon", *ops]
        )
        assert bad.exit_code == 2 and "expected earliest, latest, a position" in bad.output

        as_reader = ["--gateway", address, "--token", "r" * 32]
        refused = runner.invoke(
            main, ["consumers", "delete", "audit", "--stream", "clicks", "--yes", *as_reader]
        )
        assert refused.exit_code == 1
        assert "may not reset or delete consumer 'audit'" in refused.output
        assert "FORBIDDEN" in refused.output and "Traceback" not in refused.output

        deleted = runner.invoke(
            main, ["consumers", "delete", "audit", "--stream", "clicks", "--yes", *ops]
        )
        assert deleted.exit_code == 0, deleted.output
        after = runner.invoke(main, ["consumers", *ops, "--format", "json"])
        names = [json.loads(line)["consumer"] for line in after.output.splitlines()]
        assert names == ["archive"]
        unknown = runner.invoke(
            main, ["consumers", "delete", "audit", "--stream", "clicks", "--yes", *ops]
        )
        assert unknown.exit_code == 1 and "no consumer called 'audit'" in unknown.output
    finally:
        stop(proc)
