"""A real ``headgate serve`` in a child process, for the command-line tests."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

#: The command line of the ``headgate`` command, run by this interpreter.
HEADGATE = [sys.executable, "-m", "headgate.cli"]


def serve(data: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """Start a gateway on 127.0.0.1 (a free port) over ``data``; its process and address."""
    proc = subprocess.Popen(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        stop(proc)
        raise AssertionError(f"the gateway did not start: {line!r}")
    return proc, line.split()[-1]


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL if it does not end within 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def serve_with_metrics(data: Path, *extra: str) -> tuple[subprocess.Popen[str], str, str]:
    """:func:`serve` with ``--metrics`` on a free port; also the metrics ``host:port``."""
    proc, address = serve(data, "--metrics", "127.0.0.1:0", *extra)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("metrics on http://"):
        stop(proc)
        raise AssertionError(f"no metrics endpoint: {line!r}")
    return proc, address, line.split("//")[1].split("/")[0]
