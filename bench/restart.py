"""Benchmark: how long `headgate serve` takes to restart after a SIGKILL, with logs on disk.

    .venv/bin/python bench/restart.py                 # 256 MiB over 1 and 16 streams, 4 KiB frames
    .venv/bin/python bench/restart.py --quick         # a few seconds
    # The full case of issue 15 (10 GB each, about 60 GB of disk for all six; see --help):
    .venv/bin/python bench/restart.py --total 10GB --streams 1,16,160 --frames 4KiB,256KiB

For each case (number of streams x frame size) the benchmark:

1. fills the logs directly with ``headgate.log.StreamLog`` (much faster than
   through a gateway): ``--total`` bytes of log spread evenly over the
   streams, frames of ``--frames`` bytes of payload, one producer per stream
   with consecutive sequences, so the gateway has dedup state to rebuild;
2. starts ``headgate serve`` on that data directory, waits for it to answer,
   and SIGKILLs it: what follows is a restart after a crash, not the first
   start over logs that no gateway ever opened;
3. ``--rounds`` times, warm (the logs in the page cache) and cold (every file
   under the data directory evicted with
   ``posix_fadvise(POSIX_FADV_DONTNEED)`` first), starts ``headgate serve``
   again and times it from the moment before ``Popen`` to the first accepted
   connection, and to every stream recovered, then SIGKILLs it.

"First accepted connection" means a TCP ``connect()`` that succeeds *and* a
Hello that gets its Welcome: the Welcome proves the event loop is running
and answering. The gateway listens before it recovers its streams, so this
is not yet when every stream serves: that is the third figure,
``recovered``, when a ListStreams sent right after the Welcome is answered
(the gateway answers a listing only once no stream is recovering, and the
benchmark checks that it lists every stream). All three are reported
(``connect``, ``welcome``, ``recovered``).

In the same run, and under the same conditions, it times ``python -c pass``
(the interpreter alone) and ``python -c "import headgate.gateway"`` (the
gateway's imports), the floor under any restart: before and after all the
cases, and before each case (``import`` on its line), with the load average
of the machine at that moment. Each figure is the median of the rounds, with
the maximum beside it. The machine may be shared; compare figures only
within one run.

The data directory is made under ``--dir`` (default: the system's temporary
folder) and deleted at the end unless ``--keep``. Check free space first
(``df -h /tmp``): each case needs ``--total`` bytes plus up to one term per
stream, and cases run one after another, each deleted before the next.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from headgate.log import StreamLog, frame_cost
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.frames import SendGlobal

_UNITS = {"": 1, "B": 1, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
_UNITS |= {"KB": 1000, "MB": 1000**2, "GB": 1000**3}
#: How long a gateway may take to answer before the run is called failed.
START_TIMEOUT_S = 300.0
#: Frames appended per append_many call while filling.
FILL_GROUP = 64


def parse_size(text: str) -> int:
    """``"4KiB"`` -> 4096, ``"10GB"`` -> 10**10."""
    upper = text.strip().upper()
    number = upper.rstrip("BKMGI")
    unit = upper[len(number) :]
    if unit not in _UNITS or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4KiB, 256MiB, 10GB)")
    return int(float(number) * _UNITS[unit])


def parse_list(kind: type, text: str) -> list[int]:
    return [parse_size(part) if kind is str else int(part) for part in text.split(",") if part]


def human(size: int) -> str:
    units = (("GiB", 1024**3), ("GB", 1000**3), ("MiB", 1024**2), ("MB", 1000**2), ("KiB", 1024))
    for unit, factor in units:
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} B"


@dataclass
class Case:
    streams: int
    frame: int
    total: int


def fill(data_dir: Path, case: Case, term_length: int) -> int:
    """Write the case's logs; return the number of frames written."""
    per_stream = case.total // case.streams // 8 * 8
    count = max(1, per_stream // frame_cost(case.frame))
    payload = os.urandom(case.frame)
    written = 0
    for index in range(case.streams):
        directory = data_dir / "streams" / f"s{index:04d}"
        # A frame never straddles two terms: each term's end is padding, up to a
        # frame, so size the log by whole terms, plus room to spare.
        frames_per_term = max(1, term_length // frame_cost(case.frame))
        terms = -(-count // frames_per_term)
        log = StreamLog.open(directory, term_length=term_length, capacity=(terms + 4) * term_length)
        try:
            sequence = 0
            producer = index + 1
            synced_at = 0
            while sequence < count:
                group = min(FILL_GROUP, count - sequence)
                log.append_many((payload, producer, sequence + i, 1, 0) for i in range(group))
                sequence += group
                if log.tail_position - synced_at >= 4 * term_length:
                    log.sync()  # keep dirty pages bounded
                    synced_at = log.tail_position
            log.sync()
        finally:
            log.close()
        written += count
    return written


def evict(data_dir: Path) -> None:
    """Drop every file under ``data_dir`` from the page cache (they are all clean)."""
    for root, _dirs, files in os.walk(data_dir):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def handshake(port: int, deadline: float, streams: int) -> tuple[float, float, float]:
    """Connect (retrying while refused), say Hello, wait for Welcome, then list the streams.

    Returns when it connected, when Welcome came, and when the listing came
    (which the gateway answers once every stream is recovered).
    """
    hello = encode_frame(
        SendGlobal(payload=m.encode_message(m.Hello(producer_id=1, client_name="bench")))
    )
    listing = encode_frame(SendGlobal(payload=m.encode_message(m.ListStreams(request_id=1))))
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=START_TIMEOUT_S)
            break
        except (ConnectionRefusedError, OSError):
            if time.perf_counter() > deadline:
                raise TimeoutError("the gateway never accepted a connection") from None
            time.sleep(0.002)
    connected = time.perf_counter()
    welcomed = None
    with sock:
        sock.sendall(hello)
        decoder = FrameDecoder(max_payload=1 << 24)
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the gateway closed the connection before listing")
            for frame in decoder.feed(chunk):
                if not isinstance(frame, SendGlobal):
                    continue
                message = m.decode_global(frame.payload)
                if isinstance(message, m.Welcome):
                    welcomed = time.perf_counter()
                    sock.sendall(listing)
                elif isinstance(message, m.StreamList):
                    if len(message.streams) != streams:
                        raise AssertionError(
                            f"listed {len(message.streams)} streams, expected {streams}"
                        )
                    assert welcomed is not None
                    return connected, welcomed, time.perf_counter()


def start_gateway(
    data_dir: Path, port: int, capacity: int, term_length: int, streams: int
) -> tuple[float, float, float]:
    """Start `headgate serve`, time it to connect, to Welcome and to recovered; SIGKILL it."""
    command = [
        sys.executable,
        "-m",
        "headgate.cli",
        "serve",
        "--data-dir",
        str(data_dir),
        "--listen",
        f"127.0.0.1:{port}",
        "--stream-capacity",
        str(capacity),
        "--term-length",
        str(term_length),
    ]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        connected, welcomed, recovered = handshake(port, started + START_TIMEOUT_S, streams)
    except BaseException:
        process.kill()
        _, err = process.communicate(timeout=30)
        sys.stderr.write(err.decode(errors="replace"))
        raise
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    return connected - started, welcomed - started, recovered - started


def time_python(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, timeout=120)
    return time.perf_counter() - started


def summary(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:7.0f} ms (max {max(values) * 1000:6.0f})"


def run_case(args: argparse.Namespace, case: Case, base: Path) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="restart-", dir=base))
    try:
        began = time.perf_counter()
        frames = fill(data_dir, case, args.term_length)
        filled = time.perf_counter() - began
        imports = [time_python(["-c", "import headgate.gateway"]) for _ in range(3)]
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"\n{case.streams} stream(s), {human(case.frame)} frames, {human(case.total)}: "
            f"{frames} frames written in {filled:.1f} s; load average {load}; "
            f"import headgate.gateway {summary(imports)}",
            flush=True,
        )
        port = free_port()
        capacity = case.total // case.streams // 8 * 8 + 4 * args.term_length
        first = start_gateway(data_dir, port, capacity, args.term_length, case.streams)
        print(
            f"  first start (then SIGKILL)    welcome {first[1] * 1000:7.0f} ms  "
            f"recovered {first[2] * 1000:7.0f} ms",
            flush=True,
        )
        modes = ["warm"] if args.no_cold else ["warm", "cold"]
        for mode in modes:
            connects: list[float] = []
            welcomes: list[float] = []
            recovers: list[float] = []
            for _ in range(args.rounds):
                if mode == "cold":
                    evict(data_dir)
                connect, welcome, recovered = start_gateway(
                    data_dir, port, capacity, args.term_length, case.streams
                )
                connects.append(connect)
                welcomes.append(welcome)
                recovers.append(recovered)
            print(
                f"  restart after SIGKILL, {mode}:  connect {summary(connects)}  "
                f"welcome {summary(welcomes)}  recovered {summary(recovers)}",
                flush=True,
            )
    finally:
        if args.keep:
            print(f"  kept {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Full case of issue 15: --total 10GB --streams 1,16,160 --frames 4KiB,256KiB",
    )
    parser.add_argument(
        "--total",
        type=parse_size,
        default=parse_size("256MiB"),
        help="log bytes per case, over all its streams (default 256MiB)",
    )
    parser.add_argument(
        "--streams",
        type=lambda t: parse_list(int, t),
        default=[1, 16],
        help="comma-separated stream counts (default 1,16)",
    )
    parser.add_argument(
        "--frames",
        type=lambda t: parse_list(str, t),
        default=[4096],
        help="comma-separated frame payload sizes (default 4KiB)",
    )
    parser.add_argument(
        "--term-length",
        type=parse_size,
        default=parse_size("16MiB"),
        help="term length of the logs (default 16MiB, the gateway's default)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="starts per mode (default 3)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache starts")
    parser.add_argument(
        "--quick", action="store_true", help="32 MiB over 1 and 16 streams, 2 rounds"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to make the data directories (default: temp folder)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the data directories")
    args = parser.parse_args()
    if args.quick:
        args.total = min(args.total, parse_size("32MiB"))
        args.rounds = min(args.rounds, 2)
    base = args.dir or Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    need = args.total + max(args.streams) * args.term_length
    if need > free * 0.9:
        print(
            f"not enough disk under {base}: a case needs {human(need)}, {free} bytes free",
            file=sys.stderr,
        )
        return 2

    commands = {"pass": "pass", "import headgate.gateway": "import headgate.gateway"}
    python: dict[str, list[float]] = {name: [] for name in commands}

    def time_all() -> None:
        for name, code in commands.items():
            python[name].append(time_python(["-c", code]))

    for _ in range(max(3, args.rounds)):
        time_all()
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; medians of {args.rounds} "
        f"round(s), from Popen to connect(), to Welcome and to every stream recovered"
    )
    for name, values in python.items():
        print(f"  python -c {name!r:28} {summary(values)}")
    for streams in args.streams:
        for frame in args.frames:
            run_case(args, Case(streams=streams, frame=frame, total=args.total), base)
    # Once more at the end: the machine may have got busier meanwhile.
    for _ in range(max(3, args.rounds)):
        time_all()
    print("\nbefore and after the cases together:")
    for name, values in python.items():
        print(f"  python -c {name!r:28} {summary(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
