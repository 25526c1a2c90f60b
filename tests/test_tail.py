"""``headgate tail`` as a real process against a real ``headgate serve``."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HEADGATE = [sys.executable, "-m", "headgate.cli"]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    proc = subprocess.Popen(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(20)


def send(address: str, stream: str, lines: list[str], tmp_path: Path) -> None:
    source = tmp_path / f"{stream}-{time.monotonic_ns()}.txt"
    source.write_text("".join(line + "\n" for line in lines))
    done = subprocess.run(
        [*HEADGATE, "send", stream, str(source), "--gateway", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def tail(address: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HEADGATE, "tail", *args, "--gateway", address],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_tail_from_earliest_prints_records_as_json_with_positions(
    served: str, tmp_path: Path
) -> None:
    send(served, "events", [f"event {i}" for i in range(5)], tmp_path)
    done = tail(served, "events", "--from", "earliest", "--count", "5", "--format", "json")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["value"] for r in records] == [f"event {i}" for i in range(5)]
    assert [r["sequence"] for r in records] == list(range(5))
    assert {r["stream"] for r in records} == {"events"}
    assert all(r["position"] >= 0 and r["ingest_time"].startswith("20") for r in records)


def test_tail_from_now_shows_only_new_records(served: str, tmp_path: Path) -> None:
    send(served, "events", ["old"], tmp_path)
    proc = subprocess.Popen(
        [*HEADGATE, "tail", "events", "--gateway", served, "--count", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.0)  # the subscription is in place
        send(served, "events", ["new 1", "new 2", "new 3"], tmp_path)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["new 1", "new 2", "new 3"]


def test_tail_from_a_position_and_sampled(served: str, tmp_path: Path) -> None:
    for batch in range(4):
        send(served, "s", [f"b{batch}"], tmp_path)  # one batch (one frame) per send
    everything = tail(served, "s", "--from", "earliest", "--count", "4", "--format", "json")
    positions = [json.loads(line)["position"] for line in everything.stdout.splitlines()]
    assert len(positions) == 4
    later = tail(served, "s", "--from", str(positions[2]), "--count", "2")
    assert later.stdout.splitlines() == ["b2", "b3"]
    sampled = tail(served, "s", "--from", "earliest", "--sample", "2", "--count", "2")
    assert sampled.stdout.splitlines() == ["b0", "b2"]


def test_tail_from_a_record_address_starts_at_that_record_inside_its_batch(
    served: str, tmp_path: Path
) -> None:
    send(served, "s", [f"r{i}" for i in range(6)], tmp_path)  # one send: one batch
    everything = tail(served, "s", "--from", "earliest", "--count", "6", "--format", "json")
    records = [json.loads(line) for line in everything.stdout.splitlines()]
    # Issue 14: all three (here six) records showed the same position and nothing else.
    addresses = [(r["position"], r["index"]) for r in records]
    assert addresses == [(records[0]["position"], i) for i in range(6)], addresses
    position = records[0]["position"]
    inside = tail(served, "s", "--from", f"{position}:4", "--count", "2", "--format", "json")
    assert inside.returncode == 0, inside.stderr
    assert [json.loads(line) for line in inside.stdout.splitlines()] == records[4:6]
    plain = tail(served, "s", "--from", f"{position}:2", "--count", "1")
    assert plain.stdout.splitlines() == ["r2"]
    past = tail(served, "s", "--from", f"{position}:6", "--count", "1")
    assert past.returncode == 1
    assert past.stderr.splitlines() == [
        f"headgate tail: record address {position}:6 is past the end of its batch in 's': "
        f"the batch at position {position} holds 6 records (indexes 0 to 5)"
    ]
    for hostile, why in [
        ("-1", "'-1' is not a record address (POSITION or POSITION:INDEX)"),
        (f"{position}:-1", "is not a record address"),
        ("1:2:3", "is not a record address"),
        ("12x", "is not a record address"),
        (str(2**63), "position 9223372036854775808 is larger than a log position can be"),
        ("0:" + "9" * 30, "is larger than a batch can hold"),
    ]:
        refused = tail(served, "s", "--from", hostile)
        assert refused.returncode == 2, refused.stderr
        assert why in refused.stderr and "Traceback" not in refused.stderr, refused.stderr


def test_tail_errors_are_clear(served: str, tmp_path: Path) -> None:
    bad_from = tail(served, "s", "--from", "yesterday")
    assert bad_from.returncode == 2
    assert "--from must be now, earliest or a log position" in bad_from.stderr
    unknown = tail(served, "ghost")
    assert unknown.returncode == 1
    assert unknown.stderr.splitlines() == [
        f"headgate tail: gateway {served} has no stream called 'ghost'"
    ]
    send(served, "s", ["x"], tmp_path)
    beyond = tail(served, "s", "--from", "99999999")
    assert beyond.returncode == 1
    assert re.fullmatch(
        r"headgate tail: position 99999999 is not in stream 's', which holds positions "
        r"0 to [1-9]\d*; use --from earliest or now\n",
        beyond.stderr,
    ), beyond.stderr
    # Issue 14: inside a batch, the answer was UNEXPECTED_FRAME and the
    # gateway's term file path.
    inside = tail(served, "s", "--from", "3")
    assert inside.returncode == 1
    assert inside.stderr.splitlines() == [
        "headgate tail: position 3 is not where a batch of 's' starts; use --from "
        "earliest, now, or a position that `headgate tail --format json` printed"
    ]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = tail(f"127.0.0.1:{port}", "s")
    assert down.returncode == 1
    assert f"cannot connect to gateway 127.0.0.1:{port}" in down.stderr
    assert "Traceback" not in down.stderr
