"""The Prometheus endpoint of a running gateway, and ``headgate top`` reading it."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.cli.top import MetricsUnavailable, fetch, parse, render
from headgate.config import ConfigError, load_gateway_config
from headgate.gateway import Gateway
from headgate.protocol import messages as m
from headgate.protocol.records import encode_records
from tests.helpers import RawPeer, config, scrape

from ..serving import serve_with_metrics

pytestmark = pytest.mark.timeout(60)

HEADGATE = [sys.executable, "-m", "headgate.cli"]


async def test_the_endpoint_reports_streams_and_connections_and_follows_traffic(
    tmp_path: Path,
) -> None:
    gw = Gateway(config(tmp_path, metrics=("127.0.0.1", 0)))
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("watched")
        await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
        before = await scrape(gw)
        row = before.streams["watched"]
        assert row["stream_appended_records_total"] == 0
        assert row["stream_capacity_bytes"] == 256 * 1024
        assert row["stream_guarantees_outstanding_bytes"] > 0
        assert row["stream_writers"] == 1
        (conn,) = before.connections.values()
        assert conn["connection_debt"] == 0 and conn["connection_reads_paused"] == 0
        assert conn["connection_debt_threshold"] == gw.config.max_connection_debt
        assert conn["producer"] == "1"

        for i in range(10):
            await peer.until(lambda: peer.session.can_send_batch(h, 40))
            peer.session.send_batch(h, 2 * i, encode_records([b"r" * 10, b"s" * 10]))
            await peer.send()
        await peer.until(lambda: peer.acked(h) == 20)
        after = await scrape(gw)
        row = after.streams["watched"]
        assert row["stream_appended_records_total"] == 20
        assert row["stream_appended_batches_total"] == 10
        assert row["stream_tail_position"] > before.streams["watched"]["stream_tail_position"]
        assert row["stream_durable_position"] == row["stream_tail_position"]
        assert 0 < row["stream_fill_ratio"] < 1
        assert row["stream_fsync_seconds_count"] >= 1
        assert after.fsync_buckets["watched"][-1] == (
            float("inf"),
            row["stream_fsync_seconds_count"],
        )
        assert after.gateway["connections"] == 1
        assert after.gateway["durability_loans"] == 0
        (conn,) = after.connections.values()
        peak = conn["connection_peak_debt"]
        assert isinstance(peak, float) and peak >= 1 and conn["connection_debt"] == 0

        # Spark releases: the release position and the fill follow.
        gw.release("watched", int(row["stream_durable_position"]))
        await gw.consumers_saved()  # the log frees once the position is stored
        released = await scrape(gw)
        assert released.streams["watched"]["stream_release_position"] == row["stream_tail_position"]
        assert released.streams["watched"]["stream_fill_ratio"] < row["stream_fill_ratio"]
        render(released, after)  # the live view renders what it reads
        await peer.close()
    finally:
        await gw.stop()
    with pytest.raises(MetricsUnavailable, match="cannot reach"):
        fetch(gw.metrics_address or ("127.0.0.1", 1), timeout=2)


def test_parse_refuses_what_is_not_headgate_metrics() -> None:
    for text in ("<html>hello</html>\n", "a b c d e\n", 'x{a="1" 2\n', "\x00\x01\n"):
        with pytest.raises(MetricsUnavailable):
            parse(text)
    with pytest.raises(MetricsUnavailable, match="no headgate metrics"):
        parse("# TYPE other gauge\nother 1\n")


@pytest.fixture
def not_a_gateway() -> Iterator[tuple[str, int]]:
    """An HTTP server that answers something else entirely."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"\xff\xfe not metrics {{{"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_top_says_clearly_when_the_gateway_cannot_be_reached(
    not_a_gateway: tuple[str, int],
) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["top", "--once", "--metrics", f"127.0.0.1:{free_port()}"])
    assert result.exit_code == 1
    assert "cannot reach" in result.output and "--metrics" in result.output
    assert "Traceback" not in result.output
    host, port = not_a_gateway
    result = runner.invoke(main, ["top", "--once", "--metrics", f"{host}:{port}"])
    assert result.exit_code == 1 and "not text" in result.output
    result = runner.invoke(main, ["top", "--metrics", "127.0.0.1:notaport"])
    assert result.exit_code == 2 and "port" in result.output


def test_serve_with_metrics_and_top_once_show_a_stream(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc, address, metrics_address = serve_with_metrics(data)
    try:
        source = tmp_path / "in.txt"
        source.write_text("".join(f"line {i}\n" for i in range(300)))
        sent = subprocess.run(
            [*HEADGATE, "send", "topped", str(source), "--gateway", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        shown = subprocess.run(
            [*HEADGATE, "top", "--once", "--metrics", metrics_address],
            capture_output=True,
            text=True,
            timeout=60,
            env={"COLUMNS": "200", "PATH": ""},
        )
        assert shown.returncode == 0, shown.stderr
        assert "topped" in shown.stdout and "300" in shown.stdout
        assert "connections" in shown.stdout
    finally:
        proc.terminate()
        proc.wait(20)


def test_the_metrics_address_comes_from_toml_or_flag(tmp_path: Path) -> None:
    path = tmp_path / "headgate.toml"
    path.write_text('[gateway]\nmetrics = "127.0.0.1"\nmax_connection_debt = 100\n')
    cfg = load_gateway_config(path)
    assert cfg.metrics == ("127.0.0.1", 9108) and cfg.max_connection_debt == 100
    assert load_gateway_config().metrics is None, "off unless asked for"
    path.write_text("[gateway]\nmetrics = 9108\n")
    with pytest.raises(ConfigError, match="metrics"):
        load_gateway_config(path)
    path.write_text("[gateway]\nmax_connection_debt = 0\n")
    with pytest.raises(ConfigError, match="max_connection_debt"):
        load_gateway_config(path)
