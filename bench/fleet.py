"""Benchmark: a fleet of 1, 2 and 3 gateways on this machine, keyed producers over all of them.

    .venv/bin/python bench/fleet.py             # 3M records per producer, best of 2 rounds
    .venv/bin/python bench/fleet.py --quick     # 300k records per producer, 1 round
    .venv/bin/python bench/fleet.py --gateways 1 2 4 --records 1000000

Each case starts N ``headgate serve`` gateways on 127.0.0.1, each on a fresh
temporary data directory and with the same settings in every case (512 MiB
per partition, the default term length, 2 ms group commit), and writes the
cluster file they all read: gateways ``gw1`` .. ``gwN`` and one partitioned
stream, ``bench``, of 6 partitions (``--partitions``) spread round robin
(with 3 gateways, gw1 holds partitions 0 and 3). The same partitions in
every case, so only the number of gateways changes.

Producers: one process per gateway (``--producers-per-gateway``), started
with multiprocessing (spawn), so N gateways get N producers. Each is a
``FleetProducer`` on the cluster file that sends ``--records`` keyed
100-byte records (its own 4,096 keys of 9 bytes, cycled) with one
``await send_many()`` per 4,096 records (``--send single``: one ``await
send()`` per record, what the first runs measured, when the producer was the
limit), then ``flush()``; the keys' hash spreads every
producer's records over every partition, so each producer writes to every
gateway. Before the clock starts, each producer sends one record to every
partition and flushes (the binds are not timed); then all start together.

Figures, per case:

- aggregate durable records/s: all producers' records over the span from the
  first producer's start to the return of the last ``flush()``, which returns
  once each gateway has acknowledged its records durable (after an fsync);
- CPU seconds per million records: utime + stime of each process, all its
  threads (``/proc/PID/stat``), from the word to start to the last
  producer's result, divided by the records it handled: for a gateway, the
  records of the partitions it holds; for a producer, the records it sent.
  "All gateways" is the gateways' CPU together over all records: flat as
  gateways are added means a record costs the fleet no more;
- the ratio of the aggregate to the 1-gateway case of the same run.

A round runs every case once, one after the other; the best round of each
case (by aggregate rate) is shown, all its figures from that round.

On a machine with fewer cores than the 2N processes of a case (2 cores
here), the gateways and producers compete for the CPU, so the aggregate
cannot grow much with N: what shows scaling is CPU per record staying flat.
The report projects N gateways on N machines as N x the 1-gateway rate,
which holds if CPU per record stays flat, with the measured CPU-per-record
ratio beside it. The projection is arithmetic, not a measurement: it assumes
each machine gets the CPU and disk the 1-gateway case had here, and leaves
out the network between machines (here all is loopback).

No Release is sent: each case writes fresh partitions, inside their
capacity (``--records`` is capped so that it fits), so credit never runs out.
Every process the benchmark starts is ended by its pid (SIGTERM, then
SIGKILL), and every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # ingest.py: how the benchmarks start and stop processes

from headgate.client.fleet import FleetProducer  # noqa: E402
from headgate.cluster import load_cluster, partition_of  # noqa: E402
from ingest import (  # noqa: E402
    START_TIMEOUT_S,
    TERM_LENGTH,
    Server,
    _go,
    _headgate_command,
    _load,
    _machine,
    stop_workers,
)

#: The partitioned stream every case writes.
STREAM = "bench"
RECORD = b"x" * 100
#: Keys per producer (a power of two: a record's key is keys[i & KEY_MASK]).
KEYS = 4096
KEY_MASK = KEYS - 1
KEY_BYTES = len(b"p00-00000")
CASES = (1, 2, 3)
PARTITIONS = 6
STREAM_CAPACITY = "512MiB"
#: Record bytes one case may write to one partition: well inside STREAM_CAPACITY.
PAYLOAD_CAP = 384 * 1024 * 1024
#: A keyed record's bytes in a partition's log, at most: value, key, its two
#: offsets, the log's framing and a share of the batch's.
FOOTPRINT = len(RECORD) + KEY_BYTES + 16
#: A partition's share of the records may exceed 1/partitions (4,096 keys, hashed).
SHARE_MARGIN = 0.8
COMMIT_MS = 2.0
#: A producer looks at the clock every CHECK_EVERY records, and sends them in one
#: bulk call; a multiple of KEYS, so that each call cycles the keys from key 0.
CHECK_EVERY = 4096
#: A producer stops sending after this long, whatever --records says.
RUN_LIMIT_S = 300.0
#: Beyond RUN_LIMIT_S: the flush, and the benchmark's wait for the results.
RESULT_GRACE_S = 60.0
#: How long a producer that has sent its result waits for the word to exit.
EXIT_WAIT_S = 60.0
#: Spawning a producer, importing headgate, connecting and the warm-up.
READY_TIMEOUT_S = START_TIMEOUT_S + 60.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- pure parts (tests/bench/test_fleet_bench.py) ---------------------------------------


def cpu_seconds_of_stat(text: str, ticks_per_second: int) -> float:
    """utime + stime, in seconds, from the text of ``/proc/PID/stat`` (all threads).

    Field 2, the command name, is in parentheses and may itself hold spaces
    and parentheses, so the fields are counted from the last ``)``: the first
    after it is field 3 (the state), utime and stime are fields 14 and 15.
    """
    fields = text[text.rindex(")") + 1 :].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def partition_counts(key_partitions: Sequence[int], sent: int, partitions: int) -> list[int]:
    """Records per partition after ``sent`` records that cycle through keys whose
    partitions are ``key_partitions`` (record ``i`` has key ``i % len(key_partitions)``)."""
    full, rest = divmod(sent, len(key_partitions))
    counts = [0] * partitions
    for index, partition in enumerate(key_partitions):
        counts[partition] += full + (1 if index < rest else 0)
    return counts


def key_of(producer: int, index: int) -> bytes:
    """Producer ``producer``'s key number ``index`` (KEY_BYTES bytes)."""
    return f"p{producer % 100:02d}-{index:05d}".encode()


