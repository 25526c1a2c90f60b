"""``headgate pipeline CONFIG.toml`` end to end, in this process's shared SparkSession.

A real gateway (TCP and a Unix socket) fed by a real producer; the command
runs availableNow twice, and after each run every stream's Parquet holds
exactly its good records (json with a transform and partitions, csv with
options, raw), the bad ones are dead letters, and the releases reached the
gateway over its Unix socket: its logs' release positions are at their tails.
The audit stream's log is too small for the first load, so its producer waits
until the command's releases give it credit back.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.cli.demo import BackgroundLoop
from headgate.client import SyncProducer
from headgate.config import GatewayConfig, StreamSettings
from headgate.gateway import Gateway, GatewayStreamStatistics


class Served:
    def __init__(self, data_dir: Path, sock: Path) -> None:
        self.loop = BackgroundLoop("test-gateway")
        self.gateway = Gateway(
            GatewayConfig(
                listen=("127.0.0.1", 0),
                unix_socket=sock,
                data_dir=data_dir,
                term_length=64 * 1024,
                max_message_size=16 * 1024,
                stream_capacity=512 * 1024,
                # Less than the first audit load: usable space is the capacity
                # minus a reserve of (terms + 2) maximum frames, so 64 KiB.
                streams={"audit": StreamSettings(capacity=128 * 1024)},
            )
        )
        self.loop.run(self.gateway.start(), 30)
        host, port = self.gateway.address
        self.tcp = f"{host}:{port}"

    def stats(self) -> dict[str, GatewayStreamStatistics]:
        async def snapshot() -> dict[str, GatewayStreamStatistics]:
            return {s.name: s for s in self.gateway.statistics()}

        result: dict[str, GatewayStreamStatistics] = self.loop.run(snapshot(), 10)
        return result

    def stop(self) -> None:
        self.loop.run(self.gateway.stop(), 30)
        self.loop.stop()


@pytest.fixture
def sock() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))
    try:
        yield directory / "gw.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def tick(i: int) -> bytes:
    price = -1.0 if i % 20 == 5 else float(i + 1)  # the transform drops price <= 0
    return json.dumps({"symbol": "AB" if i % 2 else "CD", "price": price}).encode()


BAD_TICKS = {7: b"{not json", 11: b'{"symbol": "AB", "price": "cheap"}', 13: b'{"other": 1}'}
BAD_CSV = {3: b"u3;many;Start", 8: b"only;two"}


def make_ticks(first: int, count: int) -> list[bytes]:
    return [BAD_TICKS.get(i, tick(i)) for i in range(first, first + count)]


def make_csv(first: int, count: int) -> list[bytes]:
    rows = range(first, first + count)
    return [BAD_CSV.get(i, b"u%d;%s;Start" % (i, b"-" if i % 4 else b"%d" % i)) for i in rows]


def expected_ticks(total: int) -> set[tuple[str, float, int]]:
    out = set()
    for i in range(total):
        if i in BAD_TICKS:
            continue
        value = json.loads(tick(i))
        if value["price"] > 0:
            out.add((value["symbol"], value["price"] * 2, i))
    return out


def audit(i: int) -> bytes:
    return b"audit-%05d-" % i + b"x" * 100


AUDIT_PHASES = [(0, 800), (800, 15)]


def flush_in_background(producer: SyncProducer) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def flush() -> None:
        try:
            producer.flush(120)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=flush, daemon=True)
    thread.start()
    return thread, errors


def wait_until_stuck(producer: SyncProducer, stream: str, total: int) -> int:
    """Wait (bounded) until the stream's acks stop moving short of ``total``."""
    deadline = time.monotonic() + 30
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        acked = producer.statistics().streams[stream].records_acked
        assert acked < total, "the log was meant to be too small for the load"
        if acked != last:
            last, since = acked, time.monotonic()
        elif time.monotonic() - since > 1.0:
            return acked
        time.sleep(0.1)
    raise AssertionError("the producer never stopped for want of credit")


