"""``headgate send STREAM FILE --cluster cluster.toml``: lines over a fleet of real gateways
(``headgate serve`` processes on 127.0.0.1), a gateway down, and every mistake in one line."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.cluster import load_cluster
from tests.client.test_fleet import GATEWAYS, Fleet
from tests.serving import HEADGATE

PRODUCER_ID = 4242


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop_all()


def lines_file(path: Path, count: int) -> list[bytes]:
    # 200-byte lines: about 1.3 sticky batches of 256 KiB per 1,300 lines.
    lines = [b"line-%06d-" % i + b"x" * 188 for i in range(count)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return lines


def send(fleet: Fleet, source: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *HEADGATE,
            *("send", "events", str(source), "--cluster", str(fleet.cluster)),
            *("--producer-id", str(PRODUCER_ID), *extra),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_send_cluster_spreads_the_lines_over_every_gateway_once(fleet: Fleet) -> None:
    for name in GATEWAYS:
        fleet.start(name)
    lines = lines_file(fleet.root / "in.txt", 6000)
    result = send(fleet, fleet.root / "in.txt")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("6,000 records (")
    assert result.stdout.rstrip().endswith("acknowledged durable on events (gw1, gw2, gw3)")
    assert "Traceback" not in result.stderr
    fleet.stop_all()
    landed = fleet.partition_values("events", PRODUCER_ID)
    assert sorted(v for values in landed.values() for v in values) == lines
    # Sticky batches of 256 KiB, round robin: 1.2 MB of lines reach several partitions.
    assert sum(len(values) > 0 for values in landed.values()) >= 4


def test_send_cluster_goes_on_without_a_gateway_that_is_down_and_names_it(fleet: Fleet) -> None:
    fleet.start("gw1")
    fleet.start("gw2")  # gw3 never starts
    lines = lines_file(fleet.root / "in.txt", 3000)
    result = send(fleet, fleet.root / "in.txt", "--timeout", "2")
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "gw3" in line]
    assert len(warning) == 1, result.stderr
    assert warning[0].startswith(f"headgate send: gateway gw3 ({fleet.address('gw3')}): ")
    assert "connection refused" in warning[0]
    fleet.stop_all()
    landed = fleet.partition_values("events", PRODUCER_ID)
    assert sorted(v for values in landed.values() for v in values) == lines
    partitions = load_cluster(fleet.cluster).stream("events").partitions
    assert all(not landed[p.index] for p in partitions if p.gateway == "gw3")


def test_send_cluster_with_no_gateway_up_says_so_in_one_line(fleet: Fleet) -> None:
    lines_file(fleet.root / "in.txt", 10)
    result = send(fleet, fleet.root / "in.txt", "--timeout", "1")
    assert result.returncode == 1, result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("headgate send: no gateway of events answered within 1 s: ")
    for name in GATEWAYS:
        assert f"{name} ({fleet.address(name)}): connection refused" in errors[0]


@pytest.mark.parametrize(
    ("edit", "stream", "expected"),
    [
        (None, "nothing", "the cluster has no partitioned stream 'nothing'"),
        ("gw1 = [0, 1, 3]", "orders", "partition 1 is held by both gw1 and gw2"),
        ("missing", "orders", "does not exist"),
        ("not toml [", "orders", "cluster.toml"),
    ],
)
def test_send_cluster_with_a_bad_file_or_stream_says_why_in_one_line(
    tmp_path: Path, edit: str | None, stream: str, expected: str
) -> None:
    fleet = Fleet(tmp_path)  # never started: the file is checked first
    if edit == "missing":
        fleet.cluster.unlink()
    elif edit == "not toml [":
        fleet.cluster.write_text("not toml [\n", encoding="utf-8")
    elif edit is not None:
        text = fleet.cluster.read_text(encoding="utf-8")
        fleet.cluster.write_text(text.replace("gw1 = [0, 3]", edit), encoding="utf-8")
    source = lines_file(tmp_path / "in.txt", 3) and tmp_path / "in.txt"
    result = CliRunner().invoke(
        main, ["send", stream, str(source), "--cluster", str(fleet.cluster)]
    )
    assert result.exit_code == 2, result.output
    errors = result.output.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("headgate send: "), result.output
    assert expected in errors[0]


def test_send_help_names_cluster_and_a_fleet_refuses_one_secret(tmp_path: Path) -> None:
    shown = CliRunner().invoke(main, ["send", "--help"])
    assert shown.exit_code == 0
    assert "--cluster" in shown.output and "partitioned over this cluster" in shown.output
    fleet = Fleet(tmp_path)
    result = CliRunner().invoke(
        main,
        [
            *("send", "events", "-", "--cluster", str(fleet.cluster)),
            *("--producer-id", "1", "--producer-secret", "abcd"),
        ],
    )
    assert result.exit_code == 2
    assert "--producer-secret does not go with --cluster" in result.output
