"""Where a slow durable ack's time goes: a steady paced load, with the gateway's commit trace on.

    .venv/bin/python bench/acktrace.py --rate 1200000 --seconds 60   # a probe run
    .venv/bin/python bench/acktrace.py --analyze TRACE.jsonl         # a gateway trace alone

A probe run starts ``headgate serve`` with ``HEADGATE_COMMIT_TRACE`` set
(see ``headgate.gateway.commit_trace``), then this process sends records at
``--rate`` in bursts every 1 ms, each closed by ``flush(stream)``, as
``bench/ingest.py`` row 4 does, for ``--seconds``; every 2 s it releases what
is durable (so a load of minutes keeps the log inside its capacity and the
disk's use bounded, and the gateway frees terms as it would under Spark).
Extra ``serve`` options go after ``--``.

Each burst's time, from its first ``send()`` to the return of its
``flush()``, is cut into:

- ``send``: the producer's own ``send()`` calls of the burst;
- ``to gateway``: from the flush call to the arrival of the burst's last
  batch at the gateway (the flush task's turn, the seal, the socket, the
  gateway's read and decode);
- the gateway's part, from that arrival to the Ack being written, cut by the
  phases of the group commit that acked it (below);
- ``to producer``: from the Ack being written to ``flush()`` returning.

A group commit's phases, on the event loop's clock: ``before`` (the batch
arrived while the previous commit was still under way: its remaining
fsync and acks), ``interval`` (the commit's wait), ``loop lag`` (from the
end of the wait to the loop running the commit), ``to thread`` (to the
fsync thread starting: it needs the GIL), ``fsync`` (the thread's syncs),
``to loop`` (from the thread's end to the loop resuming: the GIL again, and
the loop's other work), ``acks`` (the loop's work until the batch's Ack was
written). ``gc`` is the garbage collections that overlapped (part of the
other phases). A batch that arrived before the previous commit's fsync
began and was not in it is counted as ``missed`` (its append came late).

The report: percentiles of bursts and of each part over all bursts, then the
mean of each part over the slow bursts (at or above ``--slow-ms``, default
the p99), and the machine's load average at start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BURST_INTERVAL_S = 0.001
RELEASE_INTERVAL_S = 2.0
START_TIMEOUT_S = 30.0
_LISTENING = re.compile(r"listening on (\S+):(\d+)")

GATEWAY_PHASES = ("before", "interval", "loop lag", "to thread", "fsync", "to loop", "acks")
BURST_PARTS = ("send", "to gateway", *GATEWAY_PHASES, "to producer")


# --- the trace ---------------------------------------------------------------------------


@dataclass
class Commit:
    number: int
    due: float | None
    woke: float
    thread: float
    synced: float
    resumed: float
    done: float
    streams: list[tuple[str, int, float | None]]
    interval: float

    @property
    def waited_from(self) -> float:
        return self.woke if self.due is None else self.due - self.interval

    def spans(self) -> list[tuple[str, float, float]]:
        """The commit's phases after its wait began, as (name, start, end)."""
        due = self.woke if self.due is None else self.due
        return [
            ("interval", self.waited_from, due),
            ("loop lag", due, self.woke),
            ("to thread", self.woke, self.thread),
            ("fsync", self.thread, self.synced),
            ("to loop", self.synced, self.resumed),
            ("acks", self.resumed, self.done),
        ]


@dataclass
class Trace:
    header: dict[str, Any]
    commits: dict[int, Commit]
    #: (commit, stream, written at, arrivals)
    acks: list[tuple[int, str, float, list[float]]]
    #: (start, seconds, generation)
    gcs: list[tuple[float, float, int]]
    #: The loop's stalls, and the log writer's long passes: (start, seconds).
    stalls: list[tuple[float, float]] = field(default_factory=list)
    #: Per stall: (since the tick before, seconds run, seconds waiting for a CPU).
    stall_use: list[tuple[float, float, float]] = field(default_factory=list)
    appends: list[tuple[float, float]] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)

    def previous(self, number: int) -> Commit | None:
        i = bisect.bisect_left(self.numbers, number)
        return self.commits[self.numbers[i - 1]] if i > 0 else None

    def gc_within(self, start: float, end: float) -> float:
        return sum(overlap(start, end, at, at + s) for at, s, _ in self.gcs)

    def stalled_within(self, start: float, end: float) -> float:
        return sum(overlap(start, end, at, at + s) for at, s in self.stalls)

    def appending_within(self, start: float, end: float) -> float:
        return sum(overlap(start, end, at, at + s) for at, s in self.appends)


