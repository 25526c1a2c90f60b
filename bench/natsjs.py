"""NATS JetStream as a peer in the benchmarks: one home for starting ``nats-server``
and for saying how durable its acknowledgements are.

``bench/flow.py`` and ``bench/ingest.py`` compare headgate with JetStream, the
log that this audience often runs beside Spark. Both start the server the same
way, here: on 127.0.0.1, on a free port, with its store in a fresh temporary
directory, stopped by its pid at the end.

Durability, stated for every figure. headgate acknowledges a batch after an
fsync of the log (group commit). JetStream's file store writes each message to
the OS page cache and acknowledges it; it fsyncs on its own timer,
``jetstream { sync_interval }``, two minutes by default. From nats-server 2.10
on, ``sync_interval: always`` fsyncs every write before the acknowledgement:
that is the setting that makes a JetStream acknowledgement as durable as
headgate's, and this module uses it where the server has it. Debian's
``nats-server`` package (2.9.10 in bookworm) has no ``sync_interval``: its
acknowledgements survive a crash of the server process but not of the machine
(a power cut can lose the last two minutes), and the figures say so.

No ``nats-server`` on PATH (and none given with ``--nats-server``): the peer
is skipped with one line, never an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Where the line for a missing server points a reader.
INSTALL_HINT = "apt-get install nats-server"
#: The first nats-server release with ``sync_interval`` (and its ``always``).
SYNC_ALWAYS_SINCE = (2, 10, 0)
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


def client_missing() -> str | None:
    """Why the Python client cannot be used (None when it can): the bench extra
    installs it."""
    try:
        import nats  # noqa: F401
    except ImportError:
        return "skipped: nats-py is not installed (pip install -e '.[bench]')"
    return None


def find_server(given: str | None = None) -> str | None:
    """The ``nats-server`` to run: ``given`` (a path or a name on PATH), else the
    one on PATH; None when there is none."""
    if given:
        path = Path(given)
        if path.is_file():
            return str(path)
        return shutil.which(given)
    return shutil.which("nats-server")


def skip_reason(given: str | None = None) -> str:
    """The one line a benchmark prints when it has no server to run."""
    if given:
        return f"skipped: no nats-server at {given}"
    return f"skipped: no nats-server on PATH ({INSTALL_HINT})"


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``nats-server: v2.9.10`` -> (2, 9, 10); None if the text names no version."""
    match = _VERSION.search(text)
    if match is None:
        return None
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def syncs_each_write(version: tuple[int, int, int] | None, fsync_each: bool) -> bool:
    """Whether the server will run with ``sync_interval: always``: asked for, and
    the server knows the setting."""
    return fsync_each and version is not None and version >= SYNC_ALWAYS_SINCE


def durability(version: tuple[int, int, int] | None, fsync_each: bool = True) -> str:
    """What an acknowledgement from this server's file store means, in the words
    every figure carries."""
    if syncs_each_write(version, fsync_each):
        return "file store, sync_interval: always (fsync before each ack, as durable as headgate)"
    why = "asked for" if fsync_each is False else "no sync_interval before 2.10"
    return (
        "file store, default sync (ack from the page cache, fsync every 2 min; "
        f"{why}): less durable than headgate's"
    )