def run_command(config: Path) -> str:
    result = CliRunner().invoke(main, ["pipeline", str(config), "--available-now"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_the_command_writes_each_format_exactly_once_and_releases_to_the_gateway(
    spark: Any, tmp_path: Path, sock: Path
) -> None:
    data = tmp_path / "data"
    out = tmp_path / "out"
    served = Served(data, sock)
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f"""
data_dir = "{data}"
gateway = "unix:{sock}"
output_dir = "{out}"
checkpoint_dir = "{tmp_path / "checkpoints"}"

[streams.ticks]
format = "json"
schema = "symbol STRING, price DOUBLE"
transform = "SELECT symbol, price * 2 AS doubled, sequence FROM ticks WHERE price > 0"
partition_by = ["symbol"]
max_records_per_trigger = 25

[streams.radius-acct]
format = "csv"
schema = "user STRING, octets BIGINT, status STRING"
options = {{ sep = ";", nullValue = "-" }}
transform = "SELECT user, octets, status FROM `radius-acct`"

[streams.audit]
format = "raw"
output = "{tmp_path / "audit-out"}"
"""
    )
    try:
        with SyncProducer(served.tcp, producer_id=5, connect_timeout=10) as producer:
            phases = zip([(0, 60), (60, 15)], AUDIT_PHASES, strict=True)
            for phase, ((first, count), (a_first, a_count)) in enumerate(phases):
                for value in make_ticks(first, count):
                    producer.send("ticks", value)
                for value in make_csv(first, count):
                    producer.send("radius-acct", value)
                numbers = range(a_first, a_first + a_count)
                producer.send_many(
                    "audit", [audit(i) for i in numbers], [b"k%d" % i for i in numbers]
                )
                flushing, errors = flush_in_background(producer)
                if phase == 0:
                    wait_until_stuck(producer, "audit", a_count)
                    assert flushing.is_alive(), "audit waits for credit"
                else:
                    flushing.join(60)

                output = run_command(config)

                flushing.join(60)
                assert not flushing.is_alive() and not errors, "the releases gave credit back"

                total = first + count
                assert "ticks:" in output and "released" in output, output
                assert "not confirmed" not in output and "not reported" not in output, output
                ticks = pq.read_table(out / "ticks").to_pydict()
                rows = list(zip(ticks["symbol"], ticks["doubled"], ticks["sequence"], strict=True))
                assert len(rows) == len(set(rows)), "nothing twice"
                assert set(rows) == expected_ticks(total)
                assert (out / "ticks" / "symbol=AB").is_dir(), "partitioned by symbol"
                dead = pq.read_table(out / "_dead_letters" / "ticks").to_pydict()
                assert sorted(dead["sequence"]) == sorted(BAD_TICKS)
                assert dead["raw"][dead["sequence"].index(7)] == b"{not json"
                assert any("none of the fields" in e for e in dead["error"])

                radius = pq.read_table(out / "radius-acct").to_pydict()
                good_csv = [i for i in range(total) if i not in BAD_CSV]
                users = sorted(zip(radius["user"], radius["octets"], strict=True))
                assert users == sorted((f"u{i}", None if i % 4 else i) for i in good_csv), (
                    "each good row once; nullValue '-' reads as null"
                )
                dead_csv = pq.read_table(out / "_dead_letters" / "radius-acct").to_pydict()
                assert sorted(dead_csv["sequence"]) == sorted(BAD_CSV)

                written = pq.read_table(tmp_path / "audit-out").to_pydict()
                a_total = a_first + a_count
                assert len(written["value"]) == len(set(written["value"])), "nothing twice"
                assert set(written["key"]) == {b"k%d" % int(v[6:11]) for v in written["value"]}
                if phase == 0:
                    # The run read what the log held when it started; the rest
                    # came in with the credit its releases gave.
                    assert 0 < len(written["value"]) < a_total
                    assert set(written["value"]) < {audit(i) for i in range(a_total)}
                else:
                    assert sorted(written["value"]) == [audit(i) for i in range(a_total)]

                for name, stats in served.stats().items():
                    if phase == 0 and name == "audit":
                        assert 0 < stats.release_position < stats.tail_position
                        continue
                    assert stats.release_position == stats.tail_position, (phase, name, output)
                    assert stats.free_capacity == stats.capacity
    finally:
        served.stop()
    assert spark.range(3).count() == 3, "the shared session is still running"


@pytest.mark.parametrize(
    ("stream", "fragments"),
    [
        ("format = 'json'\nschema = 'a INT b'", ["streams.s.schema: not a DDL schema"]),
        ("format = 'csv'\nschema = 'a INTEGRAL'", ["streams.s.schema: not a DDL schema"]),
        ("format = 'json'\nschema = 'position INT'", ["streams.s.schema: field 'position'"]),
        (
            "format = 'json'\nschema = 'a INT'\ntransform = 'SELECT nope FROM s'",
            ["streams.s.transform:", "`nope` cannot be resolved"],
        ),
        ("transform = 'SELEC value FROM s'", ["streams.s.transform:", "SELEC"]),
        (
            "format = 'json'\nschema = 'a INT'\npartition_by = ['b']",
            ["streams.s.partition_by: b not among the output columns", "stream, position"],
        ),
    ],
)
def test_schemas_sql_and_partitions_are_checked_before_any_query_starts(
    spark: Any, tmp_path: Path, stream: str, fragments: list[str]
) -> None:
    (tmp_path / "data").mkdir()
    config = tmp_path / "p.toml"
    config.write_text(f"data_dir = '{tmp_path / 'data'}'\n[streams.s]\n{stream}\n")
    result = CliRunner().invoke(main, ["pipeline", str(config), "--available-now"])
    assert result.exit_code == 2, result.output
    assert str(config) in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output
    assert "Traceback" not in result.output and "at org.apache" not in result.output
    assert not (tmp_path / "data" / "checkpoints").exists(), "no query started"
    assert not spark.streams.active


def parquet_values(path: Path) -> list[bytes]:
    try:
        # Before the first batch lands there may be only a hidden staging directory.
        values: list[bytes] = pq.read_table(path).to_pydict().get("value", [])
    except (FileNotFoundError, OSError):
        return []
    return values


def wait_for_rows(path: Path, count: int, runner: threading.Thread) -> list[bytes]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and runner.is_alive():
        values = parquet_values(path)
        if len(values) >= count:
            return values
        time.sleep(0.2)
    raise AssertionError(f"only {len(parquet_values(path))} of {count} rows reached {path}")


def test_the_running_pipeline_follows_the_log_until_told_to_stop(
    spark: Any, tmp_path: Path, sock: Path
) -> None:
    from headgate.spark.command import run_pipeline_file

    data = tmp_path / "data"
    served = Served(data, sock)
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f'data_dir = "{data}"\ngateway = "{served.tcp}"\n'
        "[streams.live]\nformat = 'raw'\ntrigger_seconds = 0.2\n"
    )
    lines: list[str] = []
    stop = threading.Event()
    status: list[int] = []

    def run() -> None:
        status.append(
            run_pipeline_file(
                config, available_now=False, echo=lines.append, status_seconds=0.5, stop=stop
            )
        )

    runner = threading.Thread(target=run, daemon=True)
    output = data / "parquet" / "live"
    try:
        with SyncProducer(served.tcp, producer_id=9, connect_timeout=10) as producer:
            producer.send_many("live", [b"a%d" % i for i in range(100)])
            producer.flush(30)
            runner.start()
            wait_for_rows(output, 100, runner)
            producer.send_many("live", [b"b%d" % i for i in range(100)])  # while it runs
            producer.flush(30)
            values = wait_for_rows(output, 200, runner)
        stop.set()
        runner.join(120)
        assert not runner.is_alive() and status == [0], lines
        stats = served.stats()["live"]
    finally:
        stop.set()
        served.stop()
    expected = [b"a%d" % i for i in range(100)] + [b"b%d" % i for i in range(100)]
    assert sorted(values) == sorted(expected) == sorted(parquet_values(output))
    assert any(line.startswith("live: ") and "batches" in line for line in lines), lines
    assert any(line.startswith("stopping") for line in lines), lines
    assert lines[-1].endswith("released"), lines
    assert stats.release_position == stats.tail_position


