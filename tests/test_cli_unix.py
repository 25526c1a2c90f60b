"""``headgate serve --unix-socket`` and ``headgate send --gateway unix:PATH``, as processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from click.testing import CliRunner

from headgate.cli import main
from headgate.log import LogReader
from headgate.protocol.records import decode_records

HEADGATE = [sys.executable, "-m", "headgate.cli"]


def test_send_over_the_unix_socket_while_tcp_is_served_too(tmp_path: Path) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))
    sock = sock_dir / "gw.sock"
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [
            *HEADGATE,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--unix-socket",
            str(sock),
            "--data-dir",
            str(data),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        tcp_line = proc.stdout.readline()
        unix_line = proc.stdout.readline()
        assert tcp_line.startswith("listening on 127.0.0.1:"), tcp_line
        assert unix_line.strip() == f"listening on unix:{sock}", unix_line
        lines = [b"line %d" % i for i in range(300)]
        source = tmp_path / "in.txt"
        source.write_bytes(b"\n".join(lines) + b"\n")
        for address in (f"unix:{sock}", tcp_line.split()[-1]):
            result = subprocess.run(
                [*HEADGATE, "send", "lines", str(source), "--gateway", address],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, result.stderr
            assert "300 records" in result.stdout
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        shutil.rmtree(sock_dir, ignore_errors=True)
    values: list[bytes] = []
    with LogReader.open(data / "streams" / "lines") as reader:
        for frame in reader.read(reader.start_position()):
            values += decode_records(frame.payload).to_lists()[0]
    assert values == lines + lines  # once over the socket, once over TCP


def test_send_refuses_a_bad_gateway_address_plainly(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_bytes(b"x\n")
    for address, fragment in [("unix:", "names no socket path"), ("h:http", "port must be")]:
        result = CliRunner().invoke(main, ["send", "s", str(source), "--gateway", address])
        assert result.exit_code == 2, result.output
        assert fragment in result.output
        assert "Traceback" not in result.output