def records_cap(partitions: int, producers: int) -> int:
    """The most records per producer that keep every partition inside PAYLOAD_CAP."""
    return int(PAYLOAD_CAP * partitions * SHARE_MARGIN / FOOTPRINT / producers)


# --- a producer (runs in its own process) -------------------------------------------------


@dataclass(frozen=True)
class ProducerSpec:
    index: int
    cluster: str
    records: int
    partitions: int
    #: "bulk": send_many per CHECK_EVERY records; "single": send per record.
    send: str = "bulk"


@dataclass
class ProducerResult:
    records: int = 0
    start: float = 0.0
    end: float = 0.0
    #: Records sent to each partition.
    per_partition: list[int] = field(default_factory=list)
    error: str | None = None


async def _produce(conn: Connection, spec: ProducerSpec) -> ProducerResult:
    keys = [key_of(spec.index, i) for i in range(KEYS)]
    key_partitions = [partition_of(key, spec.partitions) for key in keys]
    first_key: dict[int, bytes] = {}
    for key, partition in zip(keys, key_partitions, strict=True):
        first_key.setdefault(partition, key)
    producer = FleetProducer(cluster=spec.cluster, client_name=f"bench-fleet-{spec.index}")
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            await producer.connect()
            for key in first_key.values():  # binds every partition; not counted
                await producer.send(STREAM, RECORD, key)
            await producer.flush()
        await _go(conn)
        sent = 0
        started = time.monotonic()
        stop_at = started + RUN_LIMIT_S
        async with asyncio.timeout(RUN_LIMIT_S + RESULT_GRACE_S):
            # CHECK_EVERY is a multiple of KEYS: every chunk starts at key 0.
            chunk_values = [RECORD] * CHECK_EVERY
            chunk_keys = keys * (CHECK_EVERY // KEYS)
            for _ in range(spec.records // CHECK_EVERY + 1):
                upto = min(sent + CHECK_EVERY, spec.records)
                if spec.send == "bulk":
                    count = upto - sent
                    await producer.send_many(STREAM, chunk_values[:count], chunk_keys[:count])
                else:
                    for i in range(sent, upto):
                        await producer.send(STREAM, RECORD, keys[i & KEY_MASK])
                sent = upto
                if sent >= spec.records or time.monotonic() > stop_at:
                    break
            await producer.flush()
        ended = time.monotonic()
        await producer.close()
    except Exception as exc:
        await producer.abort()
        return ProducerResult(error=f"{type(exc).__name__}: {exc}")
    return ProducerResult(
        records=sent,
        start=started,
        end=ended,
        per_partition=partition_counts(key_partitions, sent, spec.partitions),
    )


def _producer_process(conn: Connection, spec: ProducerSpec) -> None:
    """A producer process: warm up, say ready, send on the word, send the result back,
    then wait (bounded) for the benchmark to read its CPU time and say exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the benchmark stops us
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
        conn.send(("result", asyncio.run(_produce(conn, spec))))
        conn.poll(EXIT_WAIT_S)


# --- a case (the benchmark side) ----------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """A running process's CPU time so far, all threads."""
    return cpu_seconds_of_stat(Path(f"/proc/{pid}/stat").read_text(), CLOCK_TICKS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_cluster(path: Path, ports: dict[str, int], partitions: int) -> Path:
    """The cluster file of one case: its gateways, and ``bench`` spread round robin."""
    lines = []
    for name, port in ports.items():
        lines += [f"[gateways.{name}]", f'address = "127.0.0.1:{port}"']
    lines += [f"[streams.{STREAM}]", f"partitions = {partitions}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def serve_arguments(data_dir: Path, port: int, cluster: Path, name: str) -> list[str]:
    """``serve`` and its options, as every gateway of every case runs."""
    return [
        "serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(data_dir),
        "--cluster",
        str(cluster),
        "--name",
        name,
        "--stream-capacity",
        STREAM_CAPACITY,
        "--term-length",
        TERM_LENGTH,
        "--group-commit-ms",
        f"{COMMIT_MS:g}",
    ]


@dataclass
class Case:
    """One case's figures: N gateways, their producers."""

    gateways: int
    producers: int
    records: int = 0
    seconds: float = 0.0
    #: Per gateway: CPU seconds over the run, and the records of its partitions.
    gateway_cpu: dict[str, float] = field(default_factory=dict)
    gateway_records: dict[str, int] = field(default_factory=dict)
    producer_cpu: list[float] = field(default_factory=list)
    producer_records: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 and not self.error else 0.0

    def gateway_cpu_per_m(self, name: str) -> float:
        return per_million(self.gateway_cpu[name], self.gateway_records[name])

    @property
    def gateways_cpu_per_m(self) -> float:
        return per_million(sum(self.gateway_cpu.values()), self.records)

    @property
    def producers_cpu_per_m(self) -> float:
        return per_million(sum(self.producer_cpu), sum(self.producer_records))

    @property
    def all_cpu(self) -> float:
        return sum(self.gateway_cpu.values()) + sum(self.producer_cpu)


def per_million(cpu: float, records: int) -> float:
    return cpu / records * 1e6 if records > 0 else 0.0


def _stop_producers(procs: list[BaseProcess], pipes: list[Connection]) -> None:
    stop_workers(procs, pipes, 5.0, "producer")


def run_case(args: argparse.Namespace, root: Path, gateways: int, label: str) -> Case:
    """Start ``gateways`` gateways and their producers, run, measure, stop them all."""
    producers = gateways * args.producers_per_gateway
    case = Case(gateways=gateways, producers=producers)
    directory = root / label
    directory.mkdir()
    names = [f"gw{i + 1}" for i in range(gateways)]
    ports = {name: free_port() for name in names}
    cluster = write_cluster(directory / "cluster.toml", ports, args.partitions)
    holders = load_cluster(cluster).stream(STREAM).holders
    servers: list[Server] = []
    procs: list[BaseProcess] = []
    pipes: list[Connection] = []
    try:
        for name in names:
            argv = serve_arguments(directory / name, ports[name], cluster, name)
            servers.append(Server(name, [*_headgate_command(), *argv], directory / f"{name}.log"))
        context = multiprocessing.get_context("spawn")
        for index in range(producers):
            spec = ProducerSpec(index, str(cluster), args.records, args.partitions, args.send)
            ours, theirs = context.Pipe()
            proc = context.Process(target=_producer_process, args=(theirs, spec), daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            pipes.append(ours)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for pipe in pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("a producer was not ready in time")
            kind, value = pipe.recv()
            if kind != "ready":
                raise RuntimeError(f"a producer failed before the start: {value.error}")
        gateway_before = {s.name: cpu_seconds(s.pid) for s in servers}
        producer_before = [cpu_seconds(p.pid) for p in procs if p.pid is not None]
        for pipe in pipes:
            pipe.send(("go", None))
        results: list[ProducerResult] = []
        deadline = time.monotonic() + RUN_LIMIT_S + 2 * RESULT_GRACE_S
        for pipe in pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("a producer did not finish in time")
            results.append(pipe.recv()[1])
        gateway_after = {s.name: cpu_seconds(s.pid) for s in servers}
        producer_after = [cpu_seconds(p.pid) for p in procs if p.pid is not None]
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(errors[0])
        case.records = sum(r.records for r in results)
        case.seconds = max(r.end for r in results) - min(r.start for r in results)
        case.gateway_cpu = {n: gateway_after[n] - gateway_before[n] for n in names}
        case.gateway_records = dict.fromkeys(names, 0)
        for result in results:
            for partition, count in enumerate(result.per_partition):
                case.gateway_records[holders[partition]] += count
        case.producer_cpu = [a - b for a, b in zip(producer_after, producer_before, strict=True)]
        case.producer_records = [r.records for r in results]
    except (OSError, RuntimeError, TimeoutError, EOFError) as exc:
        case.error = f"{type(exc).__name__}: {exc}"
    finally:
        _stop_producers(procs, pipes)
        for server in servers:
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return case


# --- the report ---------------------------------------------------------------------------


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if value > 0 and base > 0 else "-"


def report(
    args: argparse.Namespace, best: dict[int, Case], load_start: str, elapsed: float
) -> None:
    cores = len(os.sched_getaffinity(0))
    command = " ".join([".venv/bin/python", "bench/fleet.py", *sys.argv[1:]])
    print(f"## Fleet benchmark: `{command}`\n")
    print(f"- machine: {_machine()[0]}")
    print(f"- load average (1/5/15 min): {load_start} at start, {_load()} at end")
    print(
        f"- gateways: `headgate serve --cluster cluster.toml --name gwK --stream-capacity "
        f"{STREAM_CAPACITY} --term-length {TERM_LENGTH} --group-commit-ms {COMMIT_MS:g}`, "
        "each on 127.0.0.1 and a fresh temporary data directory, all on this machine's disk"
    )
    print(
        f"- stream `{STREAM}`: {args.partitions} partitions, round robin over the gateways; "
        f"producers: {args.producers_per_gateway} process(es) per gateway, each a `FleetProducer` "
        f"sending {args.records:,} keyed {len(RECORD)}-byte records ({KEYS:,} keys of its own) "
        + (
            f"with one `await send_many()` per {CHECK_EVERY:,} records"
            if args.send == "bulk"
            else "with one `await send()` per record"
        )
        + " to every partition, then `flush()`"
    )
    rounds = "1 round" if args.rounds == 1 else f"best of {args.rounds} rounds"
    print(f"- {rounds} per case (by aggregate rate); {elapsed:.0f} s in all")
    print()
    print(
        "| gateways | producer processes | records | seconds | aggregate durable rec/s | "
        "ratio to 1 gateway | CPU s per M records, each gateway | all gateways | "
        f"producers | CPU used, of {cores} cores |"
    )
    print("|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|")
    base = best.get(1)
    base_rate = base.rate if base is not None else 0.0
    for n, case in sorted(best.items()):
        if case.error:
            print(f"| {n} | {case.producers} | failed: {case.error[:100]} | | | | | | | |")
            continue
        each = ", ".join(f"{g} {case.gateway_cpu_per_m(g):.2f}" for g in case.gateway_cpu)
        busy = case.all_cpu / (case.seconds * cores) if case.seconds > 0 else 0.0
        print(
            f"| {n} | {case.producers} | {case.records:,} | {case.seconds:.2f} | "
            f"{case.rate:,.0f} | {_ratio(case.rate, base_rate)} | {each} | "
            f"{case.gateways_cpu_per_m:.2f} | {case.producers_cpu_per_m:.2f} | {busy:.0%} |"
        )
    print()
    most = max(best)
    print(
        f"Here the {most * (1 + args.producers_per_gateway)} processes of the largest case "
        f"({most} gateways and their producers) share {cores} cores: the gateways compete "
        "for the CPU with each other and with the producers, so the aggregate cannot grow "
        "much with the number of gateways on this machine. What shows scaling is CPU per "
        "record staying flat as gateways are added."
    )
    print()
    if base is None or base.error or base_rate <= 0:
        print("(no 1-gateway figure in this run: no projection)")
        return
    print(
        f"Projection, arithmetic and not a measurement: N gateways on N machines, each "
        f"with its producers and as much CPU and disk as the 1-gateway case had here, "
        f"= N x {base_rate:,.0f} rec/s, if CPU per record stays flat. Beside it, the "
        "measured CPU per record relative to the 1-gateway case (above 1: each record costs "
        "more with more gateways, and where CPU is the limit the projection is that much too "
        "high). It leaves out the network between machines (here loopback)."
    )
    print()
    print(
        "| gateways (N) | projected on N machines, rec/s | gateways' CPU per record vs 1 "
        "gateway | producers' CPU per record vs 1 gateway | measured here, rec/s |"
    )
    print("|--:|--:|--:|--:|--:|")
    for n, case in sorted(best.items()):
        if case.error:
            continue
        print(
            f"| {n} | {n * base_rate:,.0f} | "
            f"{_ratio(case.gateways_cpu_per_m, base.gateways_cpu_per_m)} | "
            f"{_ratio(case.producers_cpu_per_m, base.producers_cpu_per_m)} | {case.rate:,.0f} |"
        )


def benchmark(args: argparse.Namespace) -> int:
    load_start = _load()
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="headgate-bench-fleet-"))
    best: dict[int, Case] = {}
    try:
        for round_number in range(1, args.rounds + 1):
            for gateways in args.gateways:
                case = run_case(args, root, gateways, f"round{round_number}-gw{gateways}")
                outcome = case.error or (
                    f"{case.rate:,.0f} rec/s, all gateways {case.gateways_cpu_per_m:.2f} and "
                    f"producers {case.producers_cpu_per_m:.2f} CPU s per M records"
                )
                print(
                    f"# round {round_number}, {gateways} gateway(s): {outcome} (load {_load()})",
                    file=sys.stderr,
                    flush=True,
                )
                kept = best.get(gateways)
                if kept is None or case.rate > kept.rate or (kept.error and not case.error):
                    best[gateways] = case
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, best, load_start, time.monotonic() - started)
    return 1 if any(case.error for case in best.values()) else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="300,000 records per producer, 1 round"
    )
    parser.add_argument(
        "--records", type=int, help="records per producer (default 3,000,000; capped to fit)"
    )
    parser.add_argument("--rounds", type=int, help="rounds; the best of each case is shown (2)")
    parser.add_argument(
        "--gateways",
        type=int,
        nargs="+",
        default=list(CASES),
        metavar="N",
        help="the cases: how many gateways (default 1 2 3)",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=PARTITIONS,
        help=f"partitions of the stream, the same in every case (default {PARTITIONS})",
    )
    parser.add_argument(
        "--producers-per-gateway",
        type=int,
        default=1,
        metavar="K",
        help="producer processes per gateway of a case (default 1)",
    )
    parser.add_argument(
        "--send",
        choices=("bulk", "single"),
        default="bulk",
        help="bulk: send_many per 4,096 records (default); single: send per record",
    )
    args = parser.parse_args()
    if args.records is None:
        args.records = 300_000 if args.quick else 3_000_000
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if min(args.gateways) < 1 or args.partitions < max(args.gateways):
        parser.error("every case needs 1 gateway or more, and at least one partition per gateway")
    if args.records < 1 or args.rounds < 1 or args.producers_per_gateway < 1:
        parser.error("--records, --rounds and --producers-per-gateway must be at least 1")
    cap = records_cap(args.partitions, max(args.gateways) * args.producers_per_gateway)
    if args.records > cap:
        print(f"# --records capped at {cap:,}, to fit the partitions", file=sys.stderr)
        args.records = cap

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    return benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