def config_text(
    port: int, store: Path, version: tuple[int, int, int] | None, fsync_each: bool = True
) -> str:
    """The server's configuration: loopback only, JetStream on ``store``, and fsync
    on every write where the server can (unless ``fsync_each`` is False)."""
    sync = "  sync_interval: always\n" if syncs_each_write(version, fsync_each) else ""
    return f'listen: 127.0.0.1:{port}\njetstream {{\n  store_dir: "{store}"\n{sync}}}\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class JetStreamServer:
    """A running ``nats-server -js`` on 127.0.0.1, its store in a temporary directory."""

    binary: str
    version: tuple[int, int, int] | None
    port: int
    directory: Path
    process: subprocess.Popen[bytes]
    fsync_each: bool = True

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def durability(self) -> str:
        return durability(self.version, self.fsync_each)

    @property
    def label(self) -> str:
        shown = ".".join(map(str, self.version)) if self.version else "unknown version"
        return f"nats-server {shown}"

    @classmethod
    def start(cls, binary: str, fsync_each: bool = True) -> JetStreamServer:
        """Start the server and wait (bounded) until it accepts connections;
        ``fsync_each=False`` keeps JetStream's default sync, for comparison."""
        probe = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=START_TIMEOUT_S
        )
        version = parse_version(probe.stdout + probe.stderr)
        directory = Path(tempfile.mkdtemp(prefix="headgate-bench-nats-"))
        port = free_port()
        config = directory / "nats.conf"
        config.write_text(config_text(port, directory / "store", version, fsync_each))
        with open(directory / "nats.log", "wb") as log:
            process = subprocess.Popen(
                [binary, "-js", "-c", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        server = cls(binary, version, port, directory, process, fsync_each)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                text = (directory / "nats.log").read_text(errors="replace")[-500:]
                server.stop()
                raise RuntimeError(f"nats-server exited at start: {text.strip()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=0.5),
            ):
                return server
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"nats-server did not listen on port {port} in time")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after STOP_TIMEOUT_S; the store is deleted."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        shutil.rmtree(self.directory, ignore_errors=True)


class AckedPublisher:
    """Publishes to JetStream with up to ``max_outstanding`` acknowledgements awaited
    at once: JetStream's asynchronous publish, with a bound.

    Each message carries a reply subject under one inbox of ours; the server's
    answer (a PubAck, or an error such as ``maximum bytes exceeded`` when a
    ``discard: new`` stream is full) settles that message's future. nats-py's
    own ``publish_async`` is not used: in nats-py 2.15.0 a 503 answer raises in
    its reply handler and leaves the message's future (and a slot of its bound)
    pending for ever, so a full stream would stall the publisher silently.
    """

    def __init__(self, nc: Any, max_outstanding: int) -> None:
        self._nc = nc
        self._slots = asyncio.Semaphore(max_outstanding)
        self._waiting: dict[str, asyncio.Future[str | None]] = {}
        self._serial = 0
        self._last: asyncio.Future[str | None] | None = None
        self._prefix = ""
        #: Answers received: PubAcks, and refusals (with their reason).
        self.acks = 0
        self.refusals = 0

    async def start(self) -> None:
        self._prefix = self._nc.new_inbox()
        await self._nc.subscribe(self._prefix + ".*", cb=self._on_reply)

    async def _on_reply(self, msg: Any) -> None:
        future = self._waiting.pop(msg.subject[len(self._prefix) + 1 :], None)
        if future is None:
            return
        self._slots.release()
        if future.done():
            return
        future.set_result(refusal(msg.data))
        if future.result() is None:
            self.acks += 1
        else:
            self.refusals += 1

    async def publish(self, subject: str, payload: bytes) -> asyncio.Future[str | None]:
        """Publish once a slot is free; the future's result is None once the
        message is stored, or the server's reason for refusing it."""
        await self._slots.acquire()
        self._serial += 1
        token = str(self._serial)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        self._last = future
        await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}")
        return future

    @property
    def outstanding(self) -> int:
        return len(self._waiting)

    async def settled(self) -> None:
        """Wait until every message published so far has its answer.

        JetStream answers a stream's messages in order, so this waits for the
        last one and then for any earlier one still open (usually none): a walk
        over every outstanding future per call would cost the publisher more
        CPU than the server's work when called once per millisecond.
        """
        target = self._serial
        last = self._last
        if last is not None:
            await asyncio.wait([last])
        earlier = []
        for token, future in self._waiting.items():
            if int(token) > target:
                break
            earlier.append(future)
        if earlier:
            await asyncio.wait(earlier)


def refusal(reply: bytes) -> str | None:
    """None for a PubAck; else why the server refused the message (its error's
    description, or what was wrong with the reply)."""
    try:
        answer = json.loads(reply)
    except ValueError:
        return f"unreadable answer {reply[:40]!r}"
    if not isinstance(answer, dict):
        return f"unexpected answer {reply[:40]!r}"
    error = answer.get("error")
    if error is None:
        return None if "seq" in answer else f"no sequence in answer {reply[:40]!r}"
    if isinstance(error, dict):
        return str(error.get("description") or error)
    return str(error)