def load_trace(path: Path) -> Trace:
    header: dict[str, Any] = {}
    commits: dict[int, Commit] = {}
    acks: list[tuple[int, str, float, list[float]]] = []
    gcs: list[tuple[float, float, int]] = []
    stalls: list[tuple[float, float]] = []
    stall_use: list[tuple[float, float, float]] = []
    appends: list[tuple[float, float]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if "trace" in event:
            header = event
        elif "commit" in event:
            commits[event["commit"]] = Commit(
                number=event["commit"],
                due=event["due"],
                woke=event["woke"],
                thread=event["thread"],
                synced=event["synced"],
                resumed=event["resumed"],
                done=event["done"],
                streams=[tuple(s) for s in event["streams"]],
                interval=header.get("interval_s", 0.0),
            )
        elif "acks" in event:
            acks.append((event["acks"], event["stream"], event["at"], event["arrived"]))
        elif "gc" in event:
            gcs.append((event["at"], event["seconds"], event["gc"]))
        elif "stall" in event:
            stalls.append((event["stall"], event["seconds"]))
            stall_use.append((event["since"], event["cpu"], event["runqueue"]))
        elif "appends" in event:
            appends.append((event["appends"], event["seconds"]))
    trace = Trace(header, commits, acks, gcs, stalls, stall_use, appends)
    trace.numbers = sorted(commits)
    return trace


def overlap(start: float, end: float, span_start: float, span_end: float) -> float:
    return max(0.0, min(end, span_end) - max(start, span_start))


def gateway_parts(trace: Trace, number: int, arrived: float, at: float) -> dict[str, float]:
    """The wait ``[arrived, at]`` of a batch acked by commit ``number``, cut by phase."""
    commit = trace.commits.get(number)
    parts = dict.fromkeys(GATEWAY_PHASES, 0.0)
    if commit is None:
        return parts
    parts["before"] = max(0.0, min(at, commit.waited_from) - arrived)
    for name, start, end in commit.spans():
        parts[name] += overlap(arrived, at, start, end)
    previous = trace.previous(number)
    parts["missed"] = 1.0 if previous is not None and arrived < previous.thread else 0.0
    parts["gc"] = trace.gc_within(arrived, at)
    parts["loop stalled"] = trace.stalled_within(arrived, at)
    return parts


# --- reports --------------------------------------------------------------------------


def quantile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def table(rows: Iterable[Sequence[str]], header: Sequence[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe(
    samples: list[dict[str, float]], total_key: str, names: Sequence[str], slow_s: float | None
) -> str:
    """Percentiles of each part over all samples, and its mean over the slow ones."""
    if not samples:
        return "(no samples)"
    totals = sorted(s[total_key] for s in samples)
    threshold = quantile(totals, 0.99) if slow_s is None else slow_s
    slow = [s for s in samples if s[total_key] >= threshold]
    rows = []
    extra = [n for n in ("producer gc", "producer stalled") if any(n in s for s in samples)]
    for name in [total_key, *names, "loop stalled", "gc", *extra, "missed"]:
        values = sorted(s.get(name, 0.0) for s in samples)
        slow_mean = sum(s.get(name, 0.0) for s in slow) / len(slow) if slow else 0.0
        if name == "missed":
            rows.append(
                [name, f"{sum(values):.0f} of {len(values)}", "", "", f"{slow_mean:.2f} (share)"]
            )
            continue
        rows.append(
            [
                name,
                ms(quantile(values, 0.5)),
                ms(quantile(values, 0.99)),
                ms(values[-1]),
                ms(slow_mean),
            ]
        )
    out = table(rows, ["part", "p50 ms", "p99 ms", "max ms", f"mean over {len(slow)} slow ms"])
    return out + f"\n\nslow: at or above {ms(threshold)} ms ({len(slow)} of {len(samples)})"


def commit_report(trace: Trace) -> str:
    """Each phase over every commit, and what the commits synced."""
    commits = [trace.commits[n] for n in trace.numbers]
    if not commits:
        return "(no commits)"
    rows = []
    for name in ("loop lag", "to thread", "fsync", "to loop", "acks"):
        values = sorted(
            next(end - start for phase, start, end in c.spans() if phase == name) for c in commits
        )
        rows.append([name, ms(quantile(values, 0.5)), ms(quantile(values, 0.99)), ms(values[-1])])
    periods = sorted(b.woke - a.woke for a, b in itertools.pairwise(commits))
    if periods:
        rows.append(
            [
                "commit to commit",
                ms(quantile(periods, 0.5)),
                ms(quantile(periods, 0.99)),
                ms(periods[-1]),
            ]
        )
    gcs = sorted(s for _, s, _ in trace.gcs)
    text = table(rows, ["phase (all commits)", "p50 ms", "p99 ms", "max ms"])
    span = commits[-1].done - commits[0].woke
    text += (
        f"\n\n{len(commits)} commits in {span:.1f} s; garbage collections: {len(gcs)}"
        + (f", longest {ms(gcs[-1])} ms, total {ms(sum(gcs))} ms" if gcs else "")
        + f"; by generation {_by_generation(trace)}"
    )
    term_length = trace.header.get("term_length")
    crossings = set(_term_crossings(commits, term_length) if term_length else [])
    # The slowest commits (woke to done at or above its p99): what came with them?
    took = sorted(c.done - c.woke for c in commits)
    threshold = quantile(took, 0.99)
    slow = [c for c in commits if c.done - c.woke >= threshold]
    text += (
        f"\nterms entered: {len(crossings)}; the {len(slow)} slowest commits (woke to done "
        f">= {ms(threshold)} ms): {sum(c.number in crossings for c in slow)} entered a term, "
        f"{sum(trace.gc_within(c.woke, c.done) > 0 for c in slow)} had a gc"
    )
    text += "\n\n" + stall_report(trace)
    return text


def stall_report(trace: Trace) -> str:
    """The loop's stalls: how many, how long, and what came with the longest."""
    if not trace.stalls:
        return "loop stalls (a 1 ms timer more than 2 ms late): none"
    stalls = sorted(zip(trace.stalls, trace.stall_use, strict=True), key=lambda x: -x[0][1])
    total = sum(s for (_, s), _ in stalls)
    # Where the loop thread's time went over each stall (from its previous tick):
    # running, waiting for a CPU, or off the CPU (blocked in the kernel, or idle
    # in epoll for at most the 1 ms timer).
    spans = [at + s - since for (at, s), (since, _, _) in stalls]
    ran = sum(cpu for _, (_, cpu, _) in stalls)
    queued = sum(wait for _, (_, _, wait) in stalls)
    lines = [
        f"loop stalls (a 1 ms timer more than 2 ms late): {len(stalls)}, {ms(total)} ms late "
        f"in all, longest {ms(stalls[0][0][1])} ms. Over the {ms(sum(spans))} ms they span, "
        f"the loop thread ran {ms(ran)} ms, waited for a CPU {ms(queued)} ms, and was off "
        f"the CPU (blocked, or idle up to 1 ms per tick) {ms(sum(spans) - ran - queued)} ms. "
        "The longest, with what overlapped them:",
        "",
        "| at s | stall ms | ran ms | waited for CPU ms | appends ms | gc ms | fsync ms |",
        "|---|---|---|---|---|---|---|",
    ]
    first = min(c.woke for c in trace.commits.values()) if trace.commits else 0.0
    for (at, seconds), (_, cpu, wait) in stalls[:8]:
        end = at + seconds
        fsync = sum(overlap(at, end, c.thread, c.synced) for c in trace.commits.values())
        lines.append(
            f"| {at - first:.3f} | {ms(seconds)} | {ms(cpu)} | {ms(wait)} | "
            f"{ms(trace.appending_within(at, end))} | {ms(trace.gc_within(at, end))} | "
            f"{ms(fsync)} |"
        )
    return "\n".join(lines)


def _by_generation(trace: Trace) -> str:
    counts: dict[int, int] = {}
    for _, _, generation in trace.gcs:
        counts[generation] = counts.get(generation, 0) + 1
    return ", ".join(f"gen{g}: {n}" for g, n in sorted(counts.items())) or "none"


def _term_crossings(commits: list[Commit], term_length: int) -> list[int]:
    """Numbers of the commits whose sync took a stream into a new term."""
    last: dict[str, int] = {}
    out = []
    for c in commits:
        for name, tail, _ in c.streams:
            term = tail // term_length
            if name in last and term != last[name]:
                out.append(c.number)
            last[name] = term
    return out


def batch_samples(trace: Trace) -> list[dict[str, float]]:
    """Every acked batch, its latency cut by the phases of its commit."""
    samples = []
    for number, _, at, arrivals in trace.acks:
        for arrived in arrivals:
            parts = gateway_parts(trace, number, arrived, at)
            parts["latency"] = at - arrived
            samples.append(parts)
    return samples


def analyze(path: Path, slow_ms: float | None) -> str:
    trace = load_trace(path)
    slow = None if slow_ms is None else slow_ms / 1e3
    return (
        f"trace {path}: {trace.header}\n\n"
        + commit_report(trace)
        + "\n\nAcked batches (gateway: from arrival to Ack written):\n\n"
        + describe(batch_samples(trace), "latency", GATEWAY_PHASES, slow)
    )


# --- the probe -----------------------------------------------------------------------


@dataclass
class Burst:
    start: float
    flushed: float
    end: float = 0.0


class GcPauses:
    """This process's garbage collections (the producer's), as (start, seconds)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._started = now
        else:
            self.pauses.append((self._started, now - self._started))

    def within(self, start: float, end: float) -> float:
        return sum(overlap(start, end, at, at + s) for at, s in self.pauses)


class LoopStalls:
    """This process's event loop running a 1 ms timer more than 2 ms late (the producer's).

    As the gateway's trace does (``CommitTrace.watch_loop``): each stall as
    (start, seconds, seconds the thread ran, seconds it waited for a CPU).
    """

    def __init__(self) -> None:
        self.stalls: list[tuple[float, float, float, float]] = []

    async def watch(self) -> None:
        from headgate.gateway.commit_trace import (
            STALL_S,
            WATCH_INTERVAL_S,
            _open_schedstat,
            _read_schedstat,
        )

        fd = _open_schedstat()
        before = time.monotonic()
        ran, waited = _read_schedstat(fd)
        try:
            while True:
                await asyncio.sleep(WATCH_INTERVAL_S)
                now = time.monotonic()
                now_ran, now_waited = _read_schedstat(fd)
                late = now - before - WATCH_INTERVAL_S
                if late > STALL_S:
                    self.stalls.append(
                        (
                            before + WATCH_INTERVAL_S,
                            late,
                            (now_ran - ran) / 1e9,
                            (now_waited - waited) / 1e9,
                        )
                    )
                ran, waited, before = now_ran, now_waited, time.monotonic()
        finally:
            if fd is not None:
                os.close(fd)

    def within(self, start: float, end: float) -> float:
        return sum(overlap(start, end, at, at + s) for at, s, _, _ in self.stalls)

    def summary(self) -> str:
        late = sum(s for _, s, _, _ in self.stalls)
        ran = sum(r for _, _, r, _ in self.stalls)
        waited = sum(w for _, _, _, w in self.stalls)
        return (
            f"producer loop stalls: {len(self.stalls)}, {ms(late)} ms late in all; over them "
            f"it ran {ms(ran)} ms (its own sends and acks) and waited for a CPU {ms(waited)} ms"
        )


def join_bursts(
    trace: Trace,
    stream: str,
    bursts: list[Burst],
    producer_gc: GcPauses | None = None,
    producer_stalls: LoopStalls | None = None,
) -> list[dict[str, float]]:
    """Each burst's time cut into the producer's, the wire's and the commit's parts."""
    acks = sorted(
        (at, number, arrivals) for number, name, at, arrivals in trace.acks if name == stream
    )
    times = [a[0] for a in acks]
    samples = []
    for burst in bursts:
        if not burst.end:
            continue
        # The Ack that ended the flush: the latest one written before it returned.
        i = bisect.bisect_right(times, burst.end) - 1
        if i < 0:
            continue
        at, number, arrivals = acks[i]
        after = [a for a in arrivals if a >= burst.flushed]
        arrived = min(after) if after else max(arrivals)
        parts = gateway_parts(trace, number, arrived, at)
        parts["send"] = burst.flushed - burst.start
        parts["to gateway"] = max(0.0, arrived - burst.flushed)
        parts["to producer"] = burst.end - at
        parts["burst"] = burst.end - burst.start
        # Over the whole burst: a stall before the batch arrived delayed its read.
        parts["loop stalled"] = trace.stalled_within(burst.start, burst.end)
        if producer_gc is not None:
            parts["producer gc"] = producer_gc.within(burst.start, burst.end)
        if producer_stalls is not None:
            parts["producer stalled"] = producer_stalls.within(burst.start, burst.end)
        samples.append(parts)
    return samples


def _pool(size: int, count: int = 10_000) -> list[bytes]:
    blob = os.urandom(size * count)
    return [blob[i * size : (i + 1) * size] for i in range(count)]


async def _paced(
    address: tuple[str, int],
    stream: str,
    rate: float,
    seconds: float,
    size: int,
    stalls: LoopStalls,
) -> tuple[list[Burst], int]:
    from headgate.client import Producer
    from headgate.client.control import ReleaseClient

    pool = _pool(size)
    bursts: list[Burst] = []
    pending: list[asyncio.Task[None]] = []
    releases = ReleaseClient(address, client_name="acktrace")
    producer = Producer(address, client_name="acktrace")

    async def timed(burst: Burst) -> None:
        await producer.flush(stream)
        burst.end = time.monotonic()

    watcher = asyncio.create_task(stalls.watch())
    try:
        await producer.connect()
        await producer.send(stream, pool[0])
        await producer.flush()
        most = max(1, int(rate * 5 * BURST_INTERVAL_S))
        start = time.monotonic()
        deadline = start + seconds
        next_release = start + RELEASE_INTERVAL_S
        marker = None
        sent = index = 0
        tick = 0
        while (now := time.monotonic()) < deadline:
            tick += 1
            due = min(int(rate * (now - start)) - sent, most)
            if due > 0:
                burst = Burst(now, 0.0)
                for _ in range(due):
                    await producer.send(stream, pool[index])
                    index = (index + 1) % len(pool)
                sent += due
                burst.flushed = time.monotonic()
                bursts.append(burst)
                pending.append(asyncio.create_task(timed(burst)))
            if now >= next_release:
                next_release += RELEASE_INTERVAL_S
                if marker is not None and marker.done():
                    releases.release(stream, marker.result().durable_position)
                    marker = None
                if marker is None:
                    marker = await producer.send_many(stream, [pool[0]])
            await asyncio.sleep(max(0.0, start + tick * BURST_INTERVAL_S - time.monotonic()))
        await asyncio.gather(*pending)
        elapsed = time.monotonic() - start
        print(
            f"# sent {sent:,} records in {elapsed:.1f} s: {sent / elapsed:,.0f} rec/s", flush=True
        )
        await producer.close()
        return bursts, sent
    finally:
        watcher.cancel()
        await producer.abort()
        releases.close(2.0)


def _serve(
    data_dir: Path, trace: Path, extra: list[str], log: Path, switch_interval_ms: float | None
) -> tuple[subprocess.Popen[bytes], int]:
    # The gateway's GIL switch interval (the longest the fsync thread waits for
    # the loop thread to let go of the GIL), if --switch-interval-ms asks.
    preamble = "pass"
    if switch_interval_ms is not None:
        preamble = f"sys.setswitchinterval({switch_interval_ms / 1e3})"
    argv = [
        sys.executable,
        "-c",
        f"import sys; {preamble}; from headgate.cli import main; sys.argv[0] = 'headgate'; main()",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data_dir),
        "--stream-capacity",
        "1GiB",
        "--group-commit-ms",
        "2",
        *extra,
    ]
    env = dict(os.environ, HEADGATE_COMMIT_TRACE=str(trace))
    with open(log, "wb") as err:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env)
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        match = _LISTENING.search(line.decode(errors="replace"))
        if match:
            return process, int(match.group(2))
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError(f"the gateway did not start: {line!r}; see {log}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _disk_written() -> float:
    """Bytes written to the machine's disks so far (/proc/diskstats, whole disks only)."""
    total = 0.0
    try:
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        fields = line.split()
        if len(fields) > 9 and re.fullmatch(r"(vd|sd|xvd)[a-z]+|nvme\d+n\d+", fields[2]):
            total += int(fields[9]) * 512
    return total


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def probe(args: argparse.Namespace) -> int:
    base = Path(tempfile.mkdtemp(prefix="headgate-acktrace-"))
    trace_path = Path(args.keep_trace) if args.keep_trace else base / "trace.jsonl"
    trace_path.unlink(missing_ok=True)
    load_start = _load()
    written = _disk_written()
    producer_gc = GcPauses()
    gc.callbacks.append(producer_gc)
    producer_stalls = LoopStalls()
    process, port = _serve(
        base / "data", trace_path, args.serve, base / "gateway.log", args.switch_interval_ms
    )
    began = time.monotonic()
    cpu = _cpu_seconds(process.pid), time.process_time()
    try:
        bursts, sent = asyncio.run(
            _paced(
                ("127.0.0.1", port), "probe", args.rate, args.seconds, args.size, producer_stalls
            )
        )
        span = time.monotonic() - began
        gateway_cpu = (_cpu_seconds(process.pid) - cpu[0]) / span
        producer_cpu = (time.process_time() - cpu[1]) / span
        written = (_disk_written() - written) / span
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
        load_end = _load()
    trace = load_trace(trace_path)
    latencies = sorted(b.end - b.start for b in bursts if b.end)
    commits = [trace.commits[n] for n in trace.numbers]
    if args.brief:
        # One line per run, for interleaved comparisons.
        phases = {
            name: sorted(next(e - s for phase, s, e in c.spans() if phase == name) for c in commits)
            for name in ("loop lag", "to thread", "fsync", "to loop", "acks")
        }
        print(
            f"{args.label or ' '.join(args.serve) or 'default'}: load {load_start.split()[0]}"
            f"->{load_end.split()[0]}, disk {written / 1e6:.0f} MB/s (ours "
            f"{sent * args.size / span / 1e6:.0f}), cpu gateway {gateway_cpu:.2f} producer "
            f"{producer_cpu:.2f}; {sent / span:,.0f} rec/s; burst p50/p99/max "
            f"{ms(quantile(latencies, 0.5))}/{ms(quantile(latencies, 0.99))}/"
            f"{ms(latencies[-1])} ms; {len(commits) / span:.0f} commits/s; p99 "
            + ", ".join(f"{name} {ms(quantile(v, 0.99))}" for name, v in phases.items())
            + f"; loop stalls {len(trace.stalls)}, {ms(sum(s for _, s in trace.stalls))} ms "
            f"(ran {ms(sum(c for _, c, _ in trace.stall_use))}, waited for CPU "
            f"{ms(sum(w for _, _, w in trace.stall_use))}), longest "
            f"{ms(max((s for _, s in trace.stalls), default=0.0))} ms; producer loop stalls "
            f"{ms(sum(x[1] for x in producer_stalls.stalls))} ms (waited for CPU "
            f"{ms(sum(x[3] for x in producer_stalls.stalls))})"
        )
        shutil.rmtree(base, ignore_errors=True)
        return 0
    print(
        f"# {len(latencies)} bursts at {args.rate:,.0f} rec/s of {args.size} B for "
        f"{args.seconds:g} s; serve options {args.serve or '(none)'}; switch interval "
        f"{trace.header.get('switch_interval_s')} s; "
        f"load average {load_start} at start, {load_end} at end; the machine's disk writes "
        f"{written / 1e6:.0f} MB/s (ours {sent * args.size / span / 1e6:.0f} of records); "
        f"CPU: gateway {gateway_cpu:.2f}, this producer {producer_cpu:.2f} cores"
    )
    print(
        f"# burst p50 / p99 / max: {ms(quantile(latencies, 0.5))} / "
        f"{ms(quantile(latencies, 0.99))} / {ms(latencies[-1])} ms\n"
    )
    print(commit_report(trace))
    slow = None if args.slow_ms is None else args.slow_ms / 1e3
    print("\nBursts (first send() to flush() returning):\n")
    print(
        describe(
            join_bursts(trace, "probe", bursts, producer_gc, producer_stalls),
            "burst",
            BURST_PARTS,
            slow,
        )
    )
    print("\n" + producer_stalls.summary())
    print("\nAcked batches (gateway: from arrival to Ack written):\n")
    print(describe(batch_samples(trace), "latency", GATEWAY_PHASES, slow))
    shutil.rmtree(base, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--analyze", metavar="TRACE", help="report on a gateway trace file")
    parser.add_argument("--rate", type=float, default=1_200_000, help="records per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the load lasts")
    parser.add_argument("--size", type=int, default=100, help="bytes per record")
    parser.add_argument("--slow-ms", type=float, help="a slow burst (default: the p99)")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        help="the gateway process's sys.setswitchinterval (default: Python's, 5 ms)",
    )
    parser.add_argument("--brief", action="store_true", help="one line per run")
    parser.add_argument("--label", help="the run's name in --brief's line")
    parser.add_argument("--keep-trace", metavar="FILE", help="write the gateway's trace here")
    parser.add_argument("serve", nargs="*", help="extra `headgate serve` options, after --")
    args = parser.parse_args()
    if args.analyze:
        print(analyze(Path(args.analyze), args.slow_ms))
        return 0
    return probe(args)


if __name__ == "__main__":
    sys.exit(main())
