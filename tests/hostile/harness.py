"""The arena of the hostile suite and of ``bench/hostile.py``: a served gateway, an
attacker worker, and a good producer that measures what an attack costs it.

One home for how the attacks are measured, so that the tests and the bench
report the same figures:

* :class:`Arena` is one ``headgate serve`` subprocess with a tokens file and
  small limits (:data:`CONFIG`, :data:`TOKENS`); it restarts the gateway with
  a fresh data directory if an attack killed it.
* :class:`Attacker` is the worker process of :mod:`tests.hostile.attacks`.
* :func:`measure` runs the good producer A B A B (alone, under attack, alone,
  under attack), compares the medians, and checks after every run that the
  good producer's records are all stored, exactly once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headgate.client import ClientSecurity, Producer, ProducerError
from headgate.client.reader import Reader, ReaderError
from headgate.config import GatewayConfig
from headgate.log import LogReader
from headgate.protocol.errors import ErrorCode
from headgate.protocol.records import decode_records
from tests.gateway._tokens import Token, write_tokens
from tests.hostile.attacks import ATTACKS, Target

ROOT = Path(__file__).resolve().parents[2]

GOOD_TOKEN = "good-" + "g" * 40
BAD_TOKEN = "hostile-" + "h" * 40
READER_TOKEN = "reader-" + "r" * 40
#: The bind flood has a token of its own, so that using up its stream quota
#: (streams_per_token) leaves the other attacks theirs.
FLOOD_TOKEN = "flood-" + "f" * 40
ADMIN_TOKEN = "admin-" + "a" * 40
#: The good producer's id: the spoofing attacks claim it from another token.
GOOD_PRODUCER = 0x600D_600D_600D
#: The id of the probe that tells whether the gateway still works.
PROBE_PRODUCER = 0x9_0BE

#: The tokens file. The hostile token may write the good producer's streams
#: (``g-*``), as a second producer of a shared stream may: the attacks that
#: bind them (many handles, shares, Plead, spoofing) need it. The good
#: producer's records are told apart by its producer id; it has a stream per
#: attack, hence its own quota. Per-token keys the fixes add (connection
#: caps, ...) go in the tables here.
TOKENS = (
    Token("good", GOOD_TOKEN, write=("g-*",), read=("g-*",), admin=True, max_streams=64),
    Token("hostile", BAD_TOKEN, write=("h-*", "g-*"), read=("h-*",)),
    Token("reader", READER_TOKEN, read=("*",)),
    Token("flood", FLOOD_TOKEN, write=("h-flood-*",)),
    Token("admin", ADMIN_TOKEN, write=("h-*",), read=("h-*",), admin=True),
)

#: The served gateway's configuration. ``{extra}`` is where keys that only
#: the fixed gateway knows go (:data:`NEW_KEYS`).
CONFIG = """
[gateway]
listen = "127.0.0.1:0"
data_dir = "{data}"
stream_capacity = "{capacity}"
term_length = "1MiB"
max_message_size = "32KiB"
group_commit_interval_ms = 2
auth_file = "{tokens}"
idle_timeout_ms = 1000
handshake_timeout_ms = 500
max_connections = 128
max_write_buffer = "64KiB"
bind_budget = "16KiB"
max_streams = 128
streams_per_token = 16
{extra}{tls}
# Small, so that the optimist soon sends beyond all it can be guaranteed.
[streams.h-optimist]
capacity = "2MiB"
# Large, so that the noisy writers never wait for a release.
[streams.h-noisy]
capacity = "4GiB"
"""

#: Limits of issue 13 that the fixes add, with the values this arena wants;
#: each is written into :data:`CONFIG` once ``GatewayConfig`` has that field,
#: so the same suite runs before and after the fixes. Values: TOML literals.
NEW_KEYS = {
    # A writer that ignores a Plead this long is closed (plead_ignored).
    "plead_deadline_ms": "500",
    # A frame that has started must finish this fast (slowloris_half_frame, drip_frames).
    "frame_timeout_ms": "2000",
    # Connection slots kept for writers (reader_slots).
    "writer_slots": "16",
    # Room for one token's 80 slow connections (slowloris_half_frame): the
    # deadlines, not the per-token cap (32 of 128 by default), must end them.
    "connections_per_token": "100",
}


def config_extra() -> str:
    known = {f.name for f in dataclasses.fields(GatewayConfig)}
    return "".join(f"{key} = {value}\n" for key, value in NEW_KEYS.items() if key in known)


#: Attacks against the TLS listener of a second gateway.
TLS_ATTACKS = {"tls_handshake_flood"}
#: Attacks that bench/hostile.py measures but the test suite does not, and why.
#: Each is an open problem, not a passing case: the suite's floor (half the
#: throughput alone) does not hold for it in every run yet.
#: (noisy_writers_16 was one until a cause alone was bounded to one turn's
#: time a pass, turns.ALONE_SECONDS: at the start of the flood its sixteen
#: connections each took a turn in every pass, and the appends of all they
#: decoded made passes of 0.5-2 s, in which the good producer waited.)
BENCH_ONLY: dict[str, str] = {}
#: Attacks that read the stream of tiny frames (written once per gateway).
TINY_ATTACKS = {"fetch_tiny_frames", "u64_fields", "free_gateway_handle"}


def record(stream: str, i: int) -> bytes:
    return f"{stream}:{i:08d}:".encode().ljust(100, b".")


def pythonpath() -> dict[str, str]:
    """The environment for a child: this checkout first, then what we were given."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class Arena:
    """One served gateway (TLS or plain) with the tokens above, restarted if it dies."""

    def __init__(self, root: Path, *, capacity_mib: int = 128, tls: bool = False) -> None:
        self.root = root
        self.capacity_mib = capacity_mib
        self.tls = tls
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.data = root
        self.ca = ""
        self.generation = 0
        self.deaths = 0
        self.prepared = False
        self._log: Any = None

    def start(self) -> None:
        self.generation += 1
        run = self.root / f"run-{self.generation}"
        run.mkdir(parents=True)
        tokens = run / "tokens.toml"
        write_tokens(tokens, *TOKENS)
        tls = ""
        if self.tls:
            from tests.gateway._certs import make_authority

            authority = make_authority(self.root / "certs", "hostile")
            self.ca = str(authority.ca)
            tls = f'tls_cert = "{authority.server_cert}"\ntls_key = "{authority.server_key}"\n'
        self.data = run / "data"
        config = run / "gateway.toml"
        config.write_text(
            CONFIG.format(
                data=self.data,
                tokens=tokens,
                capacity=f"{self.capacity_mib}MiB",
                extra=config_extra(),
                tls=tls,
            )
        )
        self._log = (run / "gateway.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headgate.cli", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=ROOT,
            env=pythonpath(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the gateway did not start: {line!r}; see {run}/gateway.log")
        self.address = line.split()[-1]
        self.prepared = False

    def log_tail(self, lines: int = 30) -> str:
        """The end of the current gateway's log (stderr)."""
        path = self.root / f"run-{self.generation}" / "gateway.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text().splitlines()[-lines:])
        return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_up(self) -> None:
        """Start the gateway, or start it again (fresh data) if an attack killed it."""
        if self.proc is not None and not self.alive():
            self.deaths += 1
            self._log.close()
        if not self.alive():
            self.start()

    async def healthy(self) -> bool:
        """Whether the gateway still stores and acknowledges a record (within 5 s)."""
        if not self.alive():
            return False
        probe = Producer(
            self.address,
            security=self.security(),
            producer_id=PROBE_PRODUCER,
            reconnect_timeout=5,
            client_name="probe",
        )
        try:
            async with asyncio.timeout(5), probe:
                await probe.send("g-probe", b"probe")
                await probe.flush()
        except (ProducerError, TimeoutError):
            return False
        return True

    def restart(self) -> None:
        """Kill a gateway that stopped working and start a fresh one."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.ensure_up()

    def stop(self) -> int | None:
        """Stop the gateway; its exit status (None if never started, -9 if killed)."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return -9
        finally:
            self._log.close()

    def memory(self) -> int:
        """The gateway's anonymous resident memory (heap, not mapped logs), in bytes."""
        assert self.proc is not None
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def cpu(self) -> float:
        """CPU seconds the gateway has used (user and system)."""
        assert self.proc is not None
        return cpu_seconds(self.proc.pid)

    def security(self) -> ClientSecurity:
        """The good clients' token, and the arena's CA when the gateway speaks TLS."""
        return ClientSecurity(token=GOOD_TOKEN, ca_file=self.ca if self.tls else None)

    def target(self, victim_stream: str = "") -> Target:
        return Target(
            address=self.address,
            token=BAD_TOKEN,
            reader_token=READER_TOKEN,
            flood_token=FLOOD_TOKEN,
            admin_token=ADMIN_TOKEN,
            victim_stream=victim_stream,
            victim_producer=GOOD_PRODUCER,
            tls_address=self.address if self.tls else "",
            tls_ca=self.ca,
        )


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used, user and system (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # Fields after the command name (which may hold spaces), from field 3 on.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Attacker:
    """The attack worker process (``python -m tests.hostile.attacks``)."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None

    def cpu(self) -> float:
        """CPU seconds the attack worker has used (0 before it starts)."""
        return 0.0 if self.proc is None else cpu_seconds(self.proc.pid)

    async def _line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError("the attacker exited")
        return line.decode().strip()

    async def ensure(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            return
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.hostile.attacks",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
            env=pythonpath(),
        )
        assert await self._line(30) == "ready"

    async def _say(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def _report(self, timeout: float) -> dict[str, Any]:
        line = await self._line(timeout)
        assert line.startswith("report "), line
        report: dict[str, Any] = json.loads(line.removeprefix("report "))
        return report

    async def prepare(self, target: Target) -> dict[str, Any]:
        await self.ensure()
        await self._say(json.dumps({"prepare": True, "target": dataclasses.asdict(target)}))
        return await self._report(120)

    async def start(self, name: str, target: Target) -> None:
        """Start an attack and return once it is at full force."""
        await self.ensure()
        await self._say(json.dumps({"attack": name, "target": dataclasses.asdict(target)}))
        assert await self._line(60) == "engaged"

    async def stop(self) -> dict[str, Any]:
        await self._say("stop")
        return await self._report(120)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@dataclass
class GoodRun:
    """One run of the good producer."""

    rate: float
    attempted: int
    acked: int
    failure: str = ""
    #: How long the run took, connection and flush included (seconds).
    elapsed: float = 0.0


async def good_run(
    arena: Arena, stream: str, first: int, seconds: float, max_records: int
) -> GoodRun:
    """Send records ``first..`` to ``stream`` for ``seconds``; records acked per second.

    The clock starts before the connection is opened, so a producer kept out
    (no slot, no credit) measures as slow as it was.
    """
    loop = asyncio.get_running_loop()
    producer = Producer(
        arena.address,
        security=arena.security(),
        producer_id=GOOD_PRODUCER,
        reconnect_timeout=seconds + 2,
        client_name="good",
    )
    started = loop.time()
    i = first
    failure = ""
    try:
        async with asyncio.timeout(seconds + 10):
            async with producer:
                while i - first < max_records and loop.time() - started < seconds:
                    for k in range(i, i + 500):
                        await producer.send(stream, record(stream, k))
                    i += 500
                await producer.flush()
    except (ProducerError, TimeoutError) as error:
        failure = f"{type(error).__name__}: {error}"
    elapsed = loop.time() - started
    stats = producer.statistics()
    acked = stats.streams[stream].records_acked if stream in stats.streams else 0
    if not failure and stats.reconnects:
        failure = f"reconnected {stats.reconnects} times: {stats.last_error}"
    return GoodRun(
        rate=acked / max(elapsed, 1e-6),
        attempted=i - first,
        acked=acked,
        failure=failure,
        elapsed=elapsed,
    )


@dataclass
class Ledger:
    """What the good producer's stream must hold, checked window by window."""

    stream: str
    #: The next record index the good producer sends.
    next_record: int = 0
    #: Log position up to which the stream was checked (and released).
    checked: int = 0
    lost: int = 0
    #: Checks that found records other than the good producer's next ones.
    mismatched: int = 0
    problems: list[str] = field(default_factory=list)

    async def check(self, arena: Arena, run: GoodRun) -> None:
        """The records of ``run``: the good producer's frames since the last check must
        be exactly its next records, in order, at least every acked one; then release."""
        first = self.next_record
        self.next_record += run.attempted
        directory = arena.data / "streams" / self.stream
        if not directory.exists():
            if run.acked:
                self.problems.append(f"{run.acked} acked records and no stream")
                self.lost += run.acked
            return
        await asyncio.sleep(0.05)  # the group commit of the last append
        reader = LogReader.open(directory)
        try:
            end = reader.published_position()
            values: list[bytes] = []
            for frame in reader.read(max(self.checked, reader.start_position()), end):
                if frame.producer_id == GOOD_PRODUCER:
                    values += decode_records(frame.payload).to_lists()[0]
        finally:
            reader.close()
        expected = [record(self.stream, k) for k in range(first, first + len(values))]
        if values != expected:
            self.mismatched += 1
            wrong = next(
                (k for k, (a, b) in enumerate(zip(values, expected, strict=True)) if a != b), 0
            )
            self.problems.append(
                f"stored records differ from those sent at {wrong}: {values[wrong][:24]!r}"
            )
        if len(values) < run.acked:
            self.lost += run.acked - len(values)
            self.problems.append(f"{run.acked - len(values)} acked records not stored")
        self.checked = end
        with contextlib.suppress(ReaderError, OSError):
            async with Reader(arena.address, security=arena.security()) as admin:
                await admin.release(self.stream, end)


@dataclass
class Measured:
    """One attack's figures: the good producer alone and attacked, and what the attacker got."""

    name: str
    base_rates: list[float] = field(default_factory=list)
    attacked_rates: list[float] = field(default_factory=list)
    lost: int = 0
    mismatched: int = 0
    problems: list[str] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    gateway_died: bool = False
    peak_memory: int = 0
    base_memory: int = 0
    seconds: float = 0.0
    #: Cores the gateway used during each run alone, and attacked; cores the
    #: attack worker used during each attacked run (CPU seconds / wall seconds).
    #: How long each good run took, alone and attacked (seconds).
    base_elapsed: list[float] = field(default_factory=list)
    attacked_elapsed: list[float] = field(default_factory=list)
    gateway_alone: list[float] = field(default_factory=list)
    gateway_attacked: list[float] = field(default_factory=list)
    attacker_cores: list[float] = field(default_factory=list)

    def extend(self, more: Measured) -> None:
        """Add the runs of ``more`` (the same attack, measured again) to these."""
        for name in (
            "base_rates",
            "attacked_rates",
            "problems",
            "reports",
            "failures",
            "base_elapsed",
            "attacked_elapsed",
            "gateway_alone",
            "gateway_attacked",
            "attacker_cores",
        ):
            getattr(self, name).extend(getattr(more, name))
        self.lost += more.lost
        self.mismatched += more.mismatched
        self.gateway_died |= more.gateway_died
        self.peak_memory = max(self.peak_memory, more.peak_memory)
        self.seconds += more.seconds

    def cores(self) -> str:
        """The medians of the gateway's cores alone / attacked, and the attacker's."""

        def med(values: list[float]) -> float:
            return statistics.median(values) if values else 0.0

        return (
            f"{med(self.gateway_alone):.2f} / {med(self.gateway_attacked):.2f} "
            f"| {med(self.attacker_cores):.2f}"
        )

    @property
    def base(self) -> float:
        return statistics.median(self.base_rates) if self.base_rates else 0.0

    @property
    def attacked(self) -> float:
        return statistics.median(self.attacked_rates) if self.attacked_rates else 0.0

    @property
    def ratio(self) -> float:
        return self.attacked / self.base if self.base else 0.0

    @property
    def pair_ratio(self) -> float:
        """The median over the A B pairs of attacked / alone, each pair run back to back.

        Steadier than :attr:`ratio` when the machine's other load changes
        from pair to pair: each run alone is compared with the attacked run
        right after it.
        """
        pairs = [
            attacked / alone if alone else 0.0
            for alone, attacked in zip(self.base_rates, self.attacked_rates, strict=False)
        ]
        return statistics.median(pairs) if pairs else 0.0

    def answer(self) -> str:
        """What the attacker was told, in a few words."""
        codes: dict[int, int] = {}
        closed = connections = 0
        for report in self.reports:
            for got in report["errors"]:
                for code in got:
                    codes[code] = codes.get(code, 0) + 1
            for code in report["scoped_errors"]:
                codes[-code] = codes.get(-code, 0) + 1
            closed += report["closed"]
            connections += report["connections"]
        parts = [
            f"{ErrorCode(abs(c)).name}{'(scoped)' if c < 0 else ''} x{n}"
            for c, n in sorted(codes.items(), key=lambda kv: -kv[1])
        ]
        return f"{closed}/{connections} closed; " + (", ".join(parts) or "no Error")


#: A good run must fit in its stream's log (released after each run): in a
#: third of it, at about this many bytes of log per record.
LOG_BYTES_PER_RECORD = 128


def records_that_fit(capacity_mib: int) -> int:
    """The most records one good run may send into a stream of ``capacity_mib``."""
    return capacity_mib * 1024 * 1024 // 3 // LOG_BYTES_PER_RECORD


def capacity_for(records: int) -> int:
    """The stream capacity (MiB) in which a good run of ``records`` fits."""
    return -(-records * 3 * LOG_BYTES_PER_RECORD // (1024 * 1024))


async def measure(
    arena: Arena,
    attacker: Attacker,
    name: str,
    stream: str,
    *,
    rounds: int = 2,
    seconds: float = 0.5,
    max_records: int = 100_000,
) -> Measured:
    """The good producer A B A B ... (``rounds`` of each), the attack on during each B."""
    started = time.monotonic()
    arena.ensure_up()
    max_records = min(max_records, records_that_fit(arena.capacity_mib))
    result = Measured(name=name)
    if name in TINY_ATTACKS and not arena.prepared:
        prepared = await attacker.prepare(arena.target())
        assert not prepared["exception"], prepared["exception"]
        arena.prepared = True
    ledger = Ledger(stream)
    # Warm-up: the stream exists (the attacks aimed at it bind it) and the
    # producer's first connection costs are paid.
    warm = await good_run(arena, stream, ledger.next_record, 0.1, 2_000)
    await ledger.check(arena, warm)
    for _ in range(rounds):
        cpu, wall = arena.cpu(), time.monotonic()
        alone = await good_run(arena, stream, ledger.next_record, seconds, max_records)
        result.gateway_alone.append((arena.cpu() - cpu) / (time.monotonic() - wall))
        result.base_rates.append(alone.rate)
        result.base_elapsed.append(alone.elapsed)
        await ledger.check(arena, alone)
        if alone.failure:
            result.failures.append("alone: " + alone.failure)
        if not result.base_memory:
            # The level before the attack, once the good producer ran at full
            # speed: its own buffers (TLS, the receive ring) are not the attack's.
            result.base_memory = arena.memory()
        await attacker.start(name, arena.target(stream))
        await asyncio.sleep(0.1)
        sampler = asyncio.get_running_loop().create_task(_sample_memory(arena, result))
        cpu, theirs, wall = arena.cpu(), attacker.cpu(), time.monotonic()
        try:
            attacked = await good_run(arena, stream, ledger.next_record, seconds, max_records)
        finally:
            sampler.cancel()
            took = time.monotonic() - wall
            result.gateway_attacked.append((arena.cpu() - cpu) / took)
            result.attacker_cores.append((attacker.cpu() - theirs) / took)
            report = await attacker.stop()
        result.attacked_rates.append(attacked.rate)
        result.attacked_elapsed.append(attacked.elapsed)
        result.reports.append(report)
        if attacked.failure:
            result.failures.append("attacked: " + attacked.failure)
        if not await arena.healthy():
            result.gateway_died = True
            result.problems.append("the gateway died or stopped storing:\n" + arena.log_tail(8))
            arena.restart()
            break
        await ledger.check(arena, attacked)
    result.lost = ledger.lost
    result.mismatched = ledger.mismatched
    result.problems += ledger.problems
    result.seconds = time.monotonic() - started
    return result


async def _sample_memory(arena: Arena, result: Measured) -> None:
    while True:
        result.peak_memory = max(result.peak_memory, arena.memory())
        await asyncio.sleep(0.05)


def victim_stream(name: str) -> str:
    """The good producer's stream for an attack: short, so that 1,000 binds of it fit."""
    return f"g-{list(ATTACKS).index(name)}" if name in ATTACKS else f"g-{name}"