def test_names_that_need_quoting_parse_and_bad_values_are_told_apart(spark: Any) -> None:
    import datetime

    from headgate.spark.pipeline import pipeline_config_from_dict, plan_stream
    from headgate.spark.source import SCHEMA
    from headgate.spark.transform import parse_batch

    config = pipeline_config_from_dict(
        {
            "streams": {
                "odd-name": {
                    "format": "json",
                    "schema": "`a b` INT, s STRUCT<`x y`: STRING>",
                    "transform": "SELECT `a b`, s.`x y` AS xy, sequence FROM `odd-name`",
                }
            }
        }
    )
    plan = plan_stream(spark, config, config.streams[0])
    assert plan.view == "`odd-name`"
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    values = [b'{"a b": 1, "s": {"x y": "q"}}', b'{"a b": "one"}', b'{"c": 3}', b"[1,"]
    batch = spark.createDataFrame(
        [("odd-name", 0, i, 1, i, now, None, v) for i, v in enumerate(values)], SCHEMA
    )
    good, bad = parse_batch(plan, batch)
    assert [(r["a b"], r["s"]["x y"]) for r in good.collect()] == [(1, "q")]
    assert bad is not None
    errors = {r["sequence"]: r["error"] for r in bad.collect()}
    assert sorted(errors) == [1, 2, 3]
    assert "not valid json" in errors[1] and "not valid json" in errors[3]
    assert "none of the fields" in errors[2]
