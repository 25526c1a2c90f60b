"""The ``headgate`` command: serve as a real process, send lines to it, refuse bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.log import LogReader
from headgate.protocol.records import decode_records

HEADGATE = [sys.executable, "-m", "headgate.cli"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield line.split()[-1], data, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_send_stores_every_valid_line_and_serve_stops_cleanly_on_sigterm(
    served: tuple[str, Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    address, data, proc = served
    lines = [b'{"n": %d}' % i for i in range(500)]
    lines[7] = b"{oops"
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    result = subprocess.run(
        [*HEADGATE, "send", "events", str(source), "--gateway", address, "--format", "jsonl"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr  # some lines were not JSON
    assert "499 records" in result.stdout
    assert "1 lines were not valid JSON" in result.stderr
    reader = LogReader.open(data / "streams" / "events")
    values: list[bytes] = []
    for frame in reader.read(reader.start_position()):
        values += decode_records(frame.payload).to_lists()[0]
    reader.close()
    assert values == [line for i, line in enumerate(lines) if i != 7]

    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped cleanly" in err


def test_serve_refuses_a_bad_config_with_a_clear_message(tmp_path: Path) -> None:
    config = tmp_path / "gw.toml"
    config.write_text('[gateway]\nterm_length = "3000"\n')
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert "power of two" in result.output
    assert "Traceback" not in result.output


def test_send_refuses_a_bad_stream_name_and_an_absent_gateway(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a\n")
    result = CliRunner().invoke(main, ["send", "../etc", str(source)])
    assert result.exit_code == 2
    assert "not a stream name" in result.output
    absent = subprocess.run(
        [*HEADGATE, "send", "s", str(source), "--gateway", "127.0.0.1:1", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert absent.returncode == 1
    assert "127.0.0.1:1" in absent.stderr
    assert "Traceback" not in absent.stderr


def test_serve_refuses_bad_policy_flags_with_a_clear_message() -> None:
    for args, needle in [
        (["--stream-policy", "nonsense"], "STREAM=POLICY"),
        (["--stream-policy", "ticks=fast"], "credit, window, xonxoff"),
        (["--policy", "fast"], "credit"),
        (["--window", "0"], "window"),
    ]:
        result = CliRunner().invoke(main, ["serve", *args])
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.output
        assert "Traceback" not in result.output
