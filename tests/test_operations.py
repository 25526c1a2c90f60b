"""Running the gateway as a service: JSON logs, reloads, a taken port, the build metric."""

from __future__ import annotations

import datetime
import io
import json
import logging
import os
import platform
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from headgate import __version__
from headgate.gateway import AddressInUse, Gateway
from headgate.logformat import JsonLineFormatter, use_log_format
from tests.helpers import config

pytestmark = pytest.mark.timeout(60)

HEADGATE = [sys.executable, "-m", "headgate.cli"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _stderr_until(proc: subprocess.Popen[str], text: str, seen: list[str]) -> None:
    """Read ``proc``'s stderr lines into ``seen`` until one holds ``text`` (20 s at most)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        # Raw reads: a buffered readline() can take two log lines from the
        # pipe and return one, and select() then waits for the other in vain.
        ready, _, _ = select.select([proc.stderr], [], [], deadline - time.monotonic())
        if not ready:
            break
        chunk = os.read(proc.stderr.fileno(), 65536).decode()
        if not chunk:
            break
        seen.extend(chunk.splitlines(keepends=True))
        if text in chunk:
            return
    raise AssertionError(f"no {text!r} on stderr: {seen}")


def _reload_twice_then_stop(tmp_path: Path, *flags: str) -> str:
    """Serve with a config file; break it and SIGHUP, fix it and SIGHUP, SIGTERM; its stderr."""
    toml = tmp_path / "gateway.toml"
    toml.write_text('[gateway]\nstream_capacity = "64MiB"\n', encoding="utf-8")
    proc = subprocess.Popen(
        [
            *HEADGATE,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "data"),
            "--config",
            str(toml),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20.0)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("listening on "), line
        toml.write_text('[gateway]\nstream_capacity = "lots"\n', encoding="utf-8")
        os.kill(proc.pid, signal.SIGHUP)
        _stderr_until(proc, "reload refused", seen)
        toml.write_text('[gateway]\nstream_capacity = "32MiB"\n', encoding="utf-8")
        os.kill(proc.pid, signal.SIGHUP)
        _stderr_until(proc, "configuration reloaded", seen)
        proc.terminate()
        _, rest = proc.communicate(timeout=20)
        seen.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = "".join(seen)
    assert proc.returncode == 0, err
    return err


# -- --log-format json ---------------------------------------------------------------


def test_a_json_log_line_has_time_level_logger_message_and_the_extra_fields() -> None:
    out = io.StringIO()
    logger = logging.getLogger("headgate.test.jsonlines")
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        use_log_format("json", logger)
        assert isinstance(handler.formatter, JsonLineFormatter)
        logger.warning("stream %s is full\nsecond line", "ticks", extra={"stream": "ticks"})
        try:
            raise ValueError("broken")
        except ValueError:
            logger.exception("failed", extra={"level": "not this", "count": 3, "path": Path("/x")})
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the newline in the message stays inside its line
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "stream ticks is full\nsecond line"
    assert first["level"] == "WARNING" and first["logger"] == "headgate.test.jsonlines"
    assert first["stream"] == "ticks"
    assert first["time"].endswith("Z") and "T" in first["time"]
    logged_at = datetime.datetime.fromisoformat(first["time"])
    assert logged_at.utcoffset() == datetime.timedelta(0)
    assert abs(time.time() - logged_at.timestamp()) < 60
    assert second["level"] == "ERROR"  # an extra field does not override the record's own
    assert second["count"] == 3 and second["path"] == "/x"
    assert "ValueError: broken" in second["exception"]


def test_serve_with_log_format_json_writes_only_json_lines(tmp_path: Path) -> None:
    err = _reload_twice_then_stop(tmp_path, "--log-format", "json")
    entries = [json.loads(line) for line in err.splitlines()]  # every line is one object
    messages = [entry["message"] for entry in entries]
    refused = [e for e in entries if e["message"].startswith("reload refused")]
    assert len(refused) == 1, messages
    assert refused[0]["level"] == "ERROR" and refused[0]["logger"] == "headgate.serve"
    assert "stream_capacity" in refused[0]["message"]
    assert "configuration reloaded" in messages
    assert messages[-1] == "gateway stopped cleanly"


def test_a_refused_reload_is_logged_once(tmp_path: Path) -> None:
    err = _reload_twice_then_stop(tmp_path)
    assert err.count("reload refused") == 1, err
    assert err.count("gateway.stream_capacity") == 1, err
    assert err.count("configuration reloaded") == 1, err
    assert "stopped cleanly" in err


def test_the_log_format_can_come_from_the_environment(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "HEADGATE_LOG_FORMAT": "json"},
    )
    assert proc.returncode == 0
    assert "HEADGATE_LOG_FORMAT" in proc.stdout


# -- a port in use -------------------------------------------------------------------


def test_serve_on_a_port_in_use_names_the_port_in_one_line(tmp_path: Path, taken_port: int) -> None:
    done = subprocess.run(
        [*HEADGATE, "serve", "--listen", f"127.0.0.1:{taken_port}", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr == f"headgate serve: 127.0.0.1:{taken_port} is already in use\n"


def test_serve_with_its_metrics_port_in_use_names_that_port(
    tmp_path: Path, taken_port: int
) -> None:
    done = subprocess.run(
        [
            *HEADGATE,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            f"127.0.0.1:{taken_port}",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr == f"headgate serve: 127.0.0.1:{taken_port} is already in use\n"


async def test_a_gateway_that_cannot_listen_leaves_its_directory_and_metrics_free(
    tmp_path: Path, taken_port: int
) -> None:
    refused = Gateway(config(tmp_path, listen=("127.0.0.1", taken_port), metrics=("127.0.0.1", 0)))
    with pytest.raises(AddressInUse) as caught:
        await refused.start()
    assert caught.value.address == f"127.0.0.1:{taken_port}"
    assert refused._metrics is None  # its metrics server was closed again
    # The same directory, right after: the failed start released its lock.
    gateway = Gateway(config(tmp_path))
    await gateway.start()
    await gateway.stop()


# -- headgate_build_info -------------------------------------------------------------


async def test_the_metrics_carry_the_build_info(tmp_path: Path) -> None:
    import asyncio

    gateway = Gateway(config(tmp_path, metrics=("127.0.0.1", 0)))
    await gateway.start()
    try:
        assert gateway.metrics_address is not None
        url = "http://{}:{}/metrics".format(*gateway.metrics_address)

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return str(answer.read().decode())

        text = await asyncio.to_thread(scrape)  # the scrape needs this loop free
    finally:
        await gateway.stop()
    lines = [line for line in text.splitlines() if line.startswith("headgate_build_info{")]
    assert len(lines) == 1, text
    (line,) = lines
    assert f'version="{__version__}"' in line
    assert f'python="{platform.python_version()}"' in line
    assert line.endswith(" 1.0")
    assert "# TYPE headgate_build_info gauge" in text
